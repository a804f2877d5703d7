"""``silu_and_mul`` and ``gelu_and_mul`` of a DTensor whose last dim's two
halves (gate, up) are sharded alike: each rank gates its own pairs.

That is the output of :class:`keel.nn.GateUpColwiseParallel` with
``use_local_output=False``: placed ``_StridedShard(-1, split_factor=2)``, rank
``r`` holding ``[gate_r | up_r]``. The ops' sharding rules (``keel._dtensor``)
know only ``Shard``, so DTensor would gather the halves first (and torch 2.10
and 2.11 cannot redistribute a ``_StridedShard`` tensor at all). Here the typed
function runs on each rank's local tensor, and the result is the rank's share
of the hidden features: ``Shard(-1)``, as ``RowwiseParallel`` takes it. Other
mesh dims may be ``Replicate`` or shard the rows (any dim but the last); a
``Partial`` input goes to the op (a gate is not linear).
"""
import sys

import torch

from ._dtensor import _MODULE


def halves(dim: int):
    """The placement of a dim whose two halves (gate, up) are sharded alike
    across a mesh dim: ``_StridedShard(dim, split_factor=2)``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=2)


def from_local(local, mesh, placements, shape):
    """``DTensor.from_local`` of `local` with the global `shape` given (and its
    contiguous strides): the local shapes are not all alike on every path."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def resharded(who: str, name: str, dims, placements) -> RuntimeError:
    """The error for a tensor whose halves-sharded rows another mesh dim shards
    again (FSDP2's default over a data-parallel dim of more than one rank):
    torch's placements then misplace its rows, in a gather or a checkpoint."""
    return RuntimeError(
        f"{who}: {name} is sharded on its rows along mesh dims {sorted(dims)} (placements {tuple(placements)}): "
        "FSDP2's fully_shard over the tensor parallelism shards [gate_r; up_r] again, and torch would gather "
        "or checkpoint its rows in the wrong order. Shard the weight on dim 1: "
        "fully_shard(..., shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None), with no bias"
    )


def halves_sharded(input) -> bool:
    """Whether `input` is a DTensor whose last dim's halves are sharded alike
    along one mesh dim, the others replicated or sharding the rows. No import
    where ``torch.distributed.tensor`` has not been imported (no DTensor exists)."""
    module = sys.modules.get(_MODULE)
    if module is None or not isinstance(input, module.DTensor) or input.ndim == 0:
        return False
    from torch.distributed.tensor.placement_types import _StridedShard

    last, strided = input.ndim - 1, 0
    for p in input.placements:
        if isinstance(p, _StridedShard):
            # Compared whole: torch.compile (2.15) cannot read split_factor.
            if p.dim % input.ndim != last or p != halves(p.dim):
                return False
            strided += 1
        elif not (p.is_replicate() or (p.is_shard() and p.dim % input.ndim != last)):
            return False
    return strided == 1


def gated(fn, input, *args):
    """`fn` (``keel.silu_and_mul`` or ``keel.gelu_and_mul``) on each rank's
    local pairs of `input` (see :func:`halves_sharded`), as a DTensor sharded
    on its last dim where the halves were. Differentiable (through
    ``to_local`` and ``from_local``), with no collective."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    last = input.ndim - 1
    out = fn(input.to_local(), *args)
    placements = tuple(Shard(last) if isinstance(p, _StridedShard) else p for p in input.placements)
    return from_local(out, input.device_mesh, placements, (*input.shape[:-1], input.shape[-1] // 2))
