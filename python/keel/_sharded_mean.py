"""Cross-entropy ``"mean"`` of DTensor logits sharded on their rows, without
gathering them: the op's own sharding rule (``keel._dtensor``) runs ``"mean"``
whole, since it divides by the weight of every rank's rows, so
``keel.cross_entropy`` and ``keel.cross_entropy_with_lse`` build it here on
``"none"`` (docs/BENCHMARKS.md, session 102: ``[4096, 32000]`` float32 over two
ranks, 150 ms against the gathering op's 1788)."""
import math
import sys
from typing import Optional

import torch

from ._dtensor import _MODULE


def rows_sharded(logits) -> bool:
    """Whether `logits` is a DTensor sharded on a dim other than the classes'
    (dim 1, or 0 for ``[V]``): on its rows. False, with no import, where
    ``torch.distributed.tensor`` has not been imported (no DTensor exists)."""
    module = sys.modules.get(_MODULE)
    if module is None or not isinstance(logits, module.DTensor):
        return False
    classes = 1 if logits.ndim > 1 else 0
    return any(p.is_shard() and p.dim % logits.ndim != classes for p in logits.placements)


def sharded_row_dim(logits) -> Optional[int]:
    """The dim of DTensor `logits` ``[N, V, d2, ...]`` other than the classes'
    (dim 1) that its placements shard, where it is the only one, else None (no
    import where ``torch.distributed.tensor`` has not been imported)."""
    module = sys.modules.get(_MODULE)
    if module is None or not isinstance(logits, module.DTensor) or logits.ndim < 3:
        return None
    dims = {p.dim % logits.ndim for p in logits.placements if p.is_shard()} - {1}
    return dims.pop() if len(dims) == 1 else None


def split_evenly(t, dim: int) -> bool:
    """Whether the ranks that shard DTensor `t`'s dim `dim` split it evenly
    (DTensor flattens no uneven shards)."""
    ranks = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if p.is_shard() and p.dim % t.ndim == dim)
    return t.shape[dim] % ranks == 0


def unsharded(t, dim: int):
    """`t` with its dim `dim` gathered (``Replicate`` where it was sharded), or
    `t` itself where it is not a DTensor."""
    if not isinstance(t, sys.modules[_MODULE].DTensor):
        return t
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_shard() and p.dim % t.ndim == dim else p for p in t.placements]
    whole = t.redistribute(t.device_mesh, placements)
    # torch 2.10's gather along a dim other than 0 left the local tensor
    # strided, under a DTensor that took itself for contiguous (a flat view failed).
    local = whole.to_local()
    if local.is_contiguous():
        return whole
    return type(t).from_local(local.contiguous(), t.device_mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def sharded_mean(fn, logits, target, ignore_index, label_smoothing, weight):
    """``fn(..., reduction="mean")`` (``keel.cross_entropy`` or
    ``keel.cross_entropy_with_lse``) of `logits` sharded on their rows
    (:func:`rows_sharded`) without gathering them: ``fn`` with ``"none"`` on each
    rank's rows; the sum of those losses over the weight of the rows (the
    targets' class weights, or 1 each, of the rows not ignored), both summed
    across the ranks in one reduction of two numbers, in float32 (float64 for
    float64 losses); with probabilities, the sum over the row count, as torch's.
    The loss is whole on every rank (``Replicate``), as the op's would be; the
    gradients of the logits come out sharded as they are. Where all rows are
    ignored it is NaN, as torch's. The ``"none"`` losses are rounded to their
    dtype before they are added up, and each row's gradient, ``1 / weight``,
    before the backward kernel reads it (as torch's own 16-bit backward rounds
    it): for 16-bit logits the loss and the gradients can differ from the
    op's, which keep both in float32, in their last bit or two (bfloat16
    ``[12, 50]``: the same loss, gradients within 2^-7 of each other's)."""
    kw = {} if weight is None else {"weight": weight}
    out = fn(logits, target, ignore_index, label_smoothing, "none", **kw)
    losses = out[0] if isinstance(out, tuple) else out
    acc = torch.promote_types(losses.dtype, torch.float32)
    total = losses.to(acc).sum()
    if target.dtype.is_floating_point:  # probabilities: torch's mean is over the rows
        loss = _whole(total) / losses.numel()
    else:
        kept = target != ignore_index
        if weight is None:
            count = kept.to(acc).sum()
        else:
            # In the dtype the op reads them in: the losses' (`_common.ce_weight_dtype`).
            # An embedding, not `w[target]`: DTensor takes its backward (Partial,
            # no gather) where it gathers the target for an index's, and where
            # torch 2.10's fails (index_put: "shape mismatch").
            w = weight.to(losses.dtype).to(acc)[:, None]
            if isinstance(target, type(losses)) and not isinstance(w, type(losses)):
                w = _replicated(w, target.device_mesh)  # a tensor's gradient: whole on every rank
            picked = torch.nn.functional.embedding(torch.where(kept, target, 0), w).squeeze(-1)
            count = torch.where(kept, picked, 0).sum()
        both = _whole(torch.stack([total, count]))
        loss = both[0] / both[1]
    loss = loss.to(losses.dtype)
    return (loss, out[1]) if isinstance(out, tuple) else loss


def _whole(t):
    """DTensor `t` replicated on every rank (a ``Partial`` sum reduced)."""
    from torch.distributed.tensor import Replicate

    return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim)


def _replicated(t, mesh):
    """Plain tensor `t` as a DTensor replicated on `mesh` (its gradient
    reduced to the whole one on every rank)."""
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
