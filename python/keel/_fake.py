"""Fake (shape-only) kernels, so that torch.compile and torch.export keep sizes symbolic.

The stable C ABI gives a kernel its tensors' sizes as plain integers: it has no
symbolic sizes. Run on FakeTensors with symbolic sizes, the Rust Meta kernels
therefore make torch specialise every size they read. Without the kernels
here, ``torch.compile`` recompiles a function using a Keel op for each new
batch size (and falls back to eager once its recompile limit is reached), and
``torch.export`` refuses a dynamic dim.

Each kernel here builds its op's outputs from the symbolic sizes (``_RULES``:
a few lines per op). The argument checks stay the Rust Meta kernel's, so that
compile reports the same errors, naming the op and the argument, as eager: it
runs on meta tensors holding the example's concrete sizes and strides (the
sizes' hints; no guard is added), and its outputs must agree with the rule's,
or the call raises. Where a size has no hint (a data-dependent size), the
checks are left to the real kernel, at run time.

Only FakeTensors use these kernels: a tensor on the meta device still reaches
the Rust Meta kernel directly. torch's public ``register_fake`` would also
replace that Meta kernel, so the kernels are added to torch's fake-kernel
registry directly (an internal of torch, unchanged from 2.10 to 2.15; where it
is missing, Keel warns and the ops specialise as before).
"""
import contextlib
import warnings

import torch

from ._common import acc_dtype, ce_loss_dtype, one_device, nograd

ops = torch.ops.keel
# Set by register() to torch.utils._python_dispatch._disable_current_modes; until
# then (or where that fails) meta_outputs, still used by _twice, disables nothing.
_disable_current_modes = contextlib.nullcontext


def _hint(v):
    """The concrete value behind a symbolic scalar (None where it has none); any
    other value as it is."""
    if not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return v
    hint = getattr(getattr(v, "node", None), "hint", None)
    if isinstance(v, torch.SymBool):
        return hint if isinstance(hint, bool) else None
    if isinstance(v, torch.SymInt):
        return hint if isinstance(hint, int) and not isinstance(hint, bool) else None
    return float(hint) if isinstance(hint, (int, float)) else None


class _NoHint(Exception):
    """A size without a concrete value: the Meta kernel cannot run on this call."""


def _concrete(v):
    """`v` with a tensor as a meta tensor of its dtype and concrete sizes and
    strides, a symbolic scalar as its hint; raises _NoHint where one has none."""
    if isinstance(v, torch.Tensor):
        if not v._has_symbolic_sizes_strides:  # every size an int: 7 us less for two (measured)
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        sizes = [_hint(s) for s in v.shape]
        strides = [_hint(s) for s in v.stride()]
        if None in sizes or None in strides:
            raise _NoHint
        return torch.empty_strided(sizes, strides, dtype=v.dtype, device="meta")
    c = _hint(v)
    if c is None and v is not None:
        raise _NoHint
    return c


_dispatch_modes = torch._C._len_torch_dispatch_stack  # every mode, torch's own (FakeTensorMode ...) too


def _on_concrete(op, args, kwargs):
    """`op` on concrete stand-ins of the arguments (:func:`_concrete`), or
    ``_NoHint`` where a size has none."""
    try:
        cargs = [_concrete(a) for a in args]
        ckwargs = {k: _concrete(v) for k, v in kwargs.items()} if kwargs else kwargs
    except _NoHint:
        return _NoHint
    return op(*cargs, **ckwargs)


def meta_outputs(op, args, kwargs):
    """`op`'s outputs (the Rust Meta kernel's) on concrete stand-ins of the
    arguments (it raises on bad ones); None where a size has no hint. `op` is
    an op overload, or a Python caller of one (``_twice`` passes those)."""
    # Outside FakeTensorMode (and any mode above it): plain meta tensors, which
    # the dispatcher takes to the Rust Meta kernel. Where no mode is in place
    # (eager calls inside torch.func: ``_twice``), without the context manager,
    # which cost 4 us of the 29 a call took (layer_norm, measured).
    if _dispatch_modes():
        with _disable_current_modes():
            out = _on_concrete(op, args, kwargs)
    else:
        out = _on_concrete(op, args, kwargs)
    if out is _NoHint:
        return None
    if out is None:  # an op that only mutates its arguments
        return ()
    return out if isinstance(out, tuple) else (out,)


def _like(t):
    return tuple(t.shape), t.dtype


def _param_grad(p, dtype):
    """A parameter's gradient: its sizes (`[cols]`), or `[0]` where it is None."""
    return (tuple(p.shape) if p is not None else (0,)), dtype


def _gated(x):
    return (*x.shape[:-1], x.shape[-1] // 2), x.dtype


def _loss(logits, target, reduction):
    """The loss: ``_common.ce_loss_dtype`` (the logits' dtype, or float32 for
    probabilities of another, torch's promotion of the two)."""
    return ((logits.shape[0],) if reduction == "none" else ()), ce_loss_dtype(logits, target)


def _lse(logits):
    return (logits.shape[0],), acc_dtype(logits)


# Each op's outputs, (sizes, dtype) each, from its arguments (as the schema
# names them; the defaults do not matter, the Rust kernel checks the values).
_RULES = {
    "rms_norm": lambda input, weight=None, eps=1e-6, round_before_weight=False: [_like(input)],
    "rms_norm_backward": lambda grad_out, input, weight, eps: [
        _like(input),
        _param_grad(weight, input.dtype),
    ],
    "layer_norm": lambda input, weight=None, bias=None, eps=1e-5: [_like(input)],
    "layer_norm_backward": lambda grad_out, input, weight, bias, eps: [
        _like(input),
        _param_grad(weight, input.dtype),
        _param_grad(bias, input.dtype),
    ],
    "fused_add_rms_norm": lambda input, residual, weight=None, eps=1e-6, round_before_weight=False: [
        _like(input),
        _like(input),
    ],
    "fused_add_rms_norm_": lambda input, residual, weight=None, eps=1e-6, round_before_weight=False: [],
    "fused_add_rms_norm_backward": lambda grad_out, grad_sum, sum, weight, eps: [
        _like(sum),
        _param_grad(weight, sum.dtype),
    ],
    "silu_and_mul": lambda input: [_gated(input)],
    "silu_and_mul_backward": lambda grad_out, input: [_like(input)],
    "gelu_and_mul": lambda input, approximate="none": [_gated(input)],
    "gelu_and_mul_backward": lambda grad_out, input, approximate="none": [_like(input)],
    "softmax": lambda input, scale=1.0: [_like(input)],
    "softmax_backward": lambda grad_out, output, scale: [_like(output)],
    "cross_entropy": lambda logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None: [
        _loss(logits, target, reduction)
    ],
    "cross_entropy_with_lse": (
        lambda logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None: [
            _loss(logits, target, reduction),
            _lse(logits),
        ]
    ),
    "cross_entropy_backward": (
        lambda grad, logits, target, ignore_index, label_smoothing, reduction, lse=None, weight=None: [_like(logits)]
    ),
    "rotary_embedding": lambda x, cos, sin, interleaved=False: [_like(x)],
    "rotary_embedding_": lambda x, cos, sin, interleaved=False: [],
    "rotary_embedding_backward": lambda grad_out, cos, sin, interleaved: [_like(grad_out)],
}


def _agree(name, meta, fake):
    """Raises unless the Rust Meta kernel's outputs are the rule's at the hints."""
    if len(meta) != len(fake):
        raise RuntimeError(f"keel::{name}: internal error: {len(meta)} outputs from Meta, {len(fake)} from fake")
    for i, (m, f) in enumerate(zip(meta, fake)):
        if m.dtype != f.dtype or list(m.shape) != [_hint(s) for s in f.shape]:
            raise RuntimeError(
                f"keel::{name}: internal error: its fake kernel gives output {i} as "
                f"{f.dtype} {list(f.shape)}, its Meta kernel as {m.dtype} {list(m.shape)}; "
                "please report this"
            )


def _fake_kernel(name, rule, label):
    """The fake kernel of op `name` by `rule`; errors name op `label` (a twin's
    are the op's own)."""
    op = getattr(ops, name).default

    names = [a.name for a in op._schema.arguments]

    def fake(*args, **kwargs):
        device = one_device(label, [*zip(names, args), *kwargs.items()])
        meta = meta_outputs(op, args, kwargs)
        outs = tuple(torch.empty(s, dtype=d, device=device) for s, d in rule(*args, **kwargs))
        if meta is not None:
            _agree(label, meta, outs)
        if not outs:  # an op that only mutates its arguments
            return None
        return outs[0] if len(outs) == 1 else outs

    fake.__name__ = f"keel_{name}_fake"
    fake.__qualname__ = fake.__name__
    return fake


REGISTERED = False
"""Whether the fake kernels are in place (False only where torch's registry
has changed shape; then the ops specialise sizes under torch.compile)."""

NAMES = {}
"""The ops given a fake kernel (each op, and the ``_nograd`` twins of those with
autograd: ``_common.nograd``), each to the op whose rule it follows; filled by register()."""


def register() -> None:
    """Adds each op's fake kernel to torch's registry (FakeTensor reads it
    before the Meta kernel), leaving the Meta kernels as they are."""
    global REGISTERED, _disable_current_modes
    # Imported here: _autograd imports this module (through _twice).
    from ._autograd import WITH_TWIN

    NAMES.update({name: name for name in _RULES})
    NAMES.update({nograd(name): name for name in WITH_TWIN})
    try:
        from torch._library import simple_registry
        from torch._library.utils import Kernel
        from torch.utils._python_dispatch import _disable_current_modes

        holders = {name: simple_registry.singleton.find(f"keel::{name}").fake_impl for name in NAMES}
        for name, holder in holders.items():
            label = NAMES[name]
            holder.kernels.append(Kernel(_fake_kernel(name, _RULES[label], label), f"{__file__}:{name}"))
    except (ImportError, AttributeError, TypeError) as e:
        warnings.warn(
            f"keel: could not register fake kernels with this torch ({e!r}); under "
            "torch.compile and torch.export, Keel's ops will specialise sizes (recompile for each shape)",
            stacklevel=2,
        )
        return
    REGISTERED = True
