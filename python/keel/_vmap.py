"""Batching rules: ``torch.vmap`` over a Keel op runs its kernel once.

Without a rule, functorch runs a custom op once per example, with torch's
"performance drop" warning (softmax over 64 examples of ``[8, 64]``: 436 us
against 21 us for one call on the ``[64, 8, 64]`` tensor, measured). Keel's ops
work row by row, so all the examples' rows can go through one call:

- ``STACK``: ops that take any number of leading dims (the norms, the gated
  activations, softmax, and their backward ops) get the batch dim as one more
  leading dim.
- ``MERGE``: ops of a fixed rank get it merged into their first dim: rotary's
  ``[batch, seq, heads, head_dim]`` and cross-entropy's ``[N, C]`` rows, the
  latter only with ``reduction="none"`` (a reduced loss is one number an
  example).

Keel's checks run first on meta stand-ins shaped like one example, so a bad
argument raises the error that the op, called on an example, would raise.
Row-wise kernels give each row the same bits whatever the rows around it, so
the results are the per-example calls' (the tests compare them bit for bit on
the CPU).

Where one call cannot keep the per-example meaning (a per-feature argument,
weight, bias, cos or sin, that differs between examples; a reduced
cross-entropy; an example of another rank than the op's), the rule calls the op
once per example and stacks the results, as torch's fallback does, without
its warning. The norms' backward ops (``PER_EXAMPLE_SUMS``) fold too: the
input's gradient is the per-example calls' bits, and the weight's and bias's,
which the kernel sums over all the rows it gets, are summed again over each
example's rows (the norm's forward op without weight, times the gradient, in
the accumulation dtype; within the rounding of a sum in another order).
torch's fallback called the op once an example, with its warning, and
per-example gradients (``vmap(grad(...))``) met it on every norm
(docs/BENCHMARKS.md, session 107).

The in-place ops (``INPLACE_SPECS``), which torch's fallback refuses (it takes
no op that writes its arguments), write the examples' rows in place in one call
(the batch dim moved to the front of a view of the tensor written; rotary's
merged into its batch dim where a view allows, else once an example), or once
an example where a weight, cos or sin differs between examples. A tensor they
write must be batched where another argument is, as for torch's own in-place
ops: each example's result needs a place of its own.

The rule runs below the vmap level (the op's autograd kernel sees plain
tensors, so gradients through ``torch.vmap`` of a Keel op use Keel's backward,
and ``torch.autograd.grad(..., is_grads_batched=True)`` reaches the backward
ops' rules). Registered straight on ``FuncTorchBatched`` with functorch's own
unwrapping: a prototype of the softmax rule above took 68 us so, against 166 us
through ``torch.library.register_vmap``'s generic (pytree) wrapper, measured on
one thread; the rule with Keel's checks takes about 100 us (docs/BENCHMARKS.md,
session 100). Where this torch lacks those internals, the same rules go through
``torch.library.register_vmap``.
"""
import torch

from . import _twice
from ._common import acc_dtype, nograd, one_device, rows_in_place

STACK, MERGE = "stack", "merge"

# Op -> (how, rows, params, rank): the argument positions of the tensors whose
# leading dims are rows (the logits or x first), and of the per-feature tensors
# (one for all rows), and the rank of that first tensor's examples that MERGE
# folds (None for STACK).
SPECS = {
    "rms_norm": (STACK, (0,), (1,), None),
    "layer_norm": (STACK, (0,), (1, 2), None),
    "fused_add_rms_norm": (STACK, (0, 1), (2,), None),
    "silu_and_mul": (STACK, (0,), (), None),
    "gelu_and_mul": (STACK, (0,), (), None),
    "softmax": (STACK, (0,), (), None),
    "softmax_backward": (STACK, (0, 1), (), None),
    "silu_and_mul_backward": (STACK, (0, 1), (), None),
    "gelu_and_mul_backward": (STACK, (0, 1), (), None),
    "rotary_embedding": (MERGE, (0,), (1, 2), 4),
    "rotary_embedding_backward": (MERGE, (0,), (1, 2), 4),
    "cross_entropy": (MERGE, (0, 1), (5,), 2),
    "cross_entropy_with_lse": (MERGE, (0, 1), (5,), 2),
    "cross_entropy_backward": (MERGE, (1, 0, 2, 6), (7,), 2),
    "rms_norm_backward": (STACK, (0, 1), (2,), None),
    "layer_norm_backward": (STACK, (0, 1), (2, 3), None),
    "fused_add_rms_norm_backward": (STACK, (0, 1, 2), (3,), None),
}

PER_EXAMPLE_SUMS = ("rms_norm_backward", "layer_norm_backward", "fused_add_rms_norm_backward")
"""Ops whose per-feature gradients (outputs after the first) sum over the
rows: one call on the folded rows gives them summed over every example, so
each example's are summed again from its rows (:func:`_per_example_sums`)."""

# Where each cross-entropy op has its `reduction` (MERGE folds only "none").
_REDUCTION = {"cross_entropy": 4, "cross_entropy_with_lse": 4, "cross_entropy_backward": 5}

_LIB = None


def _foldable(name, args, dims):
    """Whether one call on the folded rows keeps each example's meaning."""
    how, rows, params, rank = SPECS[name]
    if any(i < len(args) and dims[i] is not None for i in params):
        return False
    if name in _REDUCTION:
        at = _REDUCTION[name]
        if (args[at] if at < len(args) else "mean") != "none":
            return False
    for i in rows:
        a = args[i] if i < len(args) else None
        if a is None:
            continue
        if not isinstance(a, torch.Tensor):
            return False  # the op's own error, from a per-example call
        per_example = a.dim() - (dims[i] is not None)
        # STACK needs a last dim for the op to keep; the op refuses a 0-dim example.
        if per_example < 1 or (how == MERGE and i == rows[0] and per_example != rank):
            return False
    return True


def _example_metas(args, dims):
    """Meta stand-ins for one example: each tensor without its batch dim."""
    out = []
    for a, d in zip(args, dims):
        if isinstance(a, torch.Tensor):
            shape = a.shape if d is None else a.shape[:d] + a.shape[d + 1 :]
            a = torch.empty(shape, dtype=a.dtype, device="meta")
        out.append(a)
    return out


def _fold(name, call, check, names, args, dims, size):
    """`call` once on the examples' rows (:data:`SPECS`), after Keel's checks on
    one example (`check`: the op's twin, on meta stand-ins; and one device for
    the arguments, `names` their schema names).
    Returns the outputs, batch dim first; empty ones where there are no examples."""
    how, rows, _, _ = SPECS[name]
    device = one_device(name, zip(names, args))
    metas = check(*_example_metas(args, dims))
    metas = metas if isinstance(metas, tuple) else (metas,)
    if size == 0:
        return tuple(torch.empty((0, *m.shape), dtype=m.dtype, device=device) for m in metas)
    folded = list(args)
    for i in rows:
        a = args[i] if i < len(args) else None
        if a is not None:
            a = a.expand(size, *a.shape) if dims[i] is None else a.movedim(dims[i], 0)
            # STACK: rows the op reads through their strides stay in place (an
            # unbatched x expanded over the examples: rms_norm's backward under
            # jacrev or is_grads_batched); the op copies other layouts itself.
            folded[i] = a.flatten(0, 1).contiguous() if how == MERGE else rows_in_place(a)
    outs = call(*folded)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if how == STACK:
        return outs
    return tuple(o.view(size, *m.shape) for o, m in zip(outs, metas))


_NORMED = {
    "rms_norm_backward": lambda a, eps: torch.ops.keel.rms_norm(a, None, eps),
    "layer_norm_backward": lambda a, eps: torch.ops.keel.layer_norm(a, None, None, eps),
    "fused_add_rms_norm_backward": lambda a, eps: torch.ops.keel.rms_norm(a, None, eps),
}
"""Each norm backward op's rows normalised, no weight: its forward op (the op,
not its twin, so that a gradient through the rule stays right)."""


def _per_example_sums(name, args, dims, size, outs):
    """The norms' backward ops: `outs` (one call on all the examples' rows) with
    each per-feature gradient (weight's, bias's) summed over each example's
    rows alone, in the accumulation dtype, where the call summed them over all
    the examples. A missing weight's or bias's stays the kernel's empty one, one
    an example (`outs` give each one's shape and dtype)."""
    at = 2 if name == "fused_add_rms_norm_backward" else 1  # the rows normalised: input, or sum
    grad, x, gdim, xdim = args[0], args[at], dims[0], dims[at]
    params = SPECS[name][2]
    g = grad.expand(size, *grad.shape) if gdim is None else grad.movedim(gdim, 0)
    acc, features = acc_dtype(x), x.shape[-1]
    g = g.to(acc).reshape(size, -1, features)  # [examples, rows, features]
    sums = []
    for k, (i, meta) in enumerate(zip(params, outs[1:])):
        if args[i] is None:
            sums.append(torch.empty((size, *meta.shape), dtype=meta.dtype, device=x.device))
        elif k == 0:  # the weight's: each row's grad * normalised x, summed
            # The normalised rows by the forward kernel, in the accumulation
            # dtype (a half x widened first); an unbatched x (jacrev,
            # is_grads_batched) normalised once for all.
            a = x.to(acc)
            a = a.reshape(-1, features) if xdim is None else a.movedim(xdim, 0).reshape(size, -1, features)
            normed = _NORMED[name](a, args[-1])
            gw = (g * normed) if xdim is None else normed.mul_(g)
            sums.append(gw.sum(1).to(meta.dtype))
        else:  # the bias's: each row's grad, summed
            sums.append(g.sum(1).to(meta.dtype))
    return (outs[0], *sums)


LOOP_MIN = 1 << 16
"""The norms' backward ops (:data:`PER_EXAMPLE_SUMS`) on the CPU run once an
example (:func:`_loop`) where an example's gradient holds this many elements
or more, rather than once on all the rows and summed again
(:func:`_per_example_sums`): the per-example calls' time costs less there than
the sums' passes over the rows (4-5 in the accumulation dtype). Measured on the
2-core Xeon, ``vmap(grad(...))`` of rms_norm and layer_norm, 16 examples: at
``[256, 1024]`` an example, 1.12-1.26x in f32 and 1.44-2.81x in bf16; at
``[64, 512]`` 0.92-1.10x; at ``[16, 1024]`` 0.78-1.00x (docs/BENCHMARKS.md,
session 108). The per-feature gradients are then the per-example calls' bits.
On CUDA the sums serve at every size: their passes cost little there against a
launch an example (not measured)."""


def _loops(args, dims) -> bool:
    """Whether a norm's backward op runs once an example (:data:`LOOP_MIN`):
    `args[0]`, the gradient, is on the CPU and holds that many elements an
    example."""
    g, d = args[0], dims[0]
    if not isinstance(g, torch.Tensor) or g.device.type != "cpu":
        return False
    return g.numel() // (g.shape[d] if d is not None else 1) >= LOOP_MIN


def _example_args(args, dims, b):
    """The arguments of example `b`: each batched tensor's view of it."""
    return [a if d is None else a.select(d, b) for a, d in zip(args, dims)]


def _loop(call, args, dims, size):
    """`call` once an example, the results stacked: the vmap fallback's way."""
    results = [call(*_example_args(args, dims, b)) for b in range(size)]
    if isinstance(results[0], tuple):
        return tuple(torch.stack(r) for r in zip(*results))
    return (torch.stack(results),)


def rule(name, call, check):
    """The batching rule of op `name` (`call`: the op or its twin; `check`: its
    twin, run on meta stand-ins), in ``torch.library.register_vmap``'s form."""
    single = len(call._schema.returns) == 1
    names = [a.name for a in call._schema.arguments]

    def batched(info, dims, *args):
        size = info.batch_size
        if name in PER_EXAMPLE_SUMS and size > 0 and _loops(args, dims):
            outs = _loop(call, args, dims, size)
        elif size == 0 or _foldable(name, args, dims):
            outs = _fold(name, call, check, names, args, dims, size)
            if name in PER_EXAMPLE_SUMS and size > 0:
                outs = _per_example_sums(name, args, dims, size, outs)
        else:
            outs = _loop(call, args, dims, size)
        if single:
            return outs[0], 0
        return outs, (0,) * len(outs)

    return batched


class _Info:
    """What the rules read of ``torch.library``'s ``VmapInfo``."""

    __slots__ = ("batch_size",)

    def __init__(self, batch_size):
        self.batch_size = batch_size


def _direct(batched, call):
    """`batched` (a rule) as a ``FuncTorchBatched`` kernel: functorch's unwrap and
    wrap without ``register_vmap``'s generic (pytree) wrapper."""
    functorch = torch._C._functorch
    peek, unwrap = functorch.peek_interpreter_stack, functorch._unwrap_batched
    from torch._functorch.vmap import _add_batch_dim

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)

    def kernel(*args):
        level = peek().level()
        plain, dims, size = [], [], None
        for a in args:
            if isinstance(a, torch.Tensor):
                a, d = unwrap(a, level)
                if d is not None and size is None:
                    size = a.shape[d]
            else:
                d = None
            plain.append(a)
            dims.append(d)
        with torch._C._ExcludeDispatchKeyGuard(below):
            if size is None:  # nothing batched at this level
                return call(*plain)
            outs, out_dims = batched(_Info(size), dims, *plain) or (None, None)
        if outs is None:  # an in-place op: it wrote the batched tensors
            return None
        if isinstance(outs, tuple):
            return tuple(_add_batch_dim(o, d, level) for o, d in zip(outs, out_dims))
        return _add_batch_dim(outs, out_dims, level)

    return kernel


# In-place op -> (written, params, merge): the positions of the tensors it
# writes and of its per-feature tensors, and whether one call needs the batch
# dim merged into the first written tensor's first dim (an op of a fixed rank,
# rotary's [batch, seq, heads, head_dim]) rather than taking it as one more
# leading dim.
INPLACE_SPECS = {
    "fused_add_rms_norm_": ((0, 1), (2,), False),
    "rotary_embedding_": ((0,), (1, 2), True),
}


def _merged(t):
    """`t` (batch dim first) with the batch dim merged into the next as a
    view (writes to it reach `t`), or None where no view can (the op is then
    called once an example)."""
    try:
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])
    except RuntimeError:
        return None


def inplace_rule(name, call):
    """The batching rule of in-place op `name` (`call`: the op), in
    ``torch.library.register_vmap``'s form; it returns nothing, as the op."""
    written, params, merge = INPLACE_SPECS[name]
    names = [a.name for a in call._schema.arguments]

    def batched(info, dims, *args):
        for i in written:
            if dims[i] is None:
                raise RuntimeError(
                    f"keel::{name}: argument '{names[i]}' is written in place, so under vmap it must be batched "
                    "where another argument is (each example's result needs a place of its own), as for "
                    "torch's own in-place ops"
                )
        one_device(name, zip(names, args))
        call(*_example_metas(args, dims))  # Keel's checks, on one example's meta stand-ins
        if info.batch_size == 0:
            return None
        if all(dims[i] is None for i in params if i < len(args)):
            moved = list(args)
            for i in written:
                moved[i] = args[i].movedim(dims[i], 0)  # a view: the op writes through it
            if merge:  # the op's checks above gave the example its rank
                moved[written[0]] = _merged(moved[written[0]])
            if moved[written[0]] is not None:
                call(*moved)
                return None
        _each_example(call, args, dims, info.batch_size)
        return None

    return batched


def _each_example(call, args, dims, size):
    """In-place `call` once an example, on views of the batched tensors."""
    for b in range(size):
        call(*_example_args(args, dims, b))


def register() -> None:
    """Registers the batching rule of each op in :data:`SPECS` and of its
    ``_nograd`` twin, and of each in :data:`INPLACE_SPECS` (only where this
    torch has functorch's internals that :func:`_direct` uses: 2.10 to 2.15
    have)."""
    global _LIB
    _LIB = torch.library.Library("keel", "IMPL")
    for name in INPLACE_SPECS:
        call = getattr(torch.ops.keel, name).default
        try:
            _LIB.impl(name, _direct(inplace_rule(name, call), call), "FuncTorchBatched")
        except (AttributeError, ImportError):
            pass
    for name in SPECS:
        twin = getattr(torch.ops.keel, nograd(name)).default
        for target in (name, nograd(name)):
            call = getattr(torch.ops.keel, target).default
            batched = rule(name, call, twin)
            try:
                _LIB.impl(target, _direct(batched, call), "FuncTorchBatched")
            except (AttributeError, ImportError):
                torch.library.register_vmap(f"keel::{target}", batched, lib=_LIB)
    _twice.VMAP_RULES = True
