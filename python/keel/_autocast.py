"""cross_entropy under ``torch.autocast``: a float32 loss, as torch's.

torch's autocast runs ``cross_entropy`` in float32 (it is on the float32 list of
CPU and CUDA autocast): half-precision logits are cast up, a logits-sized copy,
and the loss comes back in float32. A loss stored in bfloat16 is coarse: near 36
its grid is 0.25 wide, and training code logs and compares it in float32.

Keel's kernels already compute in float32 from bfloat16 and float16 logits, so
no copy is needed. Under autocast, ``keel::cross_entropy`` and
``keel::cross_entropy_with_lse`` (the ops, so ``torch.ops.keel``, the typed API
and ``keel.nn.CrossEntropyLoss`` alike) return the loss in float32, its value
computed in float32 from each row's log-sum-exp (which the op returns in
float32) and the target's logit; the gradient is the op's own fused backward on
the half-precision logits, as outside autocast. float32 and float64 logits are
left as they are, as torch's autocast leaves them. The other ops keep their
inputs' dtype under autocast (README, "Mixed precision").
"""
import functools
import operator

import torch

from ._common import ce_weight_dtype, class_weighted
from .functional import _IGNORE_INDEX, _LABEL_SMOOTHING, _REDUCTION, as_called

_HALF = (torch.float16, torch.bfloat16)
_KEYS = ("AutocastCPU", "AutocastCUDA")
# The keys this kernel runs below: the op is called again with them excluded.
_AUTOCAST = functools.reduce(operator.or_, (torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, k)) for k in _KEYS))
_WITH_LSE = "cross_entropy_with_lse"


def float32_loss(op_name, logits, target, ignore_index=_IGNORE_INDEX, label_smoothing=_LABEL_SMOOTHING,
                 reduction=_REDUCTION, weight=None):
    """``cross_entropy_with_lse(...)`` below autocast, its loss in float32 where the
    logits are half precision: ``(loss, lse)``. Errors name op `op_name` (the op
    the caller asked for). Class weights (either target) go to the op in the
    dtype it takes them in (``_common.ce_weight_dtype``), as autocast casts
    arguments (its kernel's gradient rounds to that dtype anyway), and into the
    float32 value as they are."""
    cast = weight
    if weight is not None and logits.dtype in _HALF and weight.dtype.is_floating_point:
        cast = weight.to(ce_weight_dtype(logits, target))
    try:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
            loss, lse = torch.ops.keel.cross_entropy_with_lse.default(
                logits, target, ignore_index, label_smoothing, reduction, cast
            )
    except RuntimeError as err:
        renamed = as_called(err, f"keel::{_WITH_LSE}", f"keel::{op_name}") if op_name != _WITH_LSE else None
        if renamed is not None:
            raise renamed from None
        raise
    if logits.dtype not in _HALF:
        return loss, lse
    with torch.no_grad():
        exact = _loss_from_lse(logits, target, lse, ignore_index, label_smoothing, reduction, weight)
    wide = loss.float()
    # The value of `exact`, the gradient of the op's loss (its fused backward).
    return wide + (exact - wide.detach()), lse


def _loss_from_lse(logits, target, lse, ignore_index, label_smoothing, reduction, weight):
    """The loss in float32 from each row's float32 log-sum-exp `lse` (0 where the
    target is `ignore_index`): ``lse - x[t]``, with label smoothing ``(1 - ls)
    (lse - x[t]) + ls (lse - mean(x))``; reduced as the op reduces (``"mean"``
    over the rows not ignored, NaN when all are). Reads one logit a row, and every
    logit once where ``label_smoothing`` is not 0 (a float32 sum, no copy). With
    class weights: ``_common.class_weighted``."""
    if target.dtype.is_floating_point:
        return _probabilities_loss_from_lse(logits, target, lse, label_smoothing, reduction, weight)
    kept = target != ignore_index
    picked = logits.gather(-1, torch.where(kept, target, 0).unsqueeze(-1)).squeeze(-1).float()
    rows = lse - picked
    if weight is not None:
        # With label smoothing, sum(w x) from a float32 copy of the logits (as
        # torch's autocast makes one): a product rounded to the logits' dtype would
        # be off by 2^-9 |x| of the value, which it need not be.
        w = weight.float()
        smooth = w.sum() * lse - torch.mv(logits.float(), w) if label_smoothing != 0 else None
        return class_weighted(rows, smooth, w, target, ignore_index, label_smoothing, reduction)
    if label_smoothing != 0:
        mean = torch.sum(logits, -1, dtype=torch.float32) / logits.shape[-1]
        rows = (1 - label_smoothing) * rows + label_smoothing * (lse - mean)
    rows = torch.where(kept, rows, 0.0)
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / kept.sum()


def _probabilities_loss_from_lse(logits, target, lse, label_smoothing, reduction, weight):
    """:func:`_loss_from_lse` for probabilities `target` (shaped like the logits):
    ``(1 - ls) (sum(p) lse - sum(p x)) + ls (lse - mean(x))`` in float32, from
    float32 copies of both (torch's autocast copies the logits too); with class
    weights, ``sum(a) lse - sum(a x)``, ``a = w ((1 - ls) p + ls / C)``."""
    x, p = logits.float(), target.float()
    if weight is not None:
        a = (p * (1 - label_smoothing) + label_smoothing / x.shape[-1]) * weight.float()
        rows = a.sum(-1) * lse - (x * a).sum(-1)
    else:
        rows = (1 - label_smoothing) * (p.sum(-1) * lse - (x * p).sum(-1))
        if label_smoothing != 0:
            rows = rows + label_smoothing * (lse - x.mean(-1))
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / rows.shape[0]


def _kernel(name):
    if name == _WITH_LSE:
        return lambda *args: float32_loss(name, *args)
    return lambda *args: float32_loss(name, *args)[0]


def register() -> None:
    """Registers the float32 loss as the ops' autocast kernels (CPU and CUDA)."""
    global _LIB
    _LIB = torch.library.Library("keel", "IMPL")
    for name in ("cross_entropy", _WITH_LSE):
        for key in _KEYS:
            _LIB.impl(name, _kernel(name), key)
