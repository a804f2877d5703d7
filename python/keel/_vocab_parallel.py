"""Cross-entropy of DTensor logits sharded on their classes (tensor-parallel
vocabularies, as ``torch.distributed.tensor.parallel.loss_parallel`` takes
them), without gathering the logits: the op's sharding rule (``keel._dtensor``)
needs whole rows, so DTensor would all-gather the ``[N, V]`` logits on every
rank. ``keel.cross_entropy`` and ``keel.cross_entropy_with_lse`` (and so
``keel.nn.CrossEntropyLoss``) run it here instead, each rank on its own
classes ``[lo, lo + v)``:

- forward: Keel's kernel gives each row's log-sum-exp over the rank's classes,
  ``lse_r`` (and, with label smoothing, the rank's share of the smoothing term,
  by the kernel with ``label_smoothing=1``); the rank picks its rows' target
  logits where the target is one of its classes. One all-gather of those few
  numbers a row (2, or 4 with label smoothing) gives every rank the whole
  rows' ``lse`` (the log-sum-exp of the ranks' ``lse_r``), target logits and
  smoothing terms, and so the loss, whole on every rank (``Replicate``);
- backward, with no collective: the gradient of the rank's logits is
  ``s (exp(x - lse) - a)``, which Keel's backward kernel writes from the
  rank's own ``lse_r`` with each row's gradient scaled by ``exp(lse_r - lse)``
  (the rank's share of the probability); the target column, one a row, is
  then written from its logit (so a row whose target is another rank's gets no
  one-hot, and no cancellation where it has), and label smoothing subtracts
  its constant (times the class weights) in one more pass.

Taken (``[N, V, d1, ...]`` logits too, which ``keel.cross_entropy`` takes as
rows ``[N d1 ..., V]``): 2-D logits with one mesh dim sharding the classes (``Shard(1)``) and
every other mesh dim ``Replicate`` or sharding the rows (``Shard(0)``: data
parallelism over a 2-D mesh, as torch 2.15's ``loss_parallel`` takes it), a
class-index target (a tensor, or a DTensor; where the rows are sharded, a
DTensor, which is moved to the logits' rows), class weights that are ``None``,
a tensor or a replicated DTensor (where they need a gradient, it comes out
whole on every rank: with label smoothing after one more all-gather, of each
rank's classes' terms; with the rows sharded, a DTensor's is ``Partial`` over
the rows' mesh dims, a tensor's summed over them by one all-reduce), each rank
holding at least one class. With the rows sharded,
the losses and lse of ``"none"`` are sharded as the rows are, a ``"sum"`` is
each rank's rows' share (``Partial``, as the op's), and a ``"mean"`` is built
on ``"none"`` by ``keel._sharded_mean`` (one all-reduce of two numbers), whole
on every rank: the all-gather runs over the classes' mesh dim only. Other
cases go to the op (which gathers the logits first).
"""
import sys
from typing import Optional

import torch

from ._dtensor import _MODULE
from ._target_checks import checking, out_of_range, raise_first

_16_BIT = (torch.float16, torch.bfloat16)
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def classes_sharded(logits, target, weight, reduction) -> Optional[int]:
    """The mesh dim that shards `logits`' classes, where this module takes the
    call (see the module's docstring), else None: also for a ``"mean"`` with
    the rows sharded, which ``keel._sharded_mean`` builds on ``"none"`` (and so
    on this module). No import where ``torch.distributed.tensor`` has not been
    imported (no DTensor exists)."""
    module = sys.modules.get(_MODULE)
    if module is None or not isinstance(logits, module.DTensor) or logits.ndim != 2:
        return None
    if torch.compiler.is_compiling() and _TORCH == (2, 11):
        # Compiled (aot_eager) on torch 2.11, the logits' gradient came out 0;
        # 2.10 and 2.12 to 2.15 compile it right (test_dtensor_vocab_parallel's
        # compiled case, session 104). On 2.11 the op runs it (gathering the logits).
        return None
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.ndim != 1:
        return None
    placements = logits.placements
    dims = [i for i, p in enumerate(placements) if p.is_shard() and p.dim % 2 == 1]
    if len(dims) != 1 or any(not _rows_or_whole(p) for i, p in enumerate(placements) if i != dims[0]):
        return None
    if reduction == "mean" and _row_dims(logits, dims[0]):
        return None
    if isinstance(target, module.DTensor) and not all(_rows_or_whole(p) for p in target.placements):
        return None
    if isinstance(weight, module.DTensor) and not all(p.is_replicate() for p in weight.placements):
        return None
    # Every rank holds a class (torch.chunk's split, which Shard's is): else the
    # kernel, which takes no empty row, has nothing to run on for one of them.
    ranks, classes = logits.device_mesh.size(dims[0]), logits.shape[1]
    if (ranks - 1) * -(-classes // ranks) >= classes:
        return None
    return dims[0]


def vocab_parallel(op: str, logits, target, ignore_index, label_smoothing, reduction, weight, dim):
    """The loss and each row's log-sum-exp (``keel.cross_entropy_with_lse``'s two
    results) of `logits` sharded on their classes along mesh dim `dim`
    (:func:`classes_sharded`): whole on every rank, or where other mesh dims
    shard the rows, sharded as they are (``"sum"``: ``Partial`` there); `op`
    names the op in errors."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if reduction not in ("none", "sum", "mean"):
        raise RuntimeError(f"{op}: argument 'reduction' must be \"mean\", \"sum\" or \"none\", got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"{op}: argument 'label_smoothing' must be in [0, 1], got {label_smoothing}")
    mesh = logits.device_mesh
    rows = _row_dims(logits, dim)
    per_row = [Shard(0) if i in rows else Replicate() for i in range(mesh.ndim)]
    if rows and not isinstance(target, DTensor):
        raise RuntimeError(
            f"{op}: argument 'target' must be a DTensor where the logits' rows are sharded "
            f"(logits placements {tuple(logits.placements)}), got a plain tensor: "
            f"distribute it with placements {tuple(per_row)}, as the rows are"
        )
    if isinstance(target, DTensor) and target.device_mesh != mesh and (rows or not all(p.is_replicate() for p in target.placements)):
        raise RuntimeError(
            f"{op}: argument 'target' is a DTensor on another mesh than the logits' ({target.device_mesh} against "
            f"{mesh}): give it the logits' mesh, with placements {tuple(per_row)}"
        )
    if target.shape != (logits.shape[0],):
        raise RuntimeError(f"{op}: argument 'target' must have shape [{logits.shape[0]}], got {list(target.shape)}")
    if isinstance(target, DTensor) and tuple(target.placements) != tuple(per_row):
        target = target.redistribute(mesh, per_row)  # Replicate to the rows' Shard(0): each rank's slice
    summed = [Partial() if i in rows else Replicate() for i in range(mesh.ndim)]
    x = logits.to_local(grad_placements=logits.placements)
    t = target.to_local() if isinstance(target, DTensor) else target
    # The class weights' gradient from each rank's rows: a DTensor's is left
    # Partial over the rows' mesh dims (as the norms' weights'); a tensor's is
    # summed over them in the backward (one all-reduce), whole on every rank.
    w, reduced = weight, tuple((mesh, i) for i in rows)
    if isinstance(weight, DTensor):
        w, reduced = weight.to_local(grad_placements=summed), ()
    classes = logits.shape[1]
    if t.dtype != torch.int64:
        raise RuntimeError(f"{op}: argument 'target' must have dtype torch.int64, got {t.dtype}")
    if w is not None and w.shape != (classes,):
        raise RuntimeError(f"{op}: argument 'weight' must have shape [{classes}], got {list(w.shape)}")
    chunk = -(-classes // mesh.size(dim))
    lo = mesh.get_local_rank(dim) * chunk
    bad = out_of_range(t, classes, ignore_index)
    if checking(x):
        # Raised on the ranks whose rows hold it (with the rows sharded, the
        # others wait at their next collective, as for torch's own ops).
        raise_first(op, t, bad, classes, ignore_index, _first_row(logits))
    out = x.dtype
    if out in _16_BIT and torch.is_autocast_enabled(x.device.type):
        out = torch.float32  # as torch's cross_entropy under autocast
    groups = ((mesh, dim), reduced)
    args = (t, w, lo, classes, ignore_index, float(label_smoothing), reduction, groups, out, bad)
    loss, lse = _VocabParallel.apply(x, *args)
    n = torch.Size([logits.shape[0]])
    if reduction != "none":
        loss = DTensor.from_local(loss, mesh, summed, run_check=False, shape=torch.Size([]), stride=())
    else:
        loss = DTensor.from_local(loss, mesh, per_row, run_check=False, shape=n, stride=(1,))
    return loss, DTensor.from_local(lse, mesh, per_row, run_check=False, shape=n, stride=(1,))


def _rows_or_whole(p) -> bool:
    """Whether placement `p` of 2-D logits (or a 1-D target) is ``Replicate`` or
    shards dim 0, the rows."""
    return p.is_replicate() or (p.is_shard() and p.dim in (0, -2))


def _row_dims(logits, dim):
    """The mesh dims other than `dim` that shard `logits`' rows."""
    return tuple(i for i, p in enumerate(logits.placements) if i != dim and p.is_shard())


def _first_row(logits) -> int:
    """The whole logits' index of the rank's first row."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)[1][0]


class _VocabParallel(torch.autograd.Function):
    """The rank's part of :func:`vocab_parallel` on local tensors: ``x`` the
    rank's ``[N, v]`` logits, classes ``[lo, lo + v)`` of ``classes``."""

    @staticmethod
    def forward(ctx, x, t, w, lo, classes, ignore_index, eps, reduction, groups, out, bad):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.contiguous()
        v = x.shape[1]
        valid = t != ignore_index
        mine = valid & (t >= lo) & (t < lo + v)
        col = torch.where(mine, t - lo, 0)
        w_local = w_t = None
        if w is None:
            w_t, w_rank, w_all = valid.to(acc), float(v), float(classes)
        else:
            wd = w.to(x.dtype)  # as the kernels read class weights: in the logits' dtype
            wa = wd.to(acc)
            w_t = torch.where(valid, wa[torch.where(valid, t, 0).clamp(0, classes - 1)], 0)
            w_local, w_rank, w_all = wd[lo : lo + v].contiguous(), wa[lo : lo + v].sum(), wa.sum()
        smooth = eps > 0.0
        kernel_w = w_local if smooth else None
        # With label_smoothing=1 the kernel's row loss is the smoothing term over
        # the rank's classes, over v: sum_c w_c (lse_r - x_c) / v.
        losses, lse_r = torch.ops.keel.cross_entropy_with_lse(x, torch.where(valid, col, -1), -1, 1.0 if smooth else 0.0, "none", kernel_w)
        lse_r = lse_r.to(acc)
        x_t = torch.where(mine, x.gather(1, col[:, None])[:, 0].to(acc), 0)
        stats = [lse_r, x_t]
        if smooth:
            # A rank's row of -inf only (its classes all masked): lse_r is -inf, the
            # kernel's smoothing term NaN; its share, inf, comes from w_rank (lse - lse_r).
            term = torch.where(lse_r == float("-inf"), 0, losses.to(acc) * v)
            stats += [term, torch.full_like(lse_r, 0) + w_rank]
        group, row_groups = groups
        every = _all_gather(torch.stack(stats), group).view(_size(group), len(stats), x.shape[0])
        lse = torch.logsumexp(every[:, 0], 0)
        hit = lse - every[:, 1].sum(0)  # lse - x[t]
        loss = (1.0 - eps) * w_t * hit
        if smooth:
            # sum_c w_c (lse - x_c): each rank's term, moved from its lse_r to lse.
            loss = loss + eps / classes * (every[:, 2] + every[:, 3] * (lse - every[:, 0])).sum(0)
        loss = torch.where(valid, loss, 0)
        loss = torch.where(bad, float("nan"), loss)
        over = w_t.sum()
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            loss = torch.where(over == 0, float("nan"), loss.sum() / over)
        ctx.save_for_backward(x, t, col, valid, mine, bad, w_t, w_local, lse_r, lse, over, hit, loss)
        ctx.args = (eps, classes, reduction, w_all, groups, None if w is None else w.dtype)
        ctx.set_materialize_grads(False)
        return loss.to(out), torch.where(valid, lse, 0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, g_lse):
        x, t, col, valid, mine, bad, w_t, w_local, lse_r, lse, over, hit, loss = ctx.saved_tensors
        eps, classes, reduction, w_all, (group, row_groups), w_dtype = ctx.args
        acc = lse.dtype
        zero = torch.zeros((), dtype=acc, device=x.device)
        g = zero if g_loss is None else g_loss.to(acc)
        if reduction == "mean":
            g = torch.where(over == 0, float("nan"), g / over)
        g = torch.where(valid, g.expand(valid.shape), 0)
        g = torch.where(bad, float("nan"), g)
        # dx = s exp(x - lse) - g w_j ((1 - eps) [j = t] + eps / V), s = g A + the lse's gradient.
        s = g * ((1.0 - eps) * w_t + eps * w_all / classes)
        if g_lse is not None:
            s = s + torch.where(valid, g_lse.to(acc), 0)
        share = torch.exp(lse_r - lse)
        # Rows whose probability on this rank is 0 (its classes all -inf, say)
        # skip the kernel, which would take exp(x - lse_r) of -inf - -inf; a NaN
        # share (a NaN logit on any rank) runs it, to give the row NaN.
        run = valid & (share != 0)
        dx = torch.ops.keel.cross_entropy_backward(
            torch.where(run, s * share, 0).to(x.dtype), x, torch.where(run, col, -1), -1, 0.0, "none", lse_r, None
        )
        if eps > 0.0:
            off = (g * (eps / classes)).to(x.dtype)
            if w_local is None:
                dx.sub_(off[:, None])
            else:
                dx.addr_(off, w_local, alpha=-1)
        w_col = 1.0 if w_local is None else w_local.to(acc)[col]
        at = s * torch.exp(x.gather(1, col[:, None])[:, 0].to(acc) - lse) - g * w_col * ((1.0 - eps) * mine.to(acc) + eps / classes)
        # index_put_, not scatter_: torch's CPU scatter_ of bfloat16 took 166 ms
        # for 4096 values into [4096, 16000] (float32: 0.04; index_put_: 0.06).
        rows = torch.arange(x.shape[0], device=x.device)
        dx.index_put_((rows, col), torch.where(valid, at, 0).to(x.dtype))
        dw = None
        if ctx.needs_input_grad[2]:
            dw = _weight_grad(x, t, valid, g, lse, hit, loss, eps, classes, reduction, group)
            for other in row_groups:  # the other ranks' rows' share
                dw = _all_reduce(dw, other)
            dw = dw.to(w_dtype)
        return dx, None, dw, *([None] * 8)


def _weight_grad(x, t, valid, g, lse, hit, loss, eps, classes, reduction, group):
    """The class weights' gradient, whole on every rank: ``sum_i g_i ((1 - eps)
    [t_i = c] (lse_i - x_it) + eps / V (lse_i - x_ic))`` (`g` each row's loss
    gradient, over the mean's divisor already), less ``g L`` times the rows of
    target ``c`` for a mean ``L``. The first term from the whole rows' numbers
    every rank has; the second from each rank's classes, all-gathered (padded
    to the ranks' common width)."""
    acc = lse.dtype
    dw = torch.zeros(classes, dtype=acc, device=x.device)
    t_safe = torch.where(valid, t, 0).clamp(0, classes - 1)
    per_row = (1.0 - eps) * hit
    if reduction == "mean":
        per_row = per_row - loss  # d(sum / over)/dw_t = (d sum/dw_t - mean) / over, over in g
    dw.scatter_add_(0, t_safe, torch.where(valid, g * per_row, 0))
    if eps > 0.0:
        mine = (g * torch.where(valid, lse, 0)).sum() - torch.mv(x.to(acc).t(), g)
        chunk = -(-classes // _size(group))
        padded = torch.nn.functional.pad(eps / classes * mine, (0, chunk - mine.shape[0]))
        dw = dw + _all_gather(padded, group)[:classes]
    return dw


def _size(group) -> int:
    mesh, dim = group
    return mesh.size(dim)


def _all_gather(t, group):
    """`t` of every rank of the mesh dim `group` (``(mesh, dim)``), stacked on
    dim 0 in the ranks' order."""
    from torch.distributed import _functional_collectives as funcol

    # all_gather_single from torch 2.15 (all_gather_tensor, deprecated there, before).
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    out = gather(t, 0, group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _all_reduce(t, group):
    """The sum of `t` over the ranks of the mesh dim `group` (``(mesh, dim)``)."""
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_reduce(t, "sum", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
