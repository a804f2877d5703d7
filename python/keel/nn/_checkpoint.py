"""Sharded checkpoints (``torch.distributed.checkpoint``, DCP) of weights that
:class:`keel.nn.GateUpColwiseParallel` shards.

Such a weight is placed ``_StridedShard(0, split_factor=2)``: rank ``r`` of
``n`` holds two blocks of rows, ``gate_r`` and ``up_r``, from two places in
the global ``[gate; up]``. DCP describes each rank's shard as one block
(``compute_local_shape_and_global_offset``), and refuses the save ("overlapping
chunks"). :func:`checkpointable` gives each such DTensor in a state dict the
two blocks it holds, through the hooks DCP asks a DTensor's local tensor for
(``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, in torch 2.10-2.15): the checkpoint then holds the
weight in its own order, which any layout loads (another tensor-parallel
degree, FSDP2, a plain module).
"""
import copy

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from .._gate_halves import halves, resharded

_NAME = "keel.nn.checkpointable"


class _Blocks:
    """The blocks of the global tensor that one rank's local tensor holds, as
    DCP asks for them. Each is ``(global offset, local offset, size)``."""

    def __init__(self, local: torch.Tensor, blocks: list, shape: torch.Size) -> None:
        self.local, self.blocks, self.shape = local, blocks, shape

    def __deepcopy__(self, memo):
        # DCP's async_save stages a state dict to CPU memory with a deepcopy
        # that puts each tensor's copy in `memo` before its attributes: these
        # blocks then describe that copy. Elsewhere (copy.deepcopy of a tensor
        # records it after) there is no copy to describe.
        local = memo.get(id(self.local))
        if local is None:
            self.__reduce__()
        return _Blocks(local, self.blocks, self.shape)

    def __reduce__(self):
        raise TypeError(
            f"{_NAME}: the state dict it returns is for torch.distributed.checkpoint's save, async_save and "
            "load only, and cannot be pickled or copied otherwise (torch.save, copy.deepcopy)"
        )

    def chunk_list(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=g, sizes=s) for g, _, s in self.blocks]

    def write_items(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, g, i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=g, sizes=s), properties=properties, size=self.shape
                ),
            )
            for i, (g, _, s) in enumerate(self.blocks)
        ]

    def tensor_shard(self, index) -> torch.Tensor:
        for g, lo, s in self.blocks:
            if index.offset == g:
                return self.local[tuple(slice(o, o + n) for o, n in zip(lo, s))]
        raise ValueError(f"{_NAME}: {index.fqn} holds no block at offset {index.offset} on this rank")


def _blocks(t: DTensor, name: str):
    """The two blocks of `t`'s local tensor where a mesh dim places it
    ``halves(d)`` (the last such dim); None for any other layout (DCP takes
    those as they are)."""
    ours = [i for i, p in enumerate(t.placements) if isinstance(p, _StridedShard) and p == halves(p.dim)]
    if not ours:
        return None
    i = ours[-1]
    d = t.placements[i].dim % t.ndim
    mesh = t.device_mesh
    rows = [j for j, p in enumerate(t.placements)
            if j != i and (p.is_shard() or isinstance(p, _StridedShard)) and p.dim % t.ndim == d]
    if any(j > i and mesh.size(j) > 1 for j in rows):
        # FSDP2's own layout of rows sharded twice (its _StridedShard comes first): DCP's.
        return None
    again = [j for j in rows if mesh.size(j) > 1]
    if again:
        raise resharded(_NAME, name, again + [i], t.placements)
    ranks, coordinate = mesh.size(i), mesh.get_coordinate()
    if coordinate is None:
        return None  # not in the mesh: no shard to save
    if t.shape[d] % (2 * ranks):
        raise RuntimeError(f"{_NAME}: {name}'s {t.shape[d]} rows do not split into two halves among {ranks} ranks")
    # The other dims' offsets and sizes, as torch computes them (rows: below).
    others = [Replicate() if j == i or j in rows else p for j, p in enumerate(t.placements)]
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, mesh, others)
    half, per = t.shape[d] // 2, t.shape[d] // (2 * ranks)
    local = [*sizes]
    local[d] = 2 * per
    if tuple(t._local_tensor.shape) != tuple(local):
        raise RuntimeError(f"{_NAME}: {name}'s local shape {tuple(t._local_tensor.shape)} is not {tuple(local)}")
    blocks = []
    for k in range(2):
        g, lo, s = [*offsets], [0] * t.ndim, [*sizes]
        g[d], lo[d], s[d] = k * half + coordinate[i] * per, k * per, per
        blocks.append((torch.Size(g), lo, torch.Size(s)))
    return blocks


def _marked(t: DTensor, name: str):
    blocks = _blocks(t, name)
    if blocks is None:
        return t
    with torch.no_grad():
        view = DTensor.from_local(
            t._local_tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    local = view._local_tensor  # a view of t's, made for `view`: t's own is left alone
    found = _Blocks(local, blocks, t.shape)
    local.__create_write_items__ = found.write_items
    local.__create_chunk_list__ = found.chunk_list
    local.__get_tensor_shard__ = found.tensor_shard
    return view


def _walk(value, name: str):
    """`value` with its DTensors marked: dicts and lists copied (an optimizer's
    state dict shares its inner dicts with the optimizer), other values kept."""
    if isinstance(value, dict):
        out = copy.copy(value)
        for key in out:
            out[key] = _walk(out[key], f"{name}.{key}" if name else str(key))
        return out
    if isinstance(value, list):
        return [_walk(item, f"{name}.{i}") for i, item in enumerate(value)]
    if isinstance(value, DTensor):
        return _marked(value, name)
    return value


def checkpointable(state_dict: dict) -> dict:
    """`state_dict` made ready for ``torch.distributed.checkpoint.save`` and
    ``load`` (DCP): each DTensor in it that :class:`keel.nn.GateUpColwiseParallel`
    shards (a weight, its bias, their optimizer states) is replaced by a view
    of the same memory that tells DCP the two blocks of rows each rank holds.
    Without it, DCP refuses such a weight ("overlapping chunks").

    Returns a new dict: its nested dicts and lists are copies, and every
    other value is `state_dict`'s own (nothing in it changes). ``dcp.load``
    writes tensors in place, views included, and puts the other values it
    reads in the dict it is given: pass the returned dict on::

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save(keel.nn.checkpointable({"model": model_sd, "optim": optim_sd}), checkpoint_id=path)

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = keel.nn.checkpointable({"model": model_sd, "optim": optim_sd})
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    An app state (a ``Stateful``, as torch's DCP recipe and torchtitan write
    one) returns it from its ``state_dict()``, and its ``load_state_dict``
    takes it back, as above, after ``dcp.load`` has loaded into it.

    The checkpoint holds the weight in its own order (``[gate; up]``), so a
    plain module, another tensor-parallel degree or FSDP2 loads it. The dict
    is for ``dcp.save``, ``dcp.async_save`` (whose staging copies it) and
    ``dcp.load``: pickling or copying it otherwise (``torch.save``,
    ``copy.deepcopy``) raises a TypeError. Raises a RuntimeError for a weight that FSDP2's
    default sharding (dim 0) has sharded on its rows again, over more than one
    data-parallel rank (torch's placements misplace its rows; shard dim 1).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"{_NAME}: takes a state dict (a dict), got {type(state_dict).__name__}")
    return _walk(state_dict, "")
