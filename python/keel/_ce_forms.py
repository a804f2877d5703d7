"""torch's forms of cross-entropy beyond the fused op's class indices, for
:func:`keel.cross_entropy`: class weights (``weight=``) and probability targets
(a float target shaped like the logits).

The op takes class weights itself (in the logits' dtype): with class indices
(:func:`weighted`) whether they need a gradient or not (its autograd gives it,
``_autograd``), with probabilities where they need none; it takes probabilities
where the target has the logits' dtype (:func:`fused`), and, outside autocast,
targets of another of float32, float16 and bfloat16 as they are (a float32
loss); targets of other dtypes are widened to one of those where that holds
them exactly (:func:`target_dtype`: any target of float64 logits; a target
that does not hold the class weights, which the op reads in the target's
dtype: float32 weights of a 16-bit target); a target and weights needing a
gradient too (its autograd formulas give them,
``_autograd``): its kernels (CPU and CUDA) read each row of logits (and of
targets) once in the forward and once in the backward, the weights beside them.
Every other case is built here on the op's per-row results
(``cross_entropy_with_lse`` with ``reduction="none"``: each row's ``lse - x_t``
and its log-sum-exp ``lse``), so no log-softmax is made, on every device and
dtype the op takes, with its autograd, ``torch.compile`` and autocast. ``C`` is
the classes, ``s`` the label smoothing, ``w`` the weights (1 where none are
given), as ``F.cross_entropy``:

- class indices: row loss ``(1 - s) w_t (lse - x_t) + s / C * sum_c w_c (lse - x_c)``
  (0 for an ignored row); ``"mean"`` divides the sum by ``sum w_t`` over the rows
  not ignored (NaN where that is 0, as torch, label smoothing or not);
- probabilities ``p`` (``q = (1 - s) p + s / C``): row loss
  ``sum_c w_c q_c (lse - x_c) = lse sum_c w_c q_c - sum_c w_c q_c x_c``;
  ``"mean"`` divides by the rows (NaN for none, as torch); an ``ignore_index``
  of 0 or more is refused, as torch refuses it (a negative one, which no class
  has, is taken and does nothing, as in torch). ``p`` is taken in
  float32 (float64 for float64 logits): a float32 copy of 16-bit targets.

The weighting runs in float32 (float64 for float64 logits) on ``[N]`` vectors.
No gradient goes through the op's ``lse`` (that would take a softmax of its own):
terms in ``lse`` come from the op's loss with label smoothing 1, ``lse - mean(x)``,
whose gradient is ``softmax(x) - 1 / C``.

Costs, forward + backward of ``[2048, 32000]`` on a 2-core Zen 4 (session 75),
against ``F.cross_entropy`` with the same arguments in the same process:

- weights needing a gradient, with class indices: the op with the weights, and
  their gradient from its per-row results; with label smoothing also a
  product of blocks of rows of ``lse - x`` in float32 with the rows' gradients
  (one more pass over the logits, no logits-sized buffer; bfloat16 ``[2048,
  32000]`` on the 2-core Xeon, session 88: 119 ms, torch 274 ms without a weight
  gradient, this module's former composite 419 ms). Weights read by the
  kernels: ``docs/BENCHMARKS.md``, session 79;
- probabilities built here (a float64 target, or float64 weights needing a
  gradient, of narrower logits; under autocast, 16-bit logits with a target
  of another dtype): the op, and
  ``sum_c (A / C - a_c) x_c`` in float32 by torch's elementwise ops (float32
  at torch's speed; bfloat16 0.4x, the float32 copies of targets and
  products). The fused kernel's figures: ``docs/BENCHMARKS.md``, session 76;
  float32 targets of 16-bit logits read by the kernels as they are (no copy
  rounded to the logits' dtype): session 80; class weights read by the
  kernels: session 78; targets widened for them (2.3-4.4x torch's speed where
  this composite was 0.8-1.05x; 1.6-2.4x with float32 weights needing a
  gradient beside 16-bit logits and targets, where it was 0.6-0.7x): session 81;
  16-bit targets of float32 logits and of the other 16-bit dtype read as they
  are, not widened: session 82.
"""
import math
import operator
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ._common import ce_loss_dtype

REDUCTIONS = ("mean", "sum", "none")
_HALF = (torch.float16, torch.bfloat16)


def classes(logits: Tensor) -> int:
    """The classes of logits in torch's layouts (``[C]``, ``[N, C]``, ``[N, C, d1,
    ...]``: dim 1, or dim 0 of one row); 0 for 0-dim logits, which the op refuses."""
    return logits.shape[1 if logits.dim() > 1 else 0] if logits.dim() > 0 else 0


def loss_shape(logits: Tensor) -> tuple:
    """The shape of ``reduction="none"``'s losses for logits in torch's layouts:
    ``()`` for ``[C]``, else ``[N, d1, ...]``."""
    return () if logits.dim() == 1 else (logits.shape[0],) + tuple(logits.shape[2:])


def as_rows(t: Tensor, rows: int) -> Tensor:
    """`t` (logits, or probabilities shaped like them) in torch's layouts as
    ``[rows, C]``: ``[C]`` is one row; ``[N, C, d1, ...]`` moves the classes last
    (a copy, unless that is a view already). `rows` is given, not -1: with no
    classes, -1 would be ambiguous."""
    if t.dim() == 2:
        return t  # already rows (movedim and reshape would cost two views a call)
    return t.unsqueeze(0) if t.dim() == 1 else t.movedim(1, -1).reshape(rows, t.shape[1])


def _refuse(op: str, arg: str, msg: str) -> None:
    raise RuntimeError(f"{op}: argument '{arg}' {msg}")


def check(op: str, logits: Tensor, weight: Optional[Tensor], label_smoothing, reduction, classes: int) -> None:
    """Raises a RuntimeError naming `op` (``keel::...``) and the argument where
    `weight` (unless None) is not a float ``[classes]`` tensor on `logits`' device,
    or where `label_smoothing` or `reduction` is not what the op takes (checked
    here: the op itself is called with neither)."""
    if weight is not None:
        if not isinstance(weight, Tensor):
            _refuse(op, "weight", f"must be a Tensor or None, got {type(weight).__name__}")
        if weight.layout != torch.strided or weight.is_nested:
            _refuse(op, "weight", f"must be a dense (strided) tensor, got layout {weight.layout}")
        if not weight.dtype.is_floating_point:
            _refuse(op, "weight", f"must be a floating-point tensor, got {weight.dtype}")
        if weight.device != logits.device:
            _refuse(op, "weight", f"must be on the device of 'logits' ({logits.device}), got {weight.device}")
        if weight.dim() != 1 or weight.shape[0] != classes:
            _refuse(op, "weight", f"must have shape [{classes}] (one weight per class), got shape {list(weight.shape)}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        shown = f'"{reduction}"' if isinstance(reduction, str) else type(reduction).__name__
        _refuse(op, "reduction", f'must be "mean", "sum" or "none", got {shown}')
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        _refuse(op, "label_smoothing", f"must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        shown = "NaN" if math.isnan(label_smoothing) else label_smoothing
        _refuse(op, "label_smoothing", f"must be in [0, 1], got {shown}")


def weighted(
    with_lse: Callable[..., Tuple[Tensor, Tensor]],
    logits: Tensor,
    target: Tensor,
    weight: Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
) -> Tuple[Tensor, Tensor]:
    """The class-weighted loss of ``[N, C]`` `logits` and ``[N]`` class indices
    `target`, and each row's log-sum-exp (0 where ignored); `with_lse` is
    ``keel.functional._with_lse``, whose op checks logits, target and
    ignore_index (a target out of range raises before `weight` is indexed). The
    other arguments are checked already (:func:`check`). The op takes the
    weights, its kernels read them; where they need a gradient, its autograd
    gives it (``_autograd._ce_class_weight_grad``: with label smoothing, blocks
    of rows of ``lse - x``, no logits-sized buffer). Until session 88 such weights
    were applied here to the op's unweighted results, with label smoothing by the
    op a second time and a float32 copy of the logits: 3.5x slower (bfloat16
    ``[2048, 32000]``, fwd+bwd 419 ms against 119, docs/BENCHMARKS.md)."""
    return with_lse(logits, target, ignore_index, label_smoothing, reduction, weight)


def check_probabilities(
    op: str,
    logits: Tensor,
    target: Tensor,
    ignore_index,
    weight: Optional[Tensor],
    label_smoothing,
    reduction,
) -> None:
    """Raises a RuntimeError naming `op` and the argument where a float `target`
    (probabilities) is not shaped like `logits` on its device, the logits have
    no classes to take them, or `ignore_index` could be a class (0 or more: torch
    refuses it for probabilities, and takes a negative one, which no class has);
    then :func:`check` of the other arguments."""
    try:
        index = operator.index(ignore_index)
    except TypeError:
        _refuse(op, "ignore_index", f"must be an int, got {type(ignore_index).__name__}")
    if index >= 0:
        _refuse(op, "ignore_index", f"applies to class indices only, not to probabilities (a float target), got {ignore_index}")
    if target.layout != torch.strided or target.is_nested:
        _refuse(op, "target", f"must be a dense (strided) tensor, got layout {target.layout}")
    if target.device != logits.device:
        _refuse(op, "target", f"must be on the device of 'logits' ({logits.device}), got {target.device}")
    if target.shape != logits.shape:
        _refuse(
            op,
            "target",
            f"of probabilities (a float tensor) must have the shape of 'logits' {list(logits.shape)}, "
            f"got shape {list(target.shape)}",
        )
    if classes(logits) == 0:
        _refuse(op, "logits", f"must have at least one class for probability targets, got shape {list(logits.shape)}")
    check(op, logits, weight, label_smoothing, reduction, classes(logits))


def probabilities(
    with_lse: Callable[..., Tuple[Tensor, Tensor]],
    logits: Tensor,
    target: Tensor,
    weight: Optional[Tensor],
    label_smoothing: float,
    reduction: str,
) -> Tuple[Tensor, Tensor]:
    """The loss of `logits` against the probabilities `target` (same shape: ``[C]``,
    ``[N, C]`` or ``[N, C, d1, ...]``, classes in dim 1, as torch), differentiable
    in both, and each row's log-sum-exp (float32, or float64 for float64 logits);
    arguments checked already (:func:`check_probabilities`)."""
    shape = loss_shape(logits)
    rows, p = as_rows(logits, math.prod(shape)), as_rows(target, math.prod(shape))
    out = result_dtype(logits, target, weight)
    read = target_dtype(rows.dtype, p.dtype, weight, _autocast(rows.device))
    if fused(rows, read, weight):
        # The op itself takes the target's rows (one read of each, a target of
        # another of float32, float16 and bfloat16 as it is: a float32 loss;
        # other dtypes widened to one it reads, exactly) and the weights
        # (`with_lse` casts them to the target's dtype, but under autocast).
        p = p.to(read)
        if out == ce_loss_dtype(rows, p) or reduction == "none":
            loss, lse = with_lse(rows, p, -100, label_smoothing, reduction, weight)
            loss = loss.to(out)
            return (loss.reshape(shape) if reduction == "none" else loss), lse
        # A wider loss than the op's (float32 weights): the rows' losses summed
        # in it, as torch sums its float32 terms, not the op's sum rounded to
        # the logits' dtype (a bfloat16 mean is 2^-9 off).
        losses, lse = with_lse(rows, p, -100, label_smoothing, "none", weight)
        return (torch.sum if reduction == "sum" else torch.mean)(losses, dtype=out), lse
    c = rows.shape[1]
    # sum_c a_c (lse - x_c) with a = w q, A = sum(a): A (lse - mean(x)) + sum_c (A / C - a_c) x_c.
    # lse - mean(x) is the op's loss with label smoothing 1, for any target (class 0,
    # which no row ignores); its gradient, softmax(x) - 1 / C, needs no softmax of
    # its own, as a gradient through the lse would.
    zeros = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
    losses, lse = with_lse(rows, zeros, -1, 1.0, "none")
    acc = torch.float64 if torch.float64 in (rows.dtype, out) else torch.float32
    if losses.dtype != acc:
        # 16-bit logits: the op's loss rounded to their dtype carries the gradient;
        # its value is taken from the float32 lse and a float32 sum of the row (one
        # read, no copy), or that rounding would be most of the loss's error (a
        # float32 loss from bfloat16 logits and a float32 target was 4x torch's).
        exact = lse.detach().to(acc) - rows.detach().sum(-1, dtype=acc) / c
        wide = losses.to(acc)
        losses = wide + (exact - wide.detach())
    # In float32: the target's gradient, w (lse - x_c), is then summed from its terms unrounded.
    a = p.to(acc)
    if label_smoothing != 0:
        a = a * (1.0 - label_smoothing) + label_smoothing / c
    if weight is not None:
        a = a * weight.to(acc)
    total = a.sum(-1)
    loss = total * losses.to(acc) + (rows * (total[:, None] / c - a)).sum(-1, dtype=acc)
    if reduction == "none":
        return loss.reshape(shape).to(out), lse
    return _reduce(loss, reduction, lambda: loss.shape[0], out), lse


def result_dtype(logits: Tensor, target: Tensor, weight: Optional[Tensor]) -> torch.dtype:
    """The dtype of torch's loss against probabilities: the promotion of the
    logits', the target's and the weights' dtypes (``-(log_softmax(x) * q * w)``
    in torch's elementwise ops: bfloat16 logits and a float32 target give a
    float32 loss), with float16 and bfloat16 counted as float32 under autocast
    on the logits' device, which casts them."""
    dtypes = [logits.dtype, target.dtype] + ([] if weight is None else [weight.dtype])
    if _autocast(logits.device):
        dtypes = [torch.float32 if d in (torch.float16, torch.bfloat16) else d for d in dtypes]
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _autocast(device: torch.device) -> bool:
    """Whether autocast is on for `device`'s type (off for types it does not know)."""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:
        return False


_NARROW = (torch.float32,) + _HALF


def reads(logits: torch.dtype, target: torch.dtype) -> bool:
    """Whether the op reads probabilities of dtype `target` beside logits of
    dtype `logits` as they are: the logits' dtype, or two of float32, float16
    and bfloat16 (a float32 loss; it refuses other pairs, naming the target)."""
    return target == logits or (logits in _NARROW and target in _NARROW)


def target_dtype(logits: torch.dtype, target: torch.dtype, weight: Optional[Tensor] = None, autocast=False) -> torch.dtype:
    """The dtype in which the op reads a probability target of `target`'s dtype
    beside logits of `logits`' dtype, for :func:`fused`: the target's own where
    the op takes the pair (:func:`reads`), else one it takes that holds the
    target's values exactly (:func:`_widened`: a float64 target's own, which
    it does not take, beside narrower logits: the composite's, in float64).

    `weight`, the class weights where given, which the op reads in the
    target's dtype: a 16-bit target of other logits (whose loss is float32) is
    widened where that dtype does not hold them (float32 weights of a bfloat16
    target of float32 logits), as torch multiplies by them unrounded; weights
    that need a gradient widen any target that does not hold them, where the
    op reads the wider dtype (float32 weights of a bfloat16 target of bfloat16
    logits: a float32 target, and the float32 loss torch gives). Under
    `autocast`, a 16-bit target of other logits is widened too (the fused
    kernel takes another dtype's target outside autocast only, :func:`fused`).
    A copy costs a read of the target and a write of it widened (a float32
    target of float32 logits took 211 ms where a bfloat16 one widened took 317,
    fwd+bwd ``[4096, 32000]``, docs/BENCHMARKS.md session 81); the composite
    costs far more."""
    read = target
    other = target != logits and target in _HALF
    hold = weight is None or torch.promote_types(target, weight.dtype) == target
    if not reads(logits, target) or (other and (autocast or not hold)):
        read = _widened(logits, target)
    if weight is not None and weight.requires_grad and reads(logits, read):
        wide = torch.promote_types(read, weight.dtype)
        if reads(logits, wide):
            read = wide
    return read


def _widened(logits: torch.dtype, target: torch.dtype) -> torch.dtype:
    """The dtype the op reads beside `logits` that holds a `target` exactly: the
    logits' where it is wider (a 16-bit target of float32 logits, any target of
    float64 logits), float32 for a 16-bit target of the other 16-bit logits
    (torch's promotion of the pair, and the dtype of its loss), else the
    target's own."""
    if torch.promote_types(logits, target) == logits:
        return logits
    if logits in _HALF and target in _HALF:
        return torch.float32
    return target


def fused(rows: Tensor, p: torch.dtype, weight: Optional[Tensor]) -> bool:
    """Whether the op takes the probabilities of dtype `p` itself (its fused
    kernel; :func:`target_dtype` gives `p`): `p` the logits' dtype, or another
    of float32, float16 and bfloat16 outside autocast, which the kernels read
    as it is. The target and the class weights may need a gradient, the weights
    where `p` holds them exactly (no rounded copy between them and their
    gradient); the op's autograd formulas give both from its lse in float32
    (``_autograd``; in bfloat16 3.9x and 8-9x the composite's speed,
    docs/BENCHMARKS.md session 80). Elsewhere :func:`probabilities` builds the
    loss from the op's log-sum-exp with torch's ops.

    The kernels read the weights in the target's dtype: float32 weights of
    16-bit logits and target are rounded to it, as torch's own float16 and
    bfloat16 losses round ``target * weight``; under autocast the op's float32
    value takes them as they are (``_autocast``). A float32 target of 16-bit
    logits (a student's logits against a teacher's probabilities): the kernels
    read it and the weights in float32, and the loss is float32, as torch's
    (see :func:`probabilities`); so is the loss of a 16-bit target of float32
    logits or of the other 16-bit dtype. Not under autocast, whose kernel takes
    a float32 copy of 16-bit logits anyway."""
    if weight is not None and weight.requires_grad and torch.promote_types(weight.dtype, p) != p:
        return False
    if p == rows.dtype:
        return True
    return reads(rows.dtype, p) and not _autocast(rows.device)


def _reduce(loss: Tensor, reduction: str, mean_over: Callable[[], object], dtype: torch.dtype) -> Tensor:
    """`loss` (``[N]`` rows) reduced, and rounded to `dtype`; ``"mean"`` divides
    the sum by ``mean_over()``."""
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / mean_over()
    return loss.to(dtype)
