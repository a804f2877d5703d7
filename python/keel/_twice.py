"""Backwards that are themselves differentiable: the double backward.

Keel's backward operators (``keel::rms_norm_backward`` ...) have no autograd
formula of their own, so a backward run with ``create_graph=True`` (gradient
penalties, Hessian-vector products, ``torch.autograd.functional.hessian``)
would go through them with torch's "not implemented" fallback: a warning and a
second derivative of zero. Instead, the formulas in ``_autograd`` call these
functions when grad mode is on inside the backward, which is exactly when the
backward must record a graph: each recomputes the op from its saved inputs in
torch's own differentiable ops (with Keel's accumulation dtype) and takes the
vector-Jacobian product with ``create_graph=True``. A plain ``backward()``
(grad mode off in the backward) keeps the fused Keel backward kernels.

Forward-mode AD and ``torch.func`` transforms are the same story: torch drops a
custom op's tangents, and runs no custom op's autograd inside ``torch.func``, so
there the typed API (``keel.rms_norm`` ...) returns these torch-op versions after
Keel's argument checks (``through_torch``), and a Keel backward that meets dual
gradients takes the path above. Under reverse-mode transforms alone, where no
second derivative can follow, the ops' ``autograd.Function`` of ``_func`` serves
instead, with Keel's kernels; a backward of one that a transform does
differentiate takes :func:`vjp` through ``torch.func.vjp``.
"""
import math

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad as _fwad

from . import _func
from ._common import acc_dtype, ce_loss_dtype, class_weighted, one_device, plus, rows_in_place, times
from ._fake import meta_outputs
from ._target_checks import checking, out_of_range, raise_first


def wanted(*tensors) -> bool:
    """True inside a backward that must itself be differentiable: one that records
    a graph, or runs on dual tensors of forward-mode AD (forward-over-reverse:
    a tensor among `tensors`, the backward's gradients and saved tensors,
    carries a tangent). A backward run inside ``forward_ad.dual_level()`` on
    tensors without one keeps Keel's kernels: ``loss.backward()`` inside the
    level, after the tangents were taken (rms_norm's backward ``[4096, 4096]``
    f32: 23 against 87-95 ms, docs/BENCHMARKS.md session 117)."""
    return torch.is_grad_enabled() or (_fwad._current_level >= 0 and has_tangent(tensors))


def functorch_on() -> bool:
    """True inside a ``torch.func`` transform (grad, vjp, jvp, jacrev, vmap ...),
    outside torch.compile's tracing (where torch 2.10 reports a transform of its
    own, and the Keel ops must stay in the graph)."""
    return _peek is not None and _peek() is not None and not torch.compiler.is_compiling()


# Looked up once: the typed API asks on every call (transformed() took 0.19 us).
_peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_VMAP = getattr(getattr(getattr(torch._C, "_functorch", None), "TransformType", None), "Vmap", None)
_compiling = torch.compiler.is_compiling

VMAP_RULES = False
"""Whether Keel's batching rules are in place (``_vmap.register`` sets it)."""


def vmap_on_top() -> bool:
    """True where the innermost ``torch.func`` transform is vmap and Keel's
    batching rules are in place (``_vmap``): there the ops batch themselves."""
    return VMAP_RULES and _peek is not None and (top := _peek()) is not None and top.key() == _VMAP


def transformed() -> bool:
    """True where the typed API takes :func:`through_torch`: inside
    ``forward_ad.dual_level()`` or :func:`functorch_on`, written out in one
    frame (the typed API asks on every call; the two calls cost 0.1 us of its
    0.2, measured)."""
    return _fwad._current_level >= 0 or (_peek is not None and _peek() is not None and not _compiling())


def through_torch(fn, op, twin, ref, *args):
    """`fn(op, *args)` (Keel's op `op` through its Python caller `fn`, e.g.
    ``functional._rms_norm``) where torch's autograd machinery serves it, else
    `ref(*args)`: the op in torch's ops, after Keel's checks of the arguments
    (so the errors are Keel's; through `fn` with the op's ``_nograd`` `twin`).

    - Inside a ``torch.func`` transform: torch runs no custom op's autograd
      there (``register_autograd`` is unsupported, for torch's own ``custom_op``
      too); `ref` is a plain torch computation that every transform supports.
      The checks run on meta stand-ins with the arguments' shapes, dtypes and
      strides. Where the innermost transform is vmap, the op itself: its
      batching rule (``_vmap``) runs it once for all the examples, and a
      transform below vmap meets the op again. Where ``_func.route`` says so
      (``grad`` and ``vmap`` only, no second derivative possible), the op's
      Function there: Keel's kernels, forward and backward. Under those
      transforms but on tensors too small for the Function to pay, torch's own
      op where it has one (the norms, softmax, cross-entropy), and in forward
      mode alone (``jvp``) at every size (not layer_norm there), else `ref`
      (but see the last item).
    - Forward-mode AD with a dual argument: torch drops a custom op's tangents
      without a word, and raises where the input also needs a gradient; torch's
      own op carries them where ``_func.route`` gives one (nothing requires a
      gradient), else `ref` (and a reverse graph, so forward-over-reverse
      works), after the checks on meta stand-ins (not Keel's kernel on the
      primals: its values would be thrown away).
    - Rotary embedding, the norms and softmax with a tangent on ``x`` alone
      (fused_add_rms_norm: on ``x`` or the residual), under ``forward_ad`` or
      one ``jvp`` (:func:`kernel_parts`): Keel's kernel on the primals, Keel's
      kernels for the tangent (:func:`kernel_dual`); also where a tensor
      requires a gradient, recording the graph (the op's formula with a
      ``jvp``: :data:`DUAL_FUNCTIONS`).
    """
    functorch = functorch_on()
    if functorch and vmap_on_top():
        return fn(op, *args)
    if not functorch and not has_tangent(args):
        return fn(op, *args)
    # Before ``route``, which it makes needless (a stack walk, 22 us a call).
    parts = kernel_parts(op, args)
    native = None
    if parts is None:
        function, native = _func.route(op, args)
        if functorch and function is not None:
            return fn(function, *args)
    _check_on_meta(fn, twin, op, args)
    if parts is not None:
        return kernel_dual(op, twin, parts, args, fn)
    return (native or ref)(*zero_tangents(args))


ZERO_TANGENT_MAX = 1 << 17
"""The most elements (float64's counting twice: the formulas run in Keel's
accumulation dtype) of the largest tensor among the arguments for which
:func:`zero_tangents` gives the others zero tangents."""


def zero_tangents(args):
    """`args`, where forward mode is on (``jvp``, ``forward_ad``) with no ``grad``
    transform in place and no tensor
    among them has more than :data:`ZERO_TANGENT_MAX` elements, with each
    floating tensor that carries no tangent (a weight, a bias, rotary's cos and
    sin) made dual with a zero tangent; else `args` as they are. Where a tensor
    without a tangent meets a dual one in ``mul`` or ``add``, torch makes its
    tangent an efficient zero tensor and sizes that op's result through the
    op's Python meta: 0.3-0.4 ms a ``mul`` on ``[8, 64]`` under ``forward_ad``
    on the CPU, 0.04 with a real zero tangent (torch 2.15). A real zero tangent
    costs its share of each formula instead (``w_t * y`` is an op the size of
    the output), which outgrows that past about 2^17 elements: the norms
    ``[64, 512]`` 0.26-0.95x the time, ``[256, 512]`` 0.63-0.91x (float64
    1.42-1.46x under ``jvp`` there, hence its elements count twice), rotary
    ``[1, 64, 8, 64]`` 0.18-0.37x (measured, docs/BENCHMARKS.md session 111).
    A zero tangent adds nothing to the result's where the other factor is
    finite. Not under a ``grad`` transform (``jvp(grad(f))``, ``hessian``):
    there the input's ``grad`` wrapper shows no tangent (it is below the
    wrapper), so it was made dual too and each op's tangent formula ran again
    on the wrappers, and a weight's zero tangent made the backward's formulas
    carry tangents through every op (``jvp(grad(f))`` of rms_norm ``[8, 64]``
    dispatched 772 ops with them, 189 without; torch's own 187; 3.5-4x the
    time, docs/BENCHMARKS.md session 113)."""
    if _fwad._current_level < 0 or torch.is_inference_mode_enabled() or _func.under_grad():
        return args
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or max(a.numel() * (2 if a.dtype == torch.float64 else 1) for a in tensors) > ZERO_TANGENT_MAX:
        return args
    return tuple(
        _zero_dual(a)
        if isinstance(a, torch.Tensor) and a.is_floating_point() and _fwad.unpack_dual(a).tangent is None
        else a
        for a in args
    )


def kernel_parts(op, args, functions=True):
    """The primals and tangents of the arguments that may carry one, and
    whether an autograd graph must be recorded, where `op` has a forward mode
    through Keel's kernels (:data:`KERNEL_DUALS`: rotary embedding, the norms,
    softmax), in forward mode with a tangent on ``x`` (fused_add_rms_norm: on
    ``x``, the residual or both) and on no other argument, and forward mode's
    one level alone tracking the arguments (:func:`_func.forward_alone`: no
    ``grad`` transform, one ``jvp`` at the most); not where a graph must be
    recorded under torch.func and `functions` is false (a bare op, in its
    autograd kernel, where torch.func runs no Function: ``_torch_version.run``)
    or the tensor is smaller than ``_func.JVP_GRAPH_MIN_ELEMENTS`` says;
    else None. There the output's tangent is a linear map of
    those tangents that Keel's kernels compute (:func:`kernel_dual`). The other
    tensors carry no tangent, and get no zero one (:func:`zero_tangents`): that
    would make the tangent NaN wherever ``x`` holds an inf (``0 * inf``), where
    rotary's derivative, ``cos`` and ``sin`` themselves, is finite; and the
    zero-tensor path that a plain tensor takes instead costs a Python meta call
    per op (docs/BENCHMARKS.md sessions 111 and 114). Where it serves,
    ``_func.route`` is not asked (a stack walk, about 20 us a call)."""
    entry = KERNEL_DUALS.get(op._schema.name)
    if entry is None:
        return None
    if _fwad._current_level < 0 or torch.is_inference_mode_enabled():
        return None
    duals = entry[0]
    if has_tangent(args[duals:]):
        return None
    parts = [_fwad.unpack_dual(a) for a in args[:duals]]
    tangents = [p.tangent for p in parts]
    if all(t is None for t in tangents):
        return None
    graph = _func.forward_alone(args, [t for t in tangents if t is not None])
    if graph is None:
        return None
    primals = [p.primal for p in parts]
    if graph and functorch_on():
        first = _func.base(next(p for p, t in zip(primals, tangents) if t is not None))
        least = _func.CUDA_MIN_ELEMENTS if first.is_cuda else _func.JVP_GRAPH_MIN_ELEMENTS[op._opname]
        if not functions or first.numel() < least:
            return None
    return primals, tangents, graph


def kernel_dual(op, twin, parts, args, call):
    """The output of `op` on `args` from :func:`kernel_parts`' `parts`, each
    output dual with the tangent that Keel's kernels give (:data:`KERNEL_DUALS`);
    `call(f, *args)` calls `f` as the op (the typed API's caller, or ``f(*args)``).

    Without a graph to record: `twin` (the op's ``_nograd`` twin) on the
    primals, the tangents beside it. Under ``jvp`` they run on its wrappers: the
    twins have no autograd, so functorch takes the wrappers off and runs them
    below (their batching rules under ``vmap(jvp(f))`` and ``jacfwd``), which
    loses nothing where :func:`kernel_parts` served (no level below tracks
    them). With one (a tensor requiring a gradient): the op's formula with a
    ``jvp`` (:data:`DUAL_FUNCTIONS`; under torch.func the op's Function there
    with one, ``_func.DUAL_FUNCTIONS``) on the dual arguments: the same
    kernels, its ``jvp`` the same tangents, recording a graph
    (:class:`_KernelTangent`), and its backward sees the inputs as they were,
    dual, so a gradient taken inside the level carries its tangent
    (forward-over-reverse: a Hessian-vector product), as torch's own ops'."""
    primals, tangents, graph = parts
    name = op._schema.name
    if graph:
        return call((_func.DUAL_FUNCTIONS if functorch_on() else DUAL_FUNCTIONS)[name], *args)
    out = call(twin, *primals, *args[len(primals) :])
    got = KERNEL_DUALS[name][1](out, primals, tangents, args, lambda *a: call(twin, *a), False)
    if isinstance(out, tuple):
        return tuple(_fwad.make_dual(o, t) for o, t in zip(out, got))
    return _fwad.make_dual(out, got)


DUAL_FUNCTIONS = {}
"""Op name (``keel::rms_norm`` ...) -> ``apply`` of its formula with a ``jvp``:
an ``autograd.Function`` whose forward runs the op's twin and records the
backward, as the op's autograd kernel's formula, and whose ``jvp`` gives the
tangents of :data:`KERNEL_DUALS` with a graph (filled by ``_autograd.register``)."""


class _KernelTangent(torch.autograd.Function):
    """``J t`` by a Keel backward kernel, ``kernel(t, x)``, recording a graph:
    its backward is the gradient of the written-out ``written(t, x)``, torch's
    ops (:func:`vjp`: with a graph, so derivatives of any order follow). For
    :func:`_jt` where ``t`` or ``x`` requires a gradient: a tangent that a loss
    takes in (a Jacobian penalty), or one computed from a tensor requiring a
    gradient. The forward, what every call runs, stays the one kernel."""

    generate_vmap_rule = True

    @staticmethod
    def forward(kernel, written, t, x):
        return kernel(t, x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.written = inputs[1]
        ctx.save_for_backward(*inputs[2:])

    @staticmethod
    def backward(ctx, grad):
        t, x = ctx.saved_tensors
        # A plain backward (no graph wanted) keeps none on the gradients.
        got = vjp(ctx.written, (t, x), (grad,), ctx.needs_input_grad[2:], graph=wanted(grad, t, x))
        return (None, None, *got)


def _jt(kernel, written, t, x, graph):
    """``J t``: `kernel(t, x)`, through :class:`_KernelTangent` where `graph`
    and `t` or `x` requires a gradient (always where `graph` is
    ``_func.WRAPPED``: under torch.func)."""
    if graph and (graph is _func.WRAPPED or t.requires_grad or x.requires_grad):
        return _KernelTangent.apply(kernel, written, t, x)
    return kernel(t, x)


def _symmetric_jt(f, t, x):
    """``J t`` of `f` (a map of rows whose Jacobian ``J`` is symmetric) at `x`,
    written out: the gradient of `f` at `x` against `t`, through
    ``torch.func.vjp``, so a graph or a transform around it (a batched
    backward) records it."""
    return torch.func.vjp(f, x)[1](t)[0]


def _rotary_tangent(out, primals, tangents, args, kernel, graph):
    """Rotary embedding is linear in ``x``: the op on ``x``'s tangent (`kernel`,
    the op itself where `graph`: its autograd records one)."""
    return kernel(tangents[0], *args[1:])


def _layer_norm_tangent(out, primals, tangents, args, kernel, graph):
    """``w * J t``: layer_norm's Jacobian without the weight, ``J = r (I - (1
    1^T + xhat xhat^T) / n)`` in each row, is symmetric, so its product with ``x``'s
    tangent ``t`` is the backward's with ``t`` for the output's gradient and no
    weight (Keel's backward kernel, one pass; bias and weight have no tangent
    here). In a half dtype that rounds ``J t`` before the weight multiplies it:
    two roundings where the written-out version has one (docs/BENCHMARKS.md
    session 116; :func:`_times_weight`)."""
    weight, eps = args[1], args[3]
    backward = torch.ops.keel._layer_norm_backward_nograd.default

    def kernel_jt(t, x):
        return backward(t.contiguous(), x.contiguous(), None, None, eps)[0]

    def written(t, x):
        return _symmetric_jt(lambda a: layer_norm(a, None, None, eps), t, x)

    return _times_weight(_jt(kernel_jt, written, tangents[0], primals[0], graph), weight, graph)


def _times_weight(jt, weight, graph):
    """``J t`` times the weight where one is given: in place (``J t`` is a
    fresh output of the size of ``x``: 30% of layer_norm's time on ``[4096,
    4096]`` went to a new one), except where the weight is a transform's (a
    per-example weight under ``vmap``: ``J t`` may not be batched as it is),
    or where `graph` and either requires a gradient (autograd keeps ``J t``
    for the weight's gradient)."""
    if weight is None:
        return jt
    if _func.wrapped(weight) or (graph and (graph is _func.WRAPPED or jt.requires_grad or weight.requires_grad)):
        return jt * weight
    return jt.mul_(weight)


def _rms_norm_tangent(out, primals, tangents, args, kernel, graph):
    """``w * J t``: rms_norm's Jacobian without the weight, ``J = r (I - a
    a^T r^2 / n)`` in each row, is symmetric, so its product with ``x``'s
    tangent is the backward's with ``t`` for the output's gradient and no weight
    (Keel's backward kernel, one pass), as :func:`_layer_norm_tangent`'s. With
    ``round_before_weight`` too: the rounding's derivative is taken as 1, as in
    the backward."""
    return _weighted_rms_jt(tangents[0], primals[0], args[1], args[2], graph)


def _weighted_rms_jt(t, x, weight, eps, graph):
    """``w * J t`` of rms_norm at `x` (:func:`_rms_norm_tangent`): Keel's backward
    kernel with `t` for the output's gradient and no weight, then the weight;
    recording a graph where `graph` (:func:`_jt`)."""
    backward = torch.ops.keel._rms_norm_backward_nograd.default

    def kernel_jt(t, x):
        return backward(t.contiguous(), rows_in_place(x), None, eps)[0]

    def written(t, x):
        return _symmetric_jt(lambda a: rms_norm(a, None, eps), t, x)

    return _times_weight(_jt(kernel_jt, written, t, x, graph), weight, graph)


def _fused_add_rms_norm_tangent(out, primals, tangents, args, kernel, graph):
    """``s = x + residual`` and ``rms_norm(s)``: ``s``'s tangent is the sum of
    the two tangents (a copy of the one given, where one is: no output's
    tangent is an input's), the normed output's ``w * J t_s`` as rms_norm's
    (:func:`_rms_norm_tangent`), on the sum the kernel gave."""
    y, s = out
    tx, tr = tangents
    ts = tx.clone() if tr is None else tr.clone() if tx is None else tx + tr
    return _weighted_rms_jt(ts, s, args[2], args[3], graph), ts


def _softmax_tangent(out, primals, tangents, args, kernel, graph):
    """``J t = scale y (t - sum(t y))``: softmax's Jacobian, ``scale (diag(y) -
    y y^T)`` in each row, is symmetric, so its product with ``x``'s tangent is
    Keel's backward kernel with ``t`` for the output's gradient (one pass, on
    the output ``y``, rounded to its dtype as the backward reads it;
    recording a graph where `graph`: :func:`_jt`)."""
    scale = args[1]
    backward = torch.ops.keel._softmax_backward_nograd.default

    def kernel_jt(t, y):
        return backward(t.contiguous(), y, scale)

    def written(t, y):
        return softmax_backward(t, y, scale)

    return _jt(kernel_jt, written, tangents[0], out, graph)


KERNEL_DUALS = {
    "keel::rotary_embedding": (1, _rotary_tangent),
    "keel::layer_norm": (1, _layer_norm_tangent),
    "keel::rms_norm": (1, _rms_norm_tangent),
    "keel::fused_add_rms_norm": (2, _fused_add_rms_norm_tangent),
    "keel::softmax": (1, _softmax_tangent),
}
"""Op name -> (how many leading arguments may carry a tangent, the tangent of
each output, through Keel's kernels, from the op's output, those arguments'
primals and tangents (None where one has none), the op's arguments, the op
called as the op (its twin; where a graph must be recorded the op itself, or
under torch.func its Function) and whether one must (False, True, or
``_func.WRAPPED`` under torch.func), for :func:`kernel_parts` and
:data:`DUAL_FUNCTIONS`."""
_func.KERNEL_DUALS.update(KERNEL_DUALS)


def _zero_dual(a):
    """`a` made dual with a zero tangent; contiguous first (``make_dual`` lays the
    tangent out as the primal, and cannot where the primal's elements overlap,
    as an expanded tensor's do)."""
    a = a.contiguous()
    return _fwad.make_dual(a, torch.zeros_like(a))


def has_tangent(args) -> bool:
    """Whether a tensor among `args` is dual (carries a tangent)."""
    return any(isinstance(a, torch.Tensor) and _fwad.unpack_dual(a).tangent is not None for a in args)


def _check_on_meta(fn, twin, op, args):
    """Runs Keel's argument checks of op `op` (the Meta kernel's, and one device
    for all tensors) on meta tensors shaped like `args`' tensors; returns the
    Meta kernel's outputs (``_fake.meta_outputs``). The checks are `fn(twin,
    *args)`: the op's Python caller `fn` with the op's ``_nograd`` `twin` (the
    same checks and errors, naming the op, without the op's Python autograd
    kernel); torch.func's dispatch is off meanwhile: the stand-ins belong to no
    transform. 29 -> 18 us a call (layer_norm under ``vjp``, measured).

    The checks read only the tensors' sizes, strides, dtypes and devices and
    the other arguments' values, so a call whose arguments match, in those, a
    call that passed returns that call's outputs without running them again
    (:data:`_PASSED`): 11.7 -> 2.2 us a call (layer_norm ``[64, 512]`` under
    ``vjp``, measured). A failing call is never kept: it raises every time."""
    key = _signature(fn, op, args)
    out = _PASSED.get(key) if key is not None else None
    if out is None:
        names = [a.name for a in op._schema.arguments]
        one_device(op._opname, list(zip(names, args)))
        with _no_functorch():
            out = meta_outputs(lambda *a: fn(twin, *a), args, {})
        if key is not None and out is not None:
            if len(_PASSED) >= PASSED_MAX:
                _PASSED.clear()
            _PASSED[key] = out
    if op._opname in _CLASS_TARGETS:
        check_class_targets(op, args)
    return out


_CLASS_TARGETS = {
    "cross_entropy": (0, 1, 2),
    "cross_entropy_with_lse": (0, 1, 2),
    "cross_entropy_backward": (1, 2, 3),
}
"""Op name -> the positions of its logits, target and ignore_index
(:func:`check_class_targets`)."""


def check_class_targets(op, args):
    """Raises the error Keel's kernels raise (naming `op`, a cross-entropy op of
    :data:`_CLASS_TARGETS`, and the argument) where its class-index target holds
    a value out of range that is not ``ignore_index``. For :func:`_check_on_meta`'s
    callers: there torch's own op or the written-out version runs, not Keel's
    kernels, and would raise torch's IndexError instead (on CUDA, a device-side
    assert). Reads the target below its wrappers (every example's under vmap),
    outside the transforms; as the kernels do, not while compiling, nor on CUDA
    with the check off (``keel.set_cuda_target_checks``). The row is named where
    the target is not batched (then it is the kernels' row)."""
    at_logits, at_target, at_ignore = _CLASS_TARGETS[op._opname]
    logits, target = args[at_logits], args[at_target]
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or not checking(target):
        return
    ignore_index = args[at_ignore] if len(args) > at_ignore else -100
    classes = logits.shape[-1]
    base = _func.base(target)
    if not base.numel():
        return
    # Outside the transforms and grad mode: 2.8 against 6.9 us an op inside a grad (measured).
    with _no_functorch(), torch.no_grad():
        t = base.reshape(-1)
        lo, hi = torch.aminmax(t)
        if lo.item() >= 0 and hi.item() < classes:  # one op where no row is ignored
            return
        raise_first(f"keel::{op._opname}", t, out_of_range(t, classes, ignore_index), classes, ignore_index,
                    0 if base.shape == target.shape else None)


def _signature(fn, op, args):
    """What :func:`_check_on_meta`'s checks of `args` read (each tensor's sizes,
    strides, dtype and device; each other argument's type and value), with `fn`
    and `op`, as a key; None where it cannot be one (a symbolic size, a tensor
    without strides, an unhashable argument: the checks run)."""
    key = [fn, op]
    try:
        for a in args:
            if isinstance(a, torch.Tensor):
                key.append((a.shape, a.stride(), a.dtype, a.device))
            else:
                key.append((a.__class__, a))
        key = tuple(key)
        hash(key)
    except (RuntimeError, TypeError):
        return None
    return key


_PASSED = {}
"""Signature (:func:`_signature`) of a call whose checks passed -> the Meta
kernel's outputs then (:func:`_check_on_meta`); emptied when it holds
:data:`PASSED_MAX`."""
PASSED_MAX = 1024
_no_functorch = torch._C._DisableFuncTorch


def vjp(fn, inputs, grads, needs, graph=True):
    """The gradients of `fn(*inputs)` (a tensor or a tuple) against `grads` (None
    where an output has no gradient), for the inputs whose `needs` is true, with
    a graph (without one where `graph` is false, outside the transforms); None
    for the others. (`needs` may be shorter than `inputs`: the dispatcher drops
    trailing arguments equal to their defaults.)"""
    if any(_func.wrapped(t) for t in (*inputs, *grads)):
        return _vjp_in_transform(fn, inputs, grads, needs)
    take = [
        i
        for i, t in enumerate(inputs)
        if i < len(needs) and needs[i] and isinstance(t, torch.Tensor) and t.requires_grad
    ]
    with torch.enable_grad():
        outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    result = [None] * len(inputs)
    if not take or not pairs:
        return result
    got = torch.autograd.grad(
        [o for o, _ in pairs],
        [inputs[i] for i in take],
        [g for _, g in pairs],
        create_graph=graph,
        allow_unused=True,
    )
    for i, g in zip(take, got):
        result[i] = g
    return result


def _vjp_in_transform(fn, inputs, grads, needs):
    """:func:`vjp` where the tensors belong to torch.func transforms (the backward
    of a ``keel._func`` Function whose gradient a transform or autograd will
    take): ``torch.func.vjp``, which tracks the inputs at a level of its own. A
    saved input of a ``grad`` level that has ended (a ``vjp``'s pullback called
    later) requires no gradient any more, so autograd.grad would find no graph."""
    inputs, grads = _func.alive(inputs), _func.alive(grads)
    take = [i for i, t in enumerate(inputs) if i < len(needs) and needs[i] and isinstance(t, torch.Tensor)]
    result = [None] * len(inputs)
    if not take or all(g is None for g in grads):
        return result

    def of_taken(*taken):
        args = list(inputs)
        for i, t in zip(take, taken):
            args[i] = t
        outs = fn(*args)
        return outs if isinstance(outs, tuple) else (outs,)

    outs, pull = torch.func.vjp(of_taken, *(inputs[i] for i in take))
    grads = tuple(grads) + (None,) * (len(outs) - len(grads))
    got = pull(tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads)))
    for i, g in zip(take, got):
        result[i] = g
    return result


def rms_norm(x, weight, eps, round_before_weight=False):
    """`F.rms_norm` over the last dim, in Keel's accumulation dtype; with
    `round_before_weight`, `x / rms` rounded to `x`'s dtype before the weight."""
    a = x.to(acc_dtype(x))
    y = a * torch.rsqrt(plus(a.square().mean(-1, keepdim=True), eps))
    if weight is not None:
        if round_before_weight:
            y = y.to(x.dtype).to(y.dtype)
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def layer_norm(x, weight, bias, eps):
    """`F.layer_norm` over the last dim, in Keel's accumulation dtype, written out.

    Not `F.layer_norm` itself: its double backward raises where a bias is given
    without a weight (a RuntimeError, "Expected a proper Tensor but got None",
    torch 2.10 to 2.15), and its float64 loses digits on rows far from 0
    (1.5e-10 of the result at an offset of 1000). Centred twice: the second
    mean takes back what rounding the first lost, as Keel's kernel does."""
    acc = acc_dtype(x)
    a = x.to(acc)
    c = a - a.mean(-1, keepdim=True)
    c = c - c.mean(-1, keepdim=True)
    y = c * torch.rsqrt(plus((c * c).mean(-1, keepdim=True), eps))
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def gated(x, approximate=None):
    """`act(x[..., :d]) * x[..., d:]`: silu where `approximate` is None, else gelu.

    The tanh gelu in the kernels' sigmoid form, `a sigmoid(2u)`: F.gelu's `0.5 a (1 +
    tanh u)` loses a result near 0 for negative `a` (0 in float32 at a = -5.3, where
    the kernel gives 7.8e-9), so forward-mode AD's values would differ from Keel's."""
    a, g = x.to(acc_dtype(x)).chunk(2, -1)
    if approximate == "tanh":
        act = a * torch.sigmoid(times(a + times(a, 0.044715) * a * a, 2 * math.sqrt(2 / math.pi)))
    else:
        act = F.silu(a) if approximate is None else F.gelu(a, approximate=approximate)
    return (act * g).to(x.dtype)


def softmax(x, scale):
    """`torch.softmax(x * scale, -1)` in Keel's accumulation dtype."""
    return torch.softmax(times(x.to(acc_dtype(x)), scale), -1).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps, round_before_weight=False):
    """`(rms_norm(s), s)` for `s = x + residual`, rounded to the dtype first."""
    s = x + residual
    return rms_norm(s, weight, eps, round_before_weight), s


def softmax_backward(grad, y, scale):
    """`scale * y * (grad - sum(grad * y))`, the softmax backward from its output."""
    acc = acc_dtype(y)
    g, p = grad.to(acc), y.to(acc)
    return (times(p, scale) * (g - (g * p).sum(-1, keepdim=True))).to(y.dtype)


def cross_entropy(logits, target, ignore_index, label_smoothing, reduction, weight=None):
    """`F.cross_entropy` and each row's log-sum-exp (0 for ignored rows), in
    Keel's accumulation dtype; the loss in the op's dtype
    (``_common.ce_loss_dtype``). `weight`: class weights (or None), as the
    op takes them."""
    a = logits.to(acc_dtype(logits))
    lse = torch.logsumexp(a, -1)
    if not target.dtype.is_floating_point:  # probabilities: no row is ignored
        # `where`, not a product with the mask: 0 as from the kernel where an
        # ignored row holds an inf, and in forward mode no zero tensor's product
        # (0.2 ms a call: `_common.plus`).
        lse = torch.where(target != ignore_index, lse, 0.0)
    return _loss(logits, a, target, ignore_index, label_smoothing, reduction, weight), lse


def cross_entropy_loss(logits, target, ignore_index, label_smoothing, reduction, weight=None):
    """The loss of :func:`cross_entropy` alone (the op ``cross_entropy``):
    without the log-sum-exp, which costs as much again inside a transform
    (each of torch's ops through its wrappers)."""
    return _loss(logits, logits.to(acc_dtype(logits)), target, ignore_index, label_smoothing, reduction, weight)


def _loss(logits, a, target, ignore_index, label_smoothing, reduction, weight):
    """:func:`cross_entropy`'s loss, from `a`, the logits in Keel's accumulation dtype."""
    w = None if weight is None else weight.to(a.dtype)
    if target.dtype.is_floating_point:
        loss = F.cross_entropy(a, target.to(a.dtype), w, label_smoothing=label_smoothing, reduction=reduction)
        return loss.to(ce_loss_dtype(logits, target))
    if w is not None:
        # d = -log p_t, smooth = -sum_c w_c log p_c: torch's nll_loss is not
        # differentiable in `w`, these are.
        logp = torch.log_softmax(a, -1)
        d = -logp.gather(1, torch.where(target != ignore_index, target, 0)[:, None]).squeeze(1)
        smooth = -(logp * w).sum(-1)
        loss = class_weighted(d, smooth, w, target, ignore_index, label_smoothing, reduction)
        return loss.to(logits.dtype)
    loss = F.cross_entropy(a, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    return loss.to(logits.dtype)


def rotary(x, cos, sin, interleaved):
    """Rotary embedding in torch ops: each pair `(a, b)` of the first
    `2 * cos.shape[-1]` dims becomes `(a cos - b sin, b cos + a sin)`."""
    half = cos.shape[-1]
    acc = acc_dtype(x)
    c, s = (t.to(acc)[None, :, None, :] for t in (cos, sin))
    head, rest = x[..., : 2 * half].to(acc), x[..., 2 * half :]
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        rot = torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
    else:
        a, b = head[..., :half], head[..., half:]
        rot = torch.cat([a * c - b * s, b * c + a * s], -1)
    return torch.cat([rot.to(x.dtype), rest], -1)
