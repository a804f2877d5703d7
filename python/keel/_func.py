"""``torch.func``'s reverse-mode transforms through Keel's kernels.

torch runs no custom op's autograd inside a ``torch.func`` transform, so the
typed API used to answer every transform with the op written in torch's ops
(``_twice.through_torch``): correct, but with none of Keel's speed (``vjp`` of
``rms_norm`` on ``[4096, 4096]`` f32: 221 ms, against 33 ms through autograd;
docs/BENCHMARKS.md, session 107). torch.func does run an ``autograd.Function``
written with ``setup_context``, and vmaps it where it says
``generate_vmap_rule``. So each differentiable op has one such Function here
(:data:`FUNCTIONS`): its forward is the op's ``_nograd`` twin, its
``setup_context`` and backward are the op's formula (``_autograd``), and
``grad``, ``vjp``, ``jacrev`` and ``vmap`` of them (per-example gradients) run
Keel's forward and backward kernels.

torch.func's machinery around a Function costs about 150-250 us a call, so on
small tensors (:data:`MIN_ELEMENTS`, measured on the CPU) the torch-op version
serves, as before, and for the norms, softmax and cross-entropy torch's own op
(:data:`NATIVE`), which beats the torch-op version Keel writes out.

Where the op's gradient may itself be differentiated (a second ``grad`` level,
``hessian``, autograd outside the transforms), or the transforms hold forward
mode (``jvp``, ``jacfwd``) or ``functionalize``, no Function serves
(:func:`route`): it would need a ``jvp`` of its own for tangents, and a
backward that records its own graph for a second derivative. There the typed
API keeps the torch-op version, except where torch's own op serves the ops
that have one (:data:`NATIVE`) at every size: in forward mode alone, and on
float32 tensors where a second derivative may be taken. (Before this is asked,
rotary, the norms and softmax with a tangent on ``x`` alone, in forward mode
alone, take Keel's kernels: ``_twice.kernel_parts``.)

A formula's backward records a graph where grad mode is on (``_twice``).
torch.func's ``grad`` runs every backward with grad mode on, also where nothing
will differentiate it, so the Functions' backward asks the tensors
(:func:`needs_graph`): it records a graph only where a tensor it reads is
tracked by another live transform level than the one that recorded the
Function, or by autograd outside the transforms (a ``vjp``'s pullback called
inside another transform, or on a cotangent that requires a gradient), through
``torch.func.vjp`` of the torch-op version (``_twice.vjp``). Else it runs under
``no_grad``, on Keel's backward kernels.
"""
import torch
import torch.nn.functional as F

from ._common import as_called, nograd, schema_defaults, times

_F = getattr(torch._C, "_functorch", None)
_T = getattr(_F, "TransformType", None)
_GRAD, _VMAP, _JVP = (getattr(_T, k, None) for k in ("Grad", "Vmap", "Jvp"))
_TRACKING = (_GRAD, _JVP)  # the transforms whose tensors a gradient or tangent may follow

_EMPTY = torch.empty(0)  # made outside every transform: what :func:`_token` wraps

FUNCTIONS = {}
"""Op name -> a callable that runs the op (its arguments as the op takes them,
trailing defaults may be left out) through its ``autograd.Function`` for
torch.func (filled by :func:`register`)."""


def _stack():
    """The functorch interpreters in place, innermost last."""
    return _F.get_interpreter_stack() or []


MIN_ELEMENTS = {
    "rms_norm": 1 << 17,
    "fused_add_rms_norm": 1 << 17,
    "layer_norm": 1 << 14,
    "silu_and_mul": 1 << 18,
    "gelu_and_mul": 1 << 18,
    "softmax": 1 << 20,
    "cross_entropy_with_lse": 1 << 19,
    "cross_entropy": 1 << 19,
    "rotary_embedding": 1 << 14,
}
"""Op name -> the fewest elements of its first tensor (all the examples' under
``vmap``) for which its Function serves on the CPU. torch.func's machinery
around an ``autograd.Function`` costs about 150-250 us a call more than the
torch-op version (``grad`` of rms_norm ``[1, 512]``: 506 against 339 us), which
the kernels win back only on larger tensors: these are the crossovers measured
on the 2-core Xeon (docs/BENCHMARKS.md, session 107), as powers of two. Below
them the torch-op version serves, as before."""

JVP_GRAPH_MIN_ELEMENTS = {
    "rms_norm": 1 << 19,
    "layer_norm": 1 << 19,
    "softmax": 1 << 19,
    "fused_add_rms_norm": 1 << 20,
    "rotary_embedding": 1 << 19,
}
"""Op name -> the fewest elements of its first tensor (all the examples' under
``vmap``) for which, on the CPU, its Function with a ``jvp``
(:data:`DUAL_FUNCTIONS`) serves under ``jvp`` where a tensor requires a
gradient below the transforms (``_twice.kernel_parts``); below them the paths
of before. torch.func's machinery around the Function costs about 0.3-0.5 ms
a call: ``jvp`` with a weight requiring a gradient, f32, against the
written-out version, ``[256, 512]`` 0.55-0.81x, ``[512, 1024]`` 1.3-2.6x
(fused_add_rms_norm 0.93-1.11x), ``[1024, 1024]`` 1.2-3.4x (measured on the
2-core Zen 4, docs/BENCHMARKS.md session 117; rotary's not measured, taken as
the norms'). On CUDA :data:`CUDA_MIN_ELEMENTS`, as for the Functions above."""

CUDA_MIN_ELEMENTS = 1 << 24
"""The same for CUDA tensors, every op: an estimate, not measured (no GPU in
session 107). There the torch-op version's extra passes over memory (about 32
bytes an element) cost the Function's extra 170 us of Python only at about 16M
elements at 3 TB/s."""


def _native_rms_norm(x, weight, eps, round_before_weight=False):
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def _native_layer_norm(x, weight, bias, eps):
    if x.dtype != torch.float32:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    # float32 rows centred first, as Keel's kernels and the torch-op version do:
    # F.layer_norm alone loses digits on rows far from 0 (-1000 + 0.01 * randn:
    # 3.8e-3 of the result off, 8.6e-8 centred; 16-bit rows: within a rounding
    # of theirs). The mean is detached: layer_norm is the same for every shift of
    # a row, so its gradient and tangent through the mean are 0 (computing them
    # cost 3x; this costs 1.2-1.9x F.layer_norm's under vjp, measured session 110).
    return F.layer_norm(x - x.mean(-1, keepdim=True).detach(), x.shape[-1:], weight, bias, eps)


def _native_fused_add_rms_norm(x, residual, weight, eps, round_before_weight=False):
    s = x + residual
    return _native_rms_norm(s, weight, eps), s


def _native_softmax(x, scale=1.0):
    return torch.softmax(x if scale == 1.0 else times(x, scale), -1)


def _native_cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None):
    if weight is not None:
        # Class weights that nothing differentiates (:data:`_NATIVE_REFUSES`);
        # a zero tangent that ``_twice.zero_tangents`` gave them is dropped:
        # torch's ``nll_loss`` has no derivative in them.
        weight = torch.autograd.forward_ad.unpack_dual(weight).primal
    return F.cross_entropy(
        logits, target, weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )


NATIVE = {
    "rms_norm": (_native_rms_norm, 1 << 17),
    "fused_add_rms_norm": (_native_fused_add_rms_norm, 1 << 17),
    "layer_norm": (_native_layer_norm, 1 << 21),
    "softmax": (_native_softmax, 1 << 21),
    "cross_entropy": (_native_cross_entropy, 1 << 20),
}
"""Op name -> (its expression in one of torch's own ops, the fewest elements
from which the op's Function (:data:`FUNCTIONS`) serves instead on the CPU).
Below that size, under the transforms where the Function would serve, torch's
own op serves (:func:`route`) rather than the torch-op version Keel writes out
(``_twice``), which runs more of torch's ops, each through torch.func's
wrappers: ``vjp`` of layer_norm ``[512, 512]`` f32 took 2262 us written out,
1133 us through the Function and 552 us as ``F.layer_norm``
(docs/BENCHMARKS.md, session 108); the forward of softmax ``[64, 512]`` inside
a ``vjp`` 29.9 us written out, 10.6 as ``torch.softmax``; cross-entropy's
written-out forward also finds each row's log-sum-exp, which the loss alone
does not need (session 109). The sizes are where the Functions start to beat
torch's op, measured (``vjp`` or ``grad``, f32 and bf16; softmax: native /
Function 0.77-0.86 at 2^20 elements, 1.01-1.12 at 2^21; cross-entropy f32:
0.85 at 2^19, 1.10-1.13 at 2^20). The values are torch's op's, which differ
from Keel's kernels by the last bit here and there, as the written-out
version's do (layer_norm's float32 rows are centred first, as Keel's are:
``_native_layer_norm``). Not for float64 (``F.layer_norm`` loses digits on rows
far from 0, ``_twice.layer_norm``), nor where :data:`_NATIVE_REFUSES` says
torch's op would not give Keel's result."""

_NATIVE_REFUSES = {
    # round_before_weight anything but False (not bool(): a wrong type reaches the checks).
    "rms_norm": lambda *args: len(args) > 3 and args[3] is not False,
    "fused_add_rms_norm": lambda *args: len(args) > 4 and args[4] is not False,
    "softmax": lambda x, scale=1.0: scale != 1.0 and x.dtype != torch.float32,
    "cross_entropy": lambda logits, target, *rest: (
        logits.dtype != torch.float32
        or not isinstance(target, torch.Tensor)
        or target.dtype not in (torch.float32, torch.int64)
        or (len(rest) > 3 and rest[3] is not None and not _constant(rest[3]))
    ),
}
"""Op name -> whether torch's own op (:data:`NATIVE`) would not give Keel's
result on these arguments (the op's, as the typed API or the op takes them):
rms_norm's ``round_before_weight``, which torch's op does not have; a softmax
``scale`` other than 1 in a half dtype, where ``x * scale`` would round before
the softmax (Keel scales in float32); cross-entropy other than on float32
logits (torch's ``log_softmax`` rounds to a half dtype, Keel's accumulates in
float32), or with class weights that a transform or autograd differentiates
(torch's ``nll_loss`` is not differentiable in them: :func:`_constant`)."""


def _constant(t) -> bool:
    """Whether tensor `t` is a constant to every transform and to autograd: each
    of its functorch wrappers one that a ``grad`` level put on a tensor it does
    not differentiate (not requiring a gradient there; ``grad`` wraps every
    tensor an op takes) or the innermost ``jvp`` level on one without a tangent,
    none of ``vmap`` (examples), and below them no gradient required nor
    forward-mode tangent carried."""
    if not isinstance(t, torch.Tensor):
        return False
    stack = _stack() if wrapped(t) else []
    kinds = {i.level(): i.key() for i in stack}
    while _F is not None and _F.is_functorch_wrapped_tensor(t):
        level = _F.maybe_get_level(t)
        if _F.is_batchedtensor(t) or t.requires_grad:
            return False
        if kinds.get(level) == _JVP:
            # The innermost jvp lifts every tensor an op takes, with no tangent
            # but its own primals' (shown there); a jvp's primal below an
            # inner grad shows none, so a jvp wrapper there counts as one.
            if level != stack[-1].level() or torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
                return False
        elif kinds.get(level) != _GRAD:
            return False
        t = _F.get_unwrapped(t)
    return not _tracked_outside(t)

_FORWARD_REFUSES = {"layer_norm"}
"""The ops whose torch's own op (:data:`NATIVE`) does not serve forward mode
(:func:`route`). layer_norm: torch's ``jvp`` of a 16-bit ``F.layer_norm``
computes in that dtype (float16 tangents overflowed to inf where Keel's are
finite, test_ops_differential), and on float32 rows, centred first
(:func:`_native_layer_norm`), it was no faster than the torch-op version
(``jvp`` ``[512, 512]`` 0.72-0.84x, ``[64, 512]`` 0.98-1.24x, ``[2048, 1024]``
1.06-1.10x; measured, session 110)."""


_FORWARD_ALONE_REFUSES = {
    # Class weights with label smoothing: torch's op takes its smoothing term's
    # tangent through an efficient zero tensor (``prims::mul``, session 112);
    # the torch-op version was 1.5-2.7x faster on [8, 64] and [64, 512] under
    # jvp and forward_ad (0.85-1.17x on [256, 1024]; session 113). With weights
    # alone torch's op was 2-3x faster.
    "cross_entropy": lambda logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", weight=None: (
        weight is not None and label_smoothing != 0
    ),
}
"""Op name -> whether torch's own op (:data:`NATIVE`) does not serve these
arguments in forward mode alone (:func:`route`), though it serves them
elsewhere."""

_REVERSE, _FORWARD, _TWICE, _TWICE_FORWARD = "reverse", "forward", "twice", "twice, forward"
"""The kinds of transform stacks that :func:`_bases` tells apart."""

_TWICE_REFUSES = {
    # A bias without a weight: torch's double backward raises where the bias is
    # differentiated too ("Expected a proper Tensor but got None", torch 2.15).
    "layer_norm": lambda x, weight=None, bias=None, *rest: weight is None and bias is not None,
}
"""Op name -> whether torch's own op (:data:`NATIVE`) cannot take a second
derivative on these arguments (:func:`route`)."""


def route(op, args, functions=True):
    """Which version of Keel's op `op` (an overload) serves a call on `args`
    under torch.func now, in place of the torch-op version Keel writes out:
    ``(function, None)`` where the op's Function (:data:`FUNCTIONS`) serves,
    ``(None, native)`` where torch's own op does (:data:`NATIVE`), ``(None,
    None)`` where neither does.

    Both need the transforms in place to be ``vmap`` and at most one ``grad``
    (``vjp``, ``jacrev``), and no tensor among `args` tracked outside them
    (requiring a gradient, or carrying a forward-mode tangent below its
    wrappers). Elsewhere a gradient of the op's gradient may be taken (``grad``
    of ``grad``, ``hessian``, autograd of a ``grad``), or a forward-mode tangent
    needs a ``jvp`` of the Function's own: no Function serves those (torch's
    own op may, below).
    Then, by the elements of the first tensor (all the examples' under vmap):
    torch's own op where the tensor is not float64 and :data:`_NATIVE_REFUSES`
    does not refuse the arguments, below :data:`NATIVE`'s size
    (:data:`CUDA_MIN_ELEMENTS` on CUDA), or at every size where the op has no
    Function or `functions` is false (a bare op, in its autograd kernel, where
    torch.func runs no Function: ``_torch_version.run``); the
    Function from :data:`MIN_ELEMENTS` (:data:`CUDA_MIN_ELEMENTS` on CUDA) on,
    below which torch.func's overhead would cost more than the kernels save.

    In forward mode alone (``jvp``, ``jacfwd``, or the tangents of
    ``torch.autograd.forward_ad``; ``vmap`` beside them, nothing requiring a
    gradient below the wrappers: :func:`_bases`), torch's own op at
    every size, under the same rules, :data:`_FORWARD_REFUSES` (not
    layer_norm) and :data:`_FORWARD_ALONE_REFUSES`: it carries the tangents
    itself, where the torch-op version runs more of torch's ops (written-out /
    torch's op, ``jvp``: softmax ``[64, 512]`` 2.5-2.9x, bf16 ``[2048, 1024]`` 2.4x; rms_norm ``[64, 512]``
    1.25-1.45x; fused_add_rms_norm 1.1-1.2x; cross-entropy even; measured in
    one process, docs/BENCHMARKS.md session 110). rms_norm,
    fused_add_rms_norm and softmax come here only where
    ``_twice.kernel_parts`` (Keel's kernels, 1.5-14x faster than torch's op,
    session 116) did not serve: a weight's tangent, or ``x``'s tracked by
    another level too.

    Where a second derivative may be taken (two ``grad`` levels, or ``grad``
    and ``jvp``: ``hessian``, a Hessian-vector product ``jvp(grad(f))``),
    torch's own op at every size on float32 tensors, under the same rules,
    :data:`_TWICE_REFUSES`, and with a ``jvp`` :data:`_FORWARD_REFUSES`; the
    torch-op version elsewhere (16-bit dtypes: torch's double backward
    computes in them, 1e-2 of layer_norm's off in bfloat16). ``grad(grad(f))``
    through torch's own op / the torch-op version, float32: layer_norm ``[512,
    512]`` 0.59-0.66, ``[64, 512]`` 0.76-0.97, softmax 0.82-0.88, the others
    within the noise; cross-entropy with constant class weights 0.54-0.85 on
    ``[8, 64]`` and ``[64, 512]`` (measured, docs/BENCHMARKS.md session 113).
    layer_norm's ``jvp(grad(f))`` was 1.1-1.3x slower through torch's op there,
    as its forward mode alone was no faster.

    One walk over the transforms and the arguments for both answers, none for
    an op that has neither (the backward ops, called bare)."""
    name = op._opname
    function = FUNCTIONS.get(name) if functions else None
    entry = NATIVE.get(name)
    if function is None and entry is None:
        return None, None
    first, mode = _bases(args)
    if first is None:
        return None, None
    if mode in (_TWICE, _TWICE_FORWARD):
        if entry is None or first.dtype != torch.float32 or not _native_serves(name, first, args):
            return None, None
        if _TWICE_REFUSES.get(name, _never)(*args) or (mode == _TWICE_FORWARD and name in _FORWARD_REFUSES):
            return None, None
        return None, entry[0]
    if mode == _FORWARD:
        if entry is None or not _native_serves(name, first, args) or name in _FORWARD_REFUSES:
            return None, None
        if _FORWARD_ALONE_REFUSES.get(name, _never)(*args):
            return None, None
        return None, entry[0]
    elements = first.numel()
    if entry is not None and _native_serves(name, first, args):
        if function is None or elements < (CUDA_MIN_ELEMENTS if first.is_cuda else entry[1]):
            return None, entry[0]
    least = CUDA_MIN_ELEMENTS if first.is_cuda else MIN_ELEMENTS.get(name, 0)
    return (function if function is not None and elements >= least else None), None


def _native_serves(name, first, args) -> bool:
    """Whether torch's own op (:data:`NATIVE`) gives op `name`'s result on
    `args`, whose first tensor below its wrappers is `first`: not float64, and
    not refused (:data:`_NATIVE_REFUSES`)."""
    return first.dtype != torch.float64 and not _NATIVE_REFUSES.get(name, _never)(*args)


def _never(*_):
    """:data:`_NATIVE_REFUSES`'s answer for an op it does not name: never."""
    return False


def _bases(args):
    """One walk over the transforms in place and `args`: ``(first, mode)``,
    `first` the first tensor among `args` below its functorch wrappers (all the
    examples' under vmap), where no tensor among them requires a gradient
    below its wrappers and the transforms are ``vmap`` and at most one
    ``grad``, no tensor carrying a forward-mode tangent below its wrappers
    (`mode` :data:`_REVERSE`: :func:`route`'s Functions), or ``jvp`` and
    ``vmap`` with forward mode in use (a ``jvp`` among them, or such a
    tangent; :data:`_FORWARD`), or ``vmap`` with two ``grad`` levels or more,
    or ``grad`` and ``jvp``, and no such tangent (:data:`_TWICE`, or
    :data:`_TWICE_FORWARD` with a ``jvp``: a second derivative may be taken);
    else ``(None, None)``."""
    if _F is None or not hasattr(_F, "get_interpreter_stack"):
        return None, None
    grads = jvps = 0
    for i in _stack():
        key = i.key()
        if key == _GRAD:
            grads += 1
        elif key == _JVP:
            jvps += 1
        elif key != _VMAP:
            return None, None
    fwad = torch.autograd.forward_ad
    first, tangent = None, False
    for a in args:
        if isinstance(a, torch.Tensor):
            below = base(a)
            if first is None:
                first = below
            if below.requires_grad:
                return None, None
            if fwad._current_level >= 0 and fwad.unpack_dual(below).tangent is not None:
                if grads:
                    return None, None
                tangent = True
    if grads > 1 or (grads and jvps):
        return first, (_TWICE_FORWARD if jvps else _TWICE)
    return first, (_FORWARD if jvps or tangent else _REVERSE)


def forward_alone(args, tangents):
    """Whether forward mode's one level alone tracks `args` and `tangents`
    (those of `args`' tangents Keel's kernels will take), and if so, whether an
    autograd graph must be recorded beside it: None where it does not, else
    whether one must.

    It does with no transform in place (plain ``torch.autograd.forward_ad``),
    or ``jvp`` innermost with only ``vmap`` beside it (``jacfwd``,
    ``vmap(jvp(f))``), where no tensor below its functorch wrappers carries a
    tangent. There an op without autograd run on the arguments (their ``jvp``
    wrappers) loses nothing where, in grad mode, no layer of a tensor among
    them requires a gradient (False). In grad mode a tensor that requires one
    (a module's parameter, an input with a graph behind it, a tangent computed
    from one) asks for a graph (True: the op's formula with a ``jvp``, whose
    tangents record one: ``_twice.kernel_dual``). Elsewhere (a ``grad``
    transform, an outer ``jvp``) it answers None: Keel's kernels would lose a
    derivative there."""
    if _F is None or not hasattr(_F, "get_interpreter_stack"):
        return None
    stack = _stack()
    if stack and (stack[-1].key() != _JVP or any(i.key() != _VMAP for i in stack[:-1])):
        return None
    grad = torch.is_grad_enabled()
    graph = False
    for a in (*args, *tangents):
        if not isinstance(a, torch.Tensor):
            continue
        below = a
        while True:
            if grad and below.requires_grad:
                graph = True
            if not _F.is_functorch_wrapped_tensor(below):
                break
            below = _F.get_unwrapped(below)
        if below is not a and torch.autograd.forward_ad.unpack_dual(below).tangent is not None:
            return None
    return graph


def under_grad() -> bool:
    """Whether a ``grad`` transform (``grad``, ``vjp``, ``jacrev``) is in place."""
    return _F is not None and hasattr(_F, "get_interpreter_stack") and any(i.key() == _GRAD for i in _stack())


def base(t):
    """Tensor `t` below its functorch wrappers (all the examples' under vmap)."""
    while _F.is_functorch_wrapped_tensor(t):
        t = _F.get_unwrapped(t)
    return t


def wrapped(t) -> bool:
    """Whether `t` is a tensor of a torch.func transform (wrapped by one)."""
    return isinstance(t, torch.Tensor) and _F is not None and _F.is_functorch_wrapped_tensor(t)


def alive(tensors):
    """`tensors` with the wrappers of ended transform levels taken off, as
    torch's own dispatch does before a transform takes them."""
    out = []
    for t in tensors:
        while isinstance(t, torch.Tensor) and _F.is_dead_tensor_wrapper(t):
            t = _F.unwrap_if_dead(t)
        out.append(t)
    return tuple(out)


def _tracked_outside(base) -> bool:
    """Whether `base`, a tensor below its functorch wrappers (:func:`base`),
    requires a gradient or carries a forward-mode tangent."""
    fwad = torch.autograd.forward_ad
    return base.requires_grad or (fwad._current_level >= 0 and fwad.unpack_dual(base).tangent is not None)


def _level_of_records():
    """The level of the innermost ``grad`` transform in place: the one whose
    autograd records a Function applied now (None outside ``grad``)."""
    levels = [i.level() for i in _stack() if i.key() == _GRAD]
    return max(levels) if levels else None


def _token():
    """A marker of the ``grad`` level that records a Function applied now
    (:func:`_level_of_records`): an empty tensor wrapped at that level, which
    tells later whether the level has ended (levels are numbered again after
    one ends). None outside ``grad``."""
    level = _level_of_records()
    return None if level is None else _F._wrap_for_grad(_EMPTY, level)


def needs_graph(token, tensors) -> bool:
    """Whether a backward that reads `tensors`, of a Function recorded by the
    ``grad`` level that `token` marks (:func:`_token`), must record a graph: a
    tensor is tracked by a live ``grad`` or ``jvp`` level other than that one (a
    gradient of this gradient, or its tangent, will be taken; every live one
    where that level has ended, as for a ``vjp``'s pullback called inside
    another transform), or, below every wrapper, requires a gradient or carries
    a forward-mode tangent (autograd outside the transforms)."""
    live = {i.level() for i in _stack() if i.key() in _TRACKING}
    if token is not None and not _F.is_dead_tensor_wrapper(token):
        live.discard(_F.maybe_get_level(token))
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        while _F.is_functorch_wrapped_tensor(t):
            if _F.is_gradtrackingtensor(t) and _F.maybe_get_level(t) in live:
                return True
            t = _F.get_unwrapped(t)
        if _tracked_outside(t):
            return True
    return False


def _function(name, backward, setup, call, defaults):
    """Op `name`'s Function for torch.func: `call` (the ``_nograd`` twin's C
    function) as its forward, `setup` and `backward` (the op's formula) around
    it. Returns what :data:`FUNCTIONS` holds for it."""
    count = len(defaults)

    def forward(*args):
        return call(*args)

    def setup_context(ctx, inputs, output):
        ctx.keel_token = _token()
        setup(ctx, inputs, output)

    def run_backward(ctx, *grads):
        if torch.is_grad_enabled() and not needs_graph(ctx.keel_token, (*ctx.saved_tensors, *grads)):
            with torch.no_grad():
                return backward(ctx, *grads)
        return backward(ctx, *grads)

    fn = type(
        f"KeelFunc_{name}",
        (torch.autograd.Function,),
        {
            "generate_vmap_rule": True,
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(run_backward),
        },
    )

    def apply(*args):
        # Every argument given: setup_context and backward see the op's whole schema.
        return fn.apply(*args, *defaults[len(args) :]) if len(args) < count else fn.apply(*args)

    dual = KERNEL_DUALS.get(f"keel::{name}")
    if dual is not None:
        DUAL_FUNCTIONS[f"keel::{name}"] = _with_jvp(fn, defaults, lambda *a: FUNCTIONS[name](*a), dual)
    return apply


KERNEL_DUALS = {}
"""``_twice.KERNEL_DUALS``, set by ``_twice`` (which imports this module)."""

WRAPPED = "wrapped"
"""The `graph` that :func:`_with_jvp`'s ``jvp`` gives ``_twice.KERNEL_DUALS``'
tangent functions: there a tensor's ``requires_grad`` does not tell whether a
level below tracks it (functorch's wrappers), so a graph is always recorded."""

DUAL_FUNCTIONS = {}
"""Op name (``keel::rms_norm`` ...) -> the op's Function for torch.func with a
``jvp`` (:func:`_with_jvp`), for ``_twice.kernel_dual`` under ``jvp`` where a
tensor requires a gradient below the transforms."""


def _with_jvp(fn, defaults, op, dual):
    """Function `fn` (:func:`_function`'s) with a ``jvp``: the tangents of
    ``_twice.KERNEL_DUALS``' `dual` (how many leading arguments may carry one,
    the tangent function), recording a graph below the transforms (`op`, the
    op's Function for torch.func: rotary's tangent is the op on ``x``'s);
    called as the op (trailing defaults may be left out)."""
    leading, tangent = dual
    count = len(defaults)

    def setup_context(ctx, inputs, output):
        ctx.dual = True  # (for the formula's setup: every output carries a tangent)
        fn.setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)
        ctx.dual = (inputs, output)

    def jvp(ctx, *tangents):
        args, out = ctx.dual
        del ctx.dual
        return tangent(out, args[:leading], tangents[:leading], args, op, WRAPPED)

    cls = type(f"{fn.__name__}_jvp", (fn,), {"setup_context": staticmethod(setup_context), "jvp": staticmethod(jvp)})

    def apply(*args):
        return cls.apply(*args, *defaults[len(args) :]) if len(args) < count else cls.apply(*args)

    return apply


def register(formulas, skip) -> None:
    """Builds :data:`FUNCTIONS` from `formulas` (op name -> (backward,
    setup_context), ``_autograd.FORMULAS``); an op in `skip` (``_autograd.KEEPS``:
    op name -> the op whose formula it keeps, ``cross_entropy`` ->
    ``cross_entropy_with_lse``) gets the first output of that op's Function."""
    ops = torch.ops.keel
    for name, (backward, setup) in formulas.items():
        if name in skip:
            continue
        twin = getattr(ops, nograd(name)).default
        FUNCTIONS[name] = _function(name, backward, setup, getattr(twin, "_op", twin), schema_defaults(twin))
    for name, kept in skip.items():
        FUNCTIONS[name] = _first_output(FUNCTIONS[kept], kept, name)


def _first_output(apply, kept, name):
    """What :data:`FUNCTIONS` holds for op `name`, which gives the first output
    of op `kept`, whose Function is `apply` (``cross_entropy``: the loss of
    ``cross_entropy_with_lse``); `kept`'s errors (its kernels' checks) name `name`,
    the op called."""
    kept, name = f"keel::{kept}", f"keel::{name}"

    def first(*args):
        try:
            return apply(*args)[0]
        except RuntimeError as err:
            renamed = as_called(err, kept, name)
            if renamed is None:
                raise
            raise renamed from None

    return first
