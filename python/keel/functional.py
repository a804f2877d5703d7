"""Typed Python API over ``torch.ops.keel``."""
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.overrides import handle_torch_function

from . import _autograd, _ce_forms, _gate_halves, _sharded_mean, _twice, _vocab_parallel
from ._common import as_called, ce_weight_dtype, heads_contiguous, nograd, rows_in_place

# A tensor argument that overrides __torch_function__ (a subclass, torch.fx's
# Proxy) or an active TorchFunctionMode sees the call of the typed function,
# as for torch.nn.functional's: torch.fx.symbolic_trace records one node.
# The check costs about 35 ns a call (measured); `_overridden` runs only where
# it says yes.
_has_torch_function = torch._C._has_torch_function_variadic
_handle = handle_torch_function


def _overridden(*tensors) -> bool:
    """Whether a call whose tensor arguments `_has_torch_function` accepted goes to
    ``__torch_function__``: not where one is a nested tensor, which Keel's ops
    refuse, naming the argument (a jagged one's ``__torch_function__`` would take
    ``keel.rms_norm`` for ``torch.nn.functional.rms_norm``: it goes by name).
    Read with ``__torch_function__`` off, so that no override sees ``is_nested``."""
    with _no_torch_function():
        return not any(isinstance(t, Tensor) and t.is_nested for t in tensors)


_no_torch_function = torch._C.DisableTorchFunction

# Ops are called through their overloads: `.default` skips the packet's
# overload resolution (0.45 us a call, measured).
_keel = torch.ops.keel


def _default(op: str, arg: str):
    """The default that op `op`'s schema gives argument `arg`: the typed functions'
    defaults, and the values their callers leave out (see `_call`), read once."""
    (found,) = [a.default_value for a in getattr(_keel, op).default._schema.arguments if a.name == arg]
    return found


_RMS_EPS = _default("rms_norm", "eps")
_LAYER_EPS = _default("layer_norm", "eps")
_APPROXIMATE = _default("gelu_and_mul", "approximate")
_SCALE = _default("softmax", "scale")
_IGNORE_INDEX = _default("cross_entropy", "ignore_index")
_LABEL_SMOOTHING = _default("cross_entropy", "label_smoothing")
_REDUCTION = _default("cross_entropy", "reduction")
_INTERLEAVED = _default("rotary_embedding", "interleaved")


def rms_norm(
    input: Tensor, weight: Optional[Tensor] = None, eps: float = _RMS_EPS, round_before_weight: bool = False
) -> Tensor:
    """RMS normalisation over the last dimension.

    Same result as ``torch.nn.functional.rms_norm(input, (input.shape[-1],), weight, eps)``,
    in one pass over memory, with f32 accumulation (f64 for float64 inputs).

    Args:
        input: ``[..., n]`` float32, float16, bfloat16 (CPU and CUDA) or float64 (CPU).
            Read in place through its strides where its last dim is contiguous (``q``
            or ``k`` of a fused qkv projection viewed ``[tokens, heads, head_dim]``,
            for QK-norm; a transposed tensor); other layouts are copied first.
        weight: optional ``[n]`` scale, same dtype and device as ``input``.
        eps: added to the mean square before the square root; finite and >= 0.
        round_before_weight: round ``input / rms`` to ``input``'s dtype before the
            weight multiplies it, as Hugging Face's ``LlamaRMSNorm`` does
            (``weight * hidden.to(input_dtype)``; Mistral's, Qwen2's and the other
            copies of it too, vLLM's kernels, Liger's ``casting_mode="llama"``).
            torch's ``F.rms_norm`` rounds once, at the end (the default). Changes
            nothing for float32 and float64, or without a weight. The backward is
            the same either way (the rounding's gradient is taken as 1, as
            autograd takes ``.to(dtype)``'s; the weight's gradient sums
            ``grad * input / rms`` unrounded, within the dtype's rounding of the
            rounded form's).

    Returns:
        A new contiguous tensor shaped like ``input``. Differentiable in ``input``
        and ``weight`` (the backward reads a strided ``input`` in place too).
    """
    if _has_torch_function(input, weight) and _overridden(input, weight):
        return _handle(rms_norm, (input, weight), input, weight, eps, round_before_weight)
    return _call(_rms_norm, _RMS_NORM, _twice.rms_norm, input, weight, eps, round_before_weight)


def _rms_norm(op, input, weight, eps, round_before_weight=False):
    if round_before_weight is not False:
        return op(rows_in_place(input), _c(weight), eps, round_before_weight)
    if eps.__class__ is float and eps == _RMS_EPS:  # the default: left out (see `_call`)
        return op(rows_in_place(input), _c(weight))
    return op(rows_in_place(input), _c(weight), eps)


def layer_norm(
    input: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = _LAYER_EPS
) -> Tensor:
    """Layer normalisation over the last dimension.

    Same result as ``torch.nn.functional.layer_norm(input, (input.shape[-1],), weight, bias, eps)``
    (biased variance), in one pass over memory with f32 accumulation.

    Args:
        input: ``[..., n]`` float32, float16, bfloat16 (CPU and CUDA) or float64 (CPU).
        weight: optional ``[n]`` scale; bias: optional ``[n]`` shift; same dtype and device.
        eps: added to the variance; finite and >= 0.

    Returns:
        A new tensor shaped like ``input``. Differentiable in ``input``, ``weight`` and ``bias``.
    """
    if _has_torch_function(input, weight, bias) and _overridden(input, weight, bias):
        return _handle(layer_norm, (input, weight, bias), input, weight, bias, eps)
    return _call(_layer_norm, _LAYER_NORM, _twice.layer_norm, input, weight, bias, eps)


def _layer_norm(op, input, weight, bias, eps):
    if eps.__class__ is float and eps == _LAYER_EPS:  # the default: left out (see `_call`)
        return op(input.contiguous(), _c(weight), _c(bias))
    return op(input.contiguous(), _c(weight), _c(bias), eps)


def fused_add_rms_norm(
    input: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = _RMS_EPS,
    round_before_weight: bool = False,
) -> Tuple[Tensor, Tensor]:
    """``s = input + residual`` and ``rms_norm(s, weight, eps)`` in one pass over memory.

    The pre-norm step of a transformer block. Returns ``(rms_norm(s), s)``, the same as
    ``s = input + residual; (F.rms_norm(s, (n,), weight, eps), s)``: ``s`` is rounded to the
    dtype before it is normalised, as in torch. Out of place; vLLM's in-place form is
    :func:`fused_add_rms_norm_`.

    Args:
        input, residual: ``[..., n]``, same shape, dtype and device.
        weight: optional ``[n]`` scale. eps: finite and >= 0.
        round_before_weight: round ``s / rms`` to the dtype before the weight multiplies
            it, as vLLM's kernel and Hugging Face's ``LlamaRMSNorm`` do (see
            :func:`rms_norm`).

    Returns:
        ``(normed, sum)``, both shaped like ``input``. Differentiable in ``input``,
        ``residual`` and ``weight``.
    """
    if _has_torch_function(input, residual, weight) and _overridden(input, residual, weight):
        args = (input, residual, weight, eps, round_before_weight)
        return _handle(fused_add_rms_norm, (input, residual, weight), *args)
    return _call(
        _fused_add_rms_norm,
        _FUSED_ADD_RMS_NORM,
        _twice.fused_add_rms_norm,
        input,
        residual,
        weight,
        eps,
        round_before_weight,
    )


def _fused_add_rms_norm(op, input, residual, weight, eps, round_before_weight=False):
    if round_before_weight is not False:
        return op(input.contiguous(), residual.contiguous(), _c(weight), eps, round_before_weight)
    if eps.__class__ is float and eps == _RMS_EPS:  # the default: left out (see `_call`)
        return op(input.contiguous(), residual.contiguous(), _c(weight))
    return op(input.contiguous(), residual.contiguous(), _c(weight), eps)


def fused_add_rms_norm_(
    input: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = _RMS_EPS,
    round_before_weight: bool = False,
) -> None:
    """:func:`fused_add_rms_norm` in place, as vLLM's op: ``residual`` becomes
    ``input + residual`` and ``input`` becomes ``rms_norm(input + residual, weight, eps)``.

    The same bits as ``normed, s = fused_add_rms_norm(input, residual, weight, eps)``, with
    no new tensors: for inference, where nothing keeps the block's input. On CPU that
    saves the page faults of two fresh outputs (most of an out-of-place call's time);
    on CUDA, their memory.

    Args:
        input, residual: ``[..., n]``, same shape, dtype and device, sharing no memory
            with each other nor within themselves (an expanded view is refused). A view
            that is not contiguous is worked on in a contiguous copy, written back.
        weight: optional ``[n]`` scale, sharing no memory with either. eps: finite and >= 0.
        round_before_weight: as in :func:`fused_add_rms_norm` (vLLM's op rounds so).

    Not differentiable: use :func:`fused_add_rms_norm` where a gradient is needed
    (grad mode on and an argument requiring one is refused with a RuntimeError).
    """
    if _has_torch_function(input, residual, weight) and _overridden(input, residual, weight):
        args = (input, residual, weight, eps, round_before_weight)
        return _handle(fused_add_rms_norm_, (input, residual, weight), *args)
    try:
        # The defaults left out (see `_call`).
        if round_before_weight is not False:
            tail = (eps, round_before_weight)
        else:
            tail = () if eps.__class__ is float and eps == _RMS_EPS else (eps,)
        _call_inplace(_FUSED_ADD_RMS_NORM_, (input, residual), input, residual, _c(weight), *tail)
    except _PREPARING as err:
        _refuse(_FUSED_ADD_RMS_NORM_[0], (input, residual, weight, eps, round_before_weight), err)
        raise


def silu_and_mul(input: Tensor) -> Tensor:
    """SwiGLU gate: ``silu(input[..., :d]) * input[..., d:]`` for ``input[..., 2d]``.

    The first half is the gate, the second the up projection (vLLM's layout).
    f32 math, one rounding. On CPUs, float16 and bfloat16 take an ``exp``
    within 3.2e-6 (relative) in the sigmoid, as torch's CPU kernels do for
    16-bit outputs: results within one unit in the last place. Differentiable.
    A DTensor whose halves are sharded alike (the output of
    :class:`keel.nn.GateUpColwiseParallel`) is gated on each rank, with no
    collective (``keel._gate_halves``).
    """
    if _has_torch_function(input) and _overridden(input):
        return _handle(silu_and_mul, (input,), input)
    if type(input) is not Tensor and _gate_halves.halves_sharded(input):
        return _gate_halves.gated(silu_and_mul, input)
    return _call(_silu_and_mul, _SILU_AND_MUL, _twice.gated, input)


def _silu_and_mul(op, input):
    return op(input.contiguous())


def gelu_and_mul(input: Tensor, approximate: str = _APPROXIMATE) -> Tensor:
    """GeGLU gate: ``gelu(input[..., :d], approximate) * input[..., d:]`` for ``input[..., 2d]``.

    ``approximate`` is ``"none"`` (exact, erf) or ``"tanh"``, as in ``F.gelu``; anything
    else raises a RuntimeError. f32 math, one rounding. On CPUs, float16 and
    bfloat16 take an ``exp`` within 3.2e-6 (relative) where one is needed (the
    tanh form's sigmoid, the backward's pdf), as torch's CPU kernels do for 16-bit
    outputs: results within one unit in the last place. Differentiable.
    A DTensor whose halves are sharded alike is gated on each rank, as by
    :func:`silu_and_mul`.
    """
    if _has_torch_function(input) and _overridden(input):
        return _handle(gelu_and_mul, (input,), input, approximate)
    if type(input) is not Tensor and _gate_halves.halves_sharded(input):
        return _gate_halves.gated(gelu_and_mul, input, approximate)
    return _call(_gelu_and_mul, _GELU_AND_MUL, _twice.gated, input, approximate)


def _gelu_and_mul(op, input, approximate):
    if approximate == _APPROXIMATE:  # the default: left out (see `_call`)
        return op(input.contiguous())
    return op(input.contiguous(), approximate)


def softmax(input: Tensor, scale: float = _SCALE) -> Tensor:
    """Softmax over the last dimension of ``input * scale``.

    Same result as ``torch.softmax(input * scale, -1)`` without the scaled copy:
    max-subtracted, f32 math (f64 for float64), one rounding. A row that is all
    ``-inf`` gives NaN, as in torch; a ``-inf`` entry gets exactly 0. On x86
    CPUs, float16 and bfloat16 rows use an ``exp`` within 3.2e-6 (relative),
    as torch's CPU kernels do for 16-bit outputs: results within one unit in
    the last place.

    Args:
        input: ``[..., n]`` float32, float16, bfloat16 (CPU and CUDA) or float64 (CPU).
        scale: finite multiplier applied before the softmax (e.g. ``1 / sqrt(d)``).

    Returns:
        A new tensor shaped like ``input``. Differentiable in ``input``.
    """
    if _has_torch_function(input) and _overridden(input):
        return _handle(softmax, (input,), input, scale)
    return _call(_softmax, _SOFTMAX, _twice.softmax, input, scale)


def _softmax(op, input, scale):
    if scale.__class__ is float and scale == _SCALE:  # the default: left out (see `_call`)
        return op(input.contiguous())
    return op(input.contiguous(), scale)


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = _IGNORE_INDEX,
    label_smoothing: float = _LABEL_SMOOTHING,
    reduction: str = _REDUCTION,
    *,
    weight: Optional[Tensor] = None,
) -> Tensor:
    """Fused cross-entropy: ``F.cross_entropy(logits, target, ...)`` with the same arguments.

    No log-softmax is kept for the backward: when ``logits`` needs a gradient, the
    forward keeps one log-sum-exp per row (``cross_entropy_with_lse``), and the backward
    reads each row of logits once to write the gradient. Forward + backward allocate one
    logits-sized buffer: the gradient.

    Args:
        logits: ``[N, V]`` float32, float16, bfloat16 (CPU and CUDA) or float64 (CPU).
            Also torch's other layouts: ``[V]`` (one row, with a 0-dim target) and
            ``[N, V, d1, ...]`` (classes in dim 1, with target ``[N, d1, ...]``), run as
            ``[N d1 ..., V]`` rows: a copy (one more logits-sized buffer), unless that is
            a view already, as for ``logits.transpose(1, 2)`` of ``[B, S, V]`` logits.
        target: ``[N]`` int64 class indices in ``[0, V)``, or ``ignore_index``; any other
            value raises a RuntimeError (on CUDA this check synchronises the stream, in
            the forward only: the backward trusts the targets the forward checked; during
            CUDA graph capture, where nothing may synchronise, and after
            ``keel.set_cuda_target_checks(False)``, such a row's loss is NaN
            instead). Or, as torch, probabilities: a float tensor shaped like
            ``logits`` (``[V]``, ``[N, V]`` or ``[N, V, d1, ...]``), differentiable too:
            a target of the logits' dtype (with a ``weight`` needing no gradient)
            goes to the op's fused kernel (one read of each row of logits and
            targets a pass, the class weights read beside them), and so does,
            outside autocast, a target of another of float32, float16 and
            bfloat16 (a float32 target of 16-bit logits, a 16-bit one of float32
            logits or of the other 16-bit dtype), read as it is (a float32 loss,
            as torch's), and a target of another dtype widened exactly to one of
            those (a copy: any target of float64 logits; float32 where float32
            weights go beside a 16-bit target, which the kernels would read in
            its dtype); other cases (a
            float64 target, or float64 weights needing a gradient, of narrower
            logits) are built on the op with torch's
            elementwise ops (``keel._ce_forms``, which gives the costs: not
            faster than torch's).
        ignore_index: rows with this target contribute no loss and no gradient (class
            indices only: with probabilities, as in torch, a negative one is taken and has no
            effect, and one of 0 or more raises).
        label_smoothing: in ``[0, 1]``, as in torch.
        reduction: ``"mean"`` (over the rows not ignored; NaN when all are),
            ``"sum"`` or ``"none"`` (``[N]`` losses; target's shape for the other layouts).
            A ``"mean"`` of ``DTensor`` logits sharded on their rows gathers no
            logits: the ranks reduce the sum of their rows' losses and their
            weight (``keel._sharded_mean``). Nor, with any reduction, do
            ``[N, V]`` logits sharded on their classes (``Shard(1)``, a
            tensor-parallel vocabulary), the rows replicated or sharded along
            the mesh's other dims (then the target a DTensor): one all-gather
            of a few numbers a row (``keel._vocab_parallel``).
        weight: optional ``[V]`` float weight of each class, on ``logits``' device
            (keyword only), as torch's ``weight``: a row's loss is scaled by its
            target's weight, label smoothing weights each class's term, and
            ``"mean"`` divides by the sum of the weights of the rows not ignored.
            Read by the op's fused kernels beside each row, with either target, in
            the logits' dtype (the target's with probabilities): float32
            weights of 16-bit logits (which torch refuses with class indices) and
            target are rounded to it, an error of the size of torch's own 16-bit
            loss, which rounds the log-probabilities times the target; under
            autocast the float32 loss takes them as given. Weights that need a
            gradient: with probabilities, the op's formula gives it, the target
            widened where its dtype does not hold them (float32 weights of a
            bfloat16 target); with class indices, the op's autograd, computed
            in float32 (float64 for float64 logits) and rounded to the dtype
            the op reads the weights in (``keel._ce_forms.weighted``).

    Returns:
        The loss in ``logits``' dtype; under ``torch.autocast``, float32 for float16
        and bfloat16 logits, as torch's (computed in float32 from the logits as they
        are: no float32 copy). With probabilities, torch's dtype: the promotion of
        the logits', the target's and the weights' (bfloat16 logits and a float32
        target give a float32 loss). Differentiable in ``logits``.
    """
    if _has_torch_function(logits, target, weight) and _overridden(logits, target, weight):
        kw = {} if weight is None else {"weight": weight}
        return _handle(cross_entropy, (logits, target, weight), logits, target, ignore_index, label_smoothing, reduction, **kw)
    if type(logits) is not Tensor:
        if (dim := _vocab_parallel.classes_sharded(logits, target, weight, reduction)) is not None:
            args = (logits, target, ignore_index, label_smoothing, reduction, weight, dim)
            return _vocab_parallel.vocab_parallel(_CE, *args)[0]
        if reduction == "mean" and _sharded_mean.rows_sharded(logits):
            return _sharded_mean.sharded_mean(cross_entropy, logits, target, ignore_index, label_smoothing, weight)
    if _probabilities(logits, target):
        _ce_forms.check_probabilities(_CE, logits, target, ignore_index, weight, label_smoothing, reduction)
        return _as_cross_entropy(_ce_forms.probabilities, logits, target, weight, label_smoothing, reduction)[0]
    if _other_layout(logits, target):
        return _cross_entropy_as_rows(logits, target, ignore_index, label_smoothing, reduction, weight)
    if weight is not None and isinstance(logits, Tensor):  # else the op refuses the logits
        _ce_forms.check(_CE, logits, weight, label_smoothing, reduction, _ce_forms.classes(logits))
        try:
            if _transformed():
                # The op cross_entropy itself, which takes the weights: its
                # Function, torch's own op (weights that nothing differentiates)
                # or the loss written out, without the log-sum-exp that
                # cross_entropy_with_lse would find and this call drop.
                weight = weight.contiguous().to(ce_weight_dtype(logits, target))
                args = (logits.contiguous(), target.contiguous(), ignore_index, label_smoothing, reduction, weight)
                return _call(_cross_entropy, _CROSS_ENTROPY, _twice.cross_entropy_loss, *args)
            return _as_cross_entropy(_ce_forms.weighted, logits, target, weight, ignore_index, label_smoothing, reduction)[0]
        except _PREPARING as err:
            # A target that is no tensor (None, a list) failed in the form's
            # preparation (`.contiguous()`): named as the op names it.
            _refuse(_CROSS_ENTROPY[0], (logits, target, ignore_index, label_smoothing, reduction, weight), err)
            raise
    if _transformed():
        # The op's own checks, then its Function (the loss of cross_entropy_with_lse's),
        # torch's own op or the loss written out (``_twice.through_torch``).
        args = (logits, target, ignore_index, label_smoothing, reduction)
        return _call(_contiguous_cross_entropy, _CROSS_ENTROPY, _twice.cross_entropy_loss, *args)
    try:
        logits, target = logits.contiguous(), target.contiguous()
        if _autocast_on():
            # The op itself: its autocast kernel returns a float32 loss (``_autocast``).
            return _CROSS_ENTROPY[0](logits, target, ignore_index, label_smoothing, reduction)
    except _PREPARING as err:
        _refuse(_CROSS_ENTROPY[0], (logits, target, ignore_index, label_smoothing, reduction), err)
        raise
    if torch.is_grad_enabled() and logits.requires_grad and _tracing_state() is None:
        with_lse = _CROSS_ENTROPY_WITH_LSE[0 if _compiling() else 2]
        try:
            return _cross_entropy(with_lse, logits, target, ignore_index, label_smoothing, reduction)[0]
        except _PREPARING as err:
            args = (logits, target, ignore_index, label_smoothing, reduction)
            _refuse(_CROSS_ENTROPY[0], args, err, _CROSS_ENTROPY_WITH_LSE[:2])
            raise
    return _call(_cross_entropy, _CROSS_ENTROPY, None, logits, target, ignore_index, label_smoothing, reduction)


_CE = "keel::cross_entropy"


def _probabilities(logits, target) -> bool:
    """Whether cross_entropy's target holds probabilities (a float tensor), as
    torch takes them (:func:`_ce_forms.probabilities`). Logits that are not dense
    go on to the op, which refuses them, naming the argument."""
    return isinstance(logits, Tensor) and isinstance(target, Tensor) and target.dtype.is_floating_point and _dense(logits)


def _other_pair(logits, target) -> bool:
    """Whether the op would refuse probabilities `target` beside `logits` for
    their dtypes, where :func:`_ce_forms.probabilities` takes them (widened, or
    in its composite), as torch does. Logits of a dtype the op refuses go on to
    it, which names them."""
    return logits.dtype.is_floating_point and not _ce_forms.reads(logits.dtype, target.dtype)


def _as_cross_entropy(form, *args):
    """`form(_with_lse, *args)`, one of torch's forms built on the op
    cross_entropy_with_lse (``_ce_forms``), for :func:`cross_entropy`: an error of
    that op's own checks (of the logits or the targets) names
    ``keel::cross_entropy``, the op called."""
    try:
        return form(_with_lse, *args)
    except RuntimeError as err:
        renamed = as_called(err, "keel::cross_entropy_with_lse", _CE)
        if renamed is None:
            raise
        raise renamed from None


def _other_layout(logits, target) -> bool:
    """Whether cross_entropy's logits take one of torch's layouts other than
    ``[N, V]`` (:func:`_cross_entropy_as_rows`). Nested and other non-strided
    tensors go on to the op, which refuses them, naming the argument."""
    return (
        isinstance(logits, Tensor)
        and isinstance(target, Tensor)
        and logits.layout == torch.strided
        and not logits.is_nested
        and logits.dim() not in (0, 2)
    )


def _cross_entropy_as_rows(logits, target, ignore_index, label_smoothing, reduction, weight):
    """:func:`cross_entropy` of torch's layouts other than ``[N, V]``, as rows: ``[V]``
    with a 0-dim target is one row; ``[N, V, d1, ...]`` with target ``[N, d1, ...]``
    (classes in dim 1) is ``[N d1 ..., V]`` (a copy, unless the classes were moved to
    dim 1 by a view such as ``transpose(1, 2)``) with the target flattened. Losses
    (``"none"``) come back in the target's shape, as torch's do."""
    one_row = logits.dim() == 1
    want = _ce_forms.loss_shape(logits)
    if tuple(target.shape) != want:
        layout = "[V]" if one_row else "[N, V, d1, ...] (classes in dim 1)"
        raise RuntimeError(
            f"keel::cross_entropy: argument 'target' must have shape {list(want)} for logits {layout} of shape "
            f"{list(logits.shape)}, got shape {list(target.shape)}"
        )
    if (k := _sharded_mean.sharded_row_dim(logits)) is not None:
        if not _sharded_mean.split_evenly(logits, k):
            # DTensor flattens no uneven shards (refused, or for a d_k gathered by
            # later torch): that dim gathered first.
            logits, target = _sharded_mean.unsharded(logits, k), _sharded_mean.unsharded(target, max(k - 1, 0))
        elif k >= 2:
            # A DTensor sharded on d_k: d_k moved first, so that the rows, flattened,
            # are sharded as it was (flattening [N, d_k] would gather the logits).
            lead, t = logits.movedim(k, 0), target.movedim(k - 1, 0)
            rows = lead.movedim(2, -1).reshape(t.numel(), logits.shape[1])
            loss = cross_entropy(rows, t.reshape(-1), ignore_index, label_smoothing, reduction, weight=weight)
            return loss.reshape(t.shape).movedim(0, k - 1) if reduction == "none" else loss
    # The row count from the target, not -1: with no classes, -1 would be ambiguous
    # and reshape would raise its own error instead of the op's.
    rows = _ce_forms.as_rows(logits, target.numel())
    loss = cross_entropy(rows, target.reshape(-1), ignore_index, label_smoothing, reduction, weight=weight)
    return loss.reshape(want) if reduction == "none" else loss


def cross_entropy_with_lse(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = _IGNORE_INDEX,
    label_smoothing: float = _LABEL_SMOOTHING,
    reduction: str = _REDUCTION,
    *,
    weight: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """:func:`cross_entropy`, and each row's log-sum-exp of ``logits``.

    The same arguments (``[N, V]`` logits; ``[N]`` class indices or ``[N, V]``
    probabilities of any float dtype, with or without ``weight``) and loss as
    :func:`cross_entropy`. The second result is
    ``torch.logsumexp(logits, -1)`` (``[N]``, float32, or float64 for float64 logits),
    with 0 for the rows whose target is ``ignore_index``: for a z-loss, say
    (``loss + z * lse.square().mean()``). Both results are differentiable in ``logits``.
    """
    if _has_torch_function(logits, target, weight) and _overridden(logits, target, weight):
        kw = {} if weight is None else {"weight": weight}
        args = (logits, target, ignore_index, label_smoothing, reduction)
        return _handle(cross_entropy_with_lse, (logits, target, weight), *args, **kw)
    if type(logits) is not Tensor:
        if (dim := _vocab_parallel.classes_sharded(logits, target, weight, reduction)) is not None:
            args = (logits, target, ignore_index, label_smoothing, reduction, weight, dim)
            return _vocab_parallel.vocab_parallel("keel::cross_entropy_with_lse", *args)
        if reduction == "mean" and _sharded_mean.rows_sharded(logits):
            return _sharded_mean.sharded_mean(cross_entropy_with_lse, logits, target, ignore_index, label_smoothing, weight)
    if _probabilities(logits, target) and logits.dim() == 2 and (weight is not None or _other_pair(logits, target)):
        # Probabilities with class weights, or of another dtype than the op takes
        # beside these logits: as in cross_entropy (the op takes the weights where
        # it takes the target, the target widened where it must be, else the loss
        # is built on it).
        op = "keel::cross_entropy_with_lse"
        _ce_forms.check_probabilities(op, logits, target, ignore_index, weight, label_smoothing, reduction)
        return _ce_forms.probabilities(_with_lse, logits, target, weight, label_smoothing, reduction)
    if weight is not None and isinstance(logits, Tensor):  # else the op refuses the logits
        _ce_forms.check(
            "keel::cross_entropy_with_lse", logits, weight, label_smoothing, reduction, _ce_forms.classes(logits)
        )
        return _ce_forms.weighted(_with_lse, logits, target, weight, ignore_index, label_smoothing, reduction)
    if _autocast_on() and not _transformed():
        # The op itself: its autocast kernel returns a float32 loss (``_autocast``).
        args = (logits, target, ignore_index, label_smoothing, reduction)
        try:
            return _CROSS_ENTROPY_WITH_LSE[0](logits.contiguous(), target.contiguous(), *args[2:])
        except _PREPARING as err:
            _refuse(_CROSS_ENTROPY_WITH_LSE[0], args, err)
            raise
    return _call(_contiguous_cross_entropy, _CROSS_ENTROPY_WITH_LSE, _twice.cross_entropy, logits, target, ignore_index, label_smoothing, reduction)


def _with_lse(logits, target, ignore_index, label_smoothing, reduction, weight=None):
    """:func:`cross_entropy_with_lse` of ``[N, V]`` rows for ``_ce_forms``, which
    checked the arguments already: with `weight` (class weights), the op itself
    takes them, in the logits' dtype, or a probability target's (under autocast, its
    autocast kernel casts them, and its float32 value takes them as given)."""
    if weight is None:
        return cross_entropy_with_lse(logits, target, ignore_index, label_smoothing, reduction)
    logits, target, weight = logits.contiguous(), target.contiguous(), weight.contiguous()
    if _autocast_on() and not _transformed():
        return _CROSS_ENTROPY_WITH_LSE[0](logits, target, ignore_index, label_smoothing, reduction, weight)
    args = (logits, target, ignore_index, label_smoothing, reduction, weight.to(ce_weight_dtype(logits, target)))
    return _call(_cross_entropy, _CROSS_ENTROPY_WITH_LSE, _twice.cross_entropy, *args)


def _contiguous_cross_entropy(op, logits, target, ignore_index, label_smoothing, reduction):
    """:func:`_cross_entropy` (either op) on contiguous logits and target."""
    return _cross_entropy(op, logits.contiguous(), target.contiguous(), ignore_index, label_smoothing, reduction)


def _cross_entropy(op, logits, target, ignore_index, label_smoothing, reduction, weight=None):
    """`op` (cross_entropy or cross_entropy_with_lse) with the trailing scalar
    arguments that equal their defaults left out (see `_call`)."""
    if weight is not None:
        return op(logits, target, ignore_index, label_smoothing, reduction, weight)
    if reduction == _REDUCTION:
        if label_smoothing.__class__ is float and label_smoothing == _LABEL_SMOOTHING:
            if ignore_index.__class__ is int and ignore_index == _IGNORE_INDEX:
                return op(logits, target)
            return op(logits, target, ignore_index)
        return op(logits, target, ignore_index, label_smoothing)
    return op(logits, target, ignore_index, label_smoothing, reduction)


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = _INTERLEAVED) -> Tensor:
    """Rotary position embedding of ``x[batch, seq, heads, head_dim]``.

    ``cos`` and ``sin`` are ``[seq, rotary_dim / 2]`` (the cos/sin of each position's
    angles, same dtype and device as ``x``), with ``rotary_dim <= head_dim``; dims from
    ``rotary_dim`` on pass through. ``interleaved=False`` is the GPT-NeoX / Llama layout
    (rotate halves: pairs ``(i, i + rotary_dim/2)``), ``True`` the GPT-J layout (pairs
    ``(2i, 2i+1)``). f32 math, one rounding.

    ``x`` is read in place through its strides wherever its last dim is contiguous: ``q``
    or ``k`` sliced from a fused qkv projection, or a ``[batch, heads, seq, head_dim]``
    tensor passed as ``x.transpose(1, 2)``, cost no copy. Other layouts are copied first.

    Returns:
        A new contiguous tensor shaped like ``x``. Differentiable in ``x`` (and in
        ``cos``/``sin``).
    """
    if _has_torch_function(x, cos, sin) and _overridden(x, cos, sin):
        return _handle(rotary_embedding, (x, cos, sin), x, cos, sin, interleaved)
    return _call(_rotary_embedding, _ROTARY_EMBEDDING, _twice.rotary, x, cos, sin, interleaved)


def _rotary_embedding(op, x, cos, sin, interleaved):
    if interleaved is _INTERLEAVED:  # the default: left out (see `_call`)
        return op(heads_contiguous(x), cos.contiguous(), sin.contiguous())
    return op(heads_contiguous(x), cos.contiguous(), sin.contiguous(), interleaved)


def rotary_embedding_(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = _INTERLEAVED) -> None:
    """:func:`rotary_embedding` in place, as vLLM's op: ``x`` becomes its rotation.

    The same bits as ``rotary_embedding(x, cos, sin, interleaved)``, written through
    ``x``'s own strides, with no new tensor: rotate ``q`` and ``k`` where they lie, in the
    fused qkv projection's output, or a transposed ``[batch, heads, seq, head_dim]`` q.
    Elements of the storage that ``x`` does not reach are left as they are.

    Args:
        x: ``[batch, seq, heads, head_dim]`` with no two heads sharing memory (a
            broadcast, stride-0 dim is refused); heads whose last dim is strided are
            rotated in a contiguous copy, written back.
        cos, sin: as for :func:`rotary_embedding`, sharing no memory with ``x``.

    Not differentiable: use :func:`rotary_embedding` where a gradient is needed (grad
    mode on and an argument requiring one is refused with a RuntimeError).
    """
    if _has_torch_function(x, cos, sin) and _overridden(x, cos, sin):
        return _handle(rotary_embedding_, (x, cos, sin), x, cos, sin, interleaved)
    try:
        tail = () if interleaved is _INTERLEAVED else (interleaved,)  # the default: left out (see `_call`)
        _call_inplace(_ROTARY_EMBEDDING_, (x,), x, cos.contiguous(), sin.contiguous(), *tail)
    except _PREPARING as err:
        _refuse(_ROTARY_EMBEDDING_[0], (x, cos, sin, interleaved), err)
        raise


def _ops(name):
    """Op `name`'s overload, its ``_nograd`` twin's (``_common.nograd``: the same
    kernels, without an autograd kernel), its formula's ``apply``
    (``_autograd.APPLY``: what the op's autograd kernel calls where an argument
    requires a gradient), and the twin's C function (:func:`_fast`)."""
    twin = getattr(_keel, nograd(name)).default
    return getattr(_keel, name).default, twin, _autograd.APPLY[name], _fast(twin)


def _fast(op):
    """The C function that overload `op` calls (``OpOverload._op``): the same
    call without ``OpOverload.__call__``'s Python frame, 0.7 us of a 3.5 us
    call on [1, 64] (measured, softmax under inference mode). Dynamo cannot
    trace it, so it is called only where :func:`_compiling` is false; `op`
    itself where a torch version has no such attribute."""
    return getattr(op, "_op", op)


_RMS_NORM = _ops("rms_norm")
_LAYER_NORM = _ops("layer_norm")
_FUSED_ADD_RMS_NORM = _ops("fused_add_rms_norm")
_SILU_AND_MUL = _ops("silu_and_mul")
_GELU_AND_MUL = _ops("gelu_and_mul")
_SOFTMAX = _ops("softmax")
_CROSS_ENTROPY = _ops("cross_entropy")
_CROSS_ENTROPY_WITH_LSE = _ops("cross_entropy_with_lse")
_ROTARY_EMBEDDING = _ops("rotary_embedding")
# The in-place ops (no twin, no formula): the overload and its C function.
_FUSED_ADD_RMS_NORM_ = (_keel.fused_add_rms_norm_.default, _fast(_keel.fused_add_rms_norm_.default))
_ROTARY_EMBEDDING_ = (_keel.rotary_embedding_.default, _fast(_keel.rotary_embedding_.default))


# torch.jit.trace's state (None when not tracing): a C function, 35 ns a call
# (torch._C._is_tracing is 20 ns, but torch 2.10's dynamo does not fold it).
_tracing_state = torch._C._get_tracing_state
# Whether torch.compile or torch.export (also non-strict) is tracing.
_compiling = torch.compiler.is_compiling
# Whether torch.autocast is on for any device (a C function dynamo traces).
_autocast_on = torch._C._is_any_autocast_enabled
# Bound once: a module attribute looked up on every call costs 20-40 ns.
_is_grad_enabled = torch.is_grad_enabled
_transformed = _twice.transformed


def _call(fn, ops, ref, *args):
    """`fn(op, *args)`, `fn` a private caller of a Keel op (as ``_rms_norm``),
    `ops` the op's overload and its ``_nograd`` twin's (:func:`_ops`).

    - Inside a torch.func transform or forward-mode AD: ``_twice``'s torch-op
      version `ref` after Keel's checks (:func:`_twice.through_torch`); `ref`
      None where the caller has handled those already.
    - Where an argument requires a gradient in grad mode: the formula's
      ``apply``, which the op's autograd kernel would call (softmax [1, 64]
      forward: 6.8 against 9.2 us a call, measured); the op itself while
      torch.compile or torch.export traces (their graphs hold the op, whose
      autograd they handle) or torch.jit.trace records.
    - Else (no gradient can be needed): the ``_nograd`` twin, whose kernels are
      the op's and which has no autograd kernel (torch's own C++ fallback passes
      it through). The op's autograd kernel (Python) would only make that
      decision again, and running the op below it needs a context manager.
      torch.compile's graphs then hold the twin, as they do where the op's
      autograd kernel calls it. Outside their tracing, the twin's C function
      (:func:`_fast`). Not while torch.jit.trace records: there the op, in
      every grad mode, so that the trace and its check agree.
    One function, not two: a second Python frame cost 0.35 us a call (measured).
    The callers `fn` leave out trailing scalar arguments equal to the schema's
    defaults (a float or int of exactly that type and value, the default string,
    ``False`` itself), in every path: the op fills them in again, and torch's
    parser costs 0.4-0.7 us for each one passed (measured on [1, 64] under
    inference mode: softmax's scale 0.38, rms_norm's eps 0.52, layer_norm's
    0.69, cross_entropy's three 1.1 us). The formulas' ``apply`` fills them in
    too (``_autograd``).
    An argument that is not a dense tensor, or of the wrong type, gets an error
    naming the op and the argument (:func:`_refuse`).
    """
    try:
        if ref is not None and _transformed():
            return _twice.through_torch(fn, ops[0], ops[1], ref, *args)
        if _is_grad_enabled():
            # A loop, not any(<generator>): the generator, left early, cost 4 us here.
            for a in args:
                if isinstance(a, Tensor) and a.requires_grad:
                    if _compiling() or _tracing_state() is not None:
                        return fn(ops[0], *args)
                    return fn(ops[2], *args)
        # Under torch.jit.trace, the op itself: the trace's check runs the function
        # again under no_grad and must record the same op as the trace did.
        if _tracing_state() is None:
            return fn(ops[1] if _compiling() else ops[3], *args)
        return fn(ops[0], *args)
    except _PREPARING as err:
        _refuse(ops[0], args, err, ops[1:2])
        raise


def _dense(t: Tensor) -> bool:
    """Whether Keel's ops take `t`: strided, not quantized, not nested."""
    return t.layout == torch.strided and not t.is_quantized and not t.is_nested


# What preparing a call's arguments or calling its op raises where an argument
# is not what the op takes: RuntimeError from torch (a sparse tensor's
# .contiguous(), the op's own checks), AttributeError where a value is not a
# tensor (a list's .contiguous()), TypeError from Python.
_PREPARING = (RuntimeError, AttributeError, TypeError)


def _refuse(op, args, err, called=()):
    """Raises an error naming `op` (a Keel op) and the argument where one of
    `args` (the op's arguments as the caller gave them) is not what it takes;
    called where preparing them (``.contiguous()``, reading strides) or the
    call itself raised `err`, which the caller raises again where this returns.

    - A sparse, quantized or nested tensor: the error of `op` called on the
      arguments as given, from its kernel for such tensors, which names op and
      argument (``abi/src/refuse.rs``). Preparing them fails first, with torch's
      message about the method.
    - A value that is not a tensor where the op takes one (a list, a numpy
      array): says so (where preparing it failed, torch's parser never saw it).
    - An error raised by one of `called`, ops the typed function calls in place
      of `op` (its ``_nograd`` twin; cross_entropy's ``cross_entropy_with_lse``):
      torch's parser error for an argument of the wrong type, or the kernel's
      own check: the same, naming `op`, the op the caller asked for.

    All are RuntimeErrors, as torch's parser raises for ``torch.ops.keel``: the
    same mistake gets the same error in every grad mode and through both APIs.
    """
    if any(isinstance(a, Tensor) and not _dense(a) for a in args):
        try:
            op(*args)
        except RuntimeError as refused:
            raise refused from None
    name = op._schema.name
    for arg, value in zip(op._schema.arguments, args):
        if isinstance(value, Tensor):
            continue
        kind = str(arg.type)
        if kind == "Tensor" or (kind == "Optional[Tensor]" and value is not None):
            wanted = "a Tensor" if kind == "Tensor" else "a Tensor or None"
            raise RuntimeError(f"{name}: argument '{arg.name}' must be {wanted}, got {type(value).__name__}") from None
    for other in called:
        renamed = as_called(err, other._schema.name, name)
        if renamed is not None:
            raise renamed from None


_below_inplace_or_view = torch._C._AutoDispatchBelowADInplaceOrView
_increment_version = torch.autograd.graph.increment_version


def _call_inplace(ops, written, *args):
    """An in-place Keel op called on `args`, writing the tensors `written`; `ops` is
    the op's overload and that overload's C function (:func:`_fast`).

    Where no argument requires a gradient (or grad mode is off), the op runs
    below its Python kernels (``_inplace``: the autograd refusal and the version
    bump), and the versions are bumped here: 5.2 against 9.4 us a call through
    ``torch.ops.keel`` on [1, 64] (measured). Otherwise, while torch.compile
    traces, and under inference mode (which skips those kernels already), the op
    is called as it is.
    """
    # is_compiling first: dynamo cannot trace is_inference_mode_enabled.
    if _compiling():
        return ops[0](*args)
    if torch.is_inference_mode_enabled():
        return ops[1](*args)
    if torch.is_grad_enabled():
        for a in args:
            if isinstance(a, Tensor) and a.requires_grad:
                return ops[0](*args)  # which refuses, naming the argument
    with _below_inplace_or_view():
        ops[1](*args)
    _increment_version(written)


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()
