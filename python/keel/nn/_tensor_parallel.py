"""Tensor parallelism for a fused ``[gate; up]`` projection (``keel.nn.SwiGLU``'s
``gate_up_proj``).

torch's ``ColwiseParallel`` shards a linear's weight on its rows in one piece.
For a fused ``[gate; up]`` weight on two ranks, rank 0 then holds the gate rows
and rank 1 the up rows, and ``silu_and_mul`` of a rank's output multiplies gate
by gate and up by up: wrong numbers, of the right shape, that ``RowwiseParallel``
on ``down_proj`` takes without complaint. ``GateUpColwiseParallel`` shards both
halves alike instead: rank ``r`` holds ``[gate_r; up_r]`` (the placement is
``_StridedShard(0, split_factor=2)``, the one torch's FSDP2 uses for a dim
sharded twice, so ``full_tensor()`` and the state dict give the weight in its
own order), and its output ``[..., 2 * hidden / tp]`` is
``[gate_r(x) | up_r(x)]``: ``silu_and_mul`` of it is the rank's share of the
hidden features, as ``RowwiseParallel`` expects.

This module imports ``torch.distributed.tensor`` (0.46 s), so ``keel.nn`` loads
it on first use only.
"""
import functools
import types
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from .._gate_halves import from_local, halves, resharded

_NAME = "keel.nn.GateUpColwiseParallel"


def _local_linear(self: nn.Linear, x: DTensor) -> DTensor:
    """The sharded linear's forward: each rank's rows of ``[gate; up]`` on the
    (replicated) input, with no collective. torch's sharding propagation of
    ``mm`` takes a ``_StridedShard`` weight from 2.15 on only, so the product
    is taken on the local tensors in every version."""
    weight = self.weight
    bias = self.bias
    # Each rank's rows give only its share of the input's gradient: Partial, so
    # it is summed across the ranks where the replicated input is read back
    # (torch's ColwiseParallel gets the same all-reduce from its mm).
    x_local = x.to_local(grad_placements=(Partial(),))
    local = torch.nn.functional.linear(x_local, weight.to_local(), None if bias is None else bias.to_local())
    return from_local(local, weight.device_mesh, (halves(local.dim() - 1),), (*local.shape[:-1], weight.shape[0]))


def _refuse_resharded(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a linear sharded by :class:`GateUpColwiseParallel`:
    refuses a weight or bias whose rows another mesh dim shards too.

    That is FSDP2's ``fully_shard`` over a data-parallel dim of more than one
    rank, which shards each rank's ``[gate_r; up_r]`` on its rows again and
    labels the result as if the rows were one block: ``full_tensor()`` then
    puts them in the wrong order (measured, torch 2.15: a full state dict
    0.58 off on a ``(2, 2)`` mesh), with no error. Sharding on dim 1 instead
    (``shard_placement_fn``) keeps the rows whole, and gathers right."""
    for name in ("weight", "bias"):
        t = state_dict.get(prefix + name)
        if not isinstance(t, DTensor):
            continue
        mesh = t.device_mesh
        rows = [i for i, p in enumerate(t.placements)
                if isinstance(p, (Shard, _StridedShard)) and p.dim % t.ndim == 0 and mesh.size(i) > 1]
        if len(rows) > 1:
            raise resharded(_NAME, prefix + name, rows, t.placements)


class GateUpColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a linear whose output is ``[gate | up]`` (the
    ``gate_up_proj`` of :class:`keel.nn.SwiGLU`, vLLM's merged layout), to be
    followed by ``keel.silu_and_mul`` or ``keel.gelu_and_mul``.

    Each rank holds its share of the gate rows and of the up rows (and of the
    bias), so the activation of its output is its share of the hidden features,
    as ``RowwiseParallel`` on the down projection takes them::

        from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

        parallelize_module(model, tp_mesh, {
            "mlp.gate_up_proj": keel.nn.GateUpColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })

    ``input_layouts`` (default ``Replicate()``; ``Shard(1)`` under sequence
    parallelism) and ``use_local_output`` are ``ColwiseParallel``'s. With
    ``use_local_output=False`` the output is a DTensor placed
    ``_StridedShard(-1, split_factor=2)``, which ``keel.silu_and_mul`` and
    ``keel.gelu_and_mul`` gate on each rank. Needs a 1-D mesh (the tensor-parallel one) and a hidden size
    (``out_features / 2``) that its ranks divide evenly. Under FSDP2 with more
    than one data-parallel rank, shard the weight on dim 1
    (``fully_shard(..., shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)``,
    no bias): FSDP2's default dim 0 trains right, but torch would gather the
    rows in the wrong order, so the state dict refuses it. For torch's sharded
    checkpoint (``torch.distributed.checkpoint``), pass the state dicts through
    :func:`keel.nn.checkpointable`: DCP alone refuses the weight. Plain ``ColwiseParallel`` on the fused
    projection would pair the wrong halves: ``keel.nn.SwiGLU`` refuses it.
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, use_local_output: bool = True) -> None:
        super().__init__(input_layouts=input_layouts, use_local_output=use_local_output)
        self.output_layouts = (halves(-1),)

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters(recurse=False):
            dist = distribute_tensor(param, device_mesh, [halves(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    @staticmethod
    def _output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{_NAME}: shards an nn.Linear (a fused [gate; up] projection), got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"{_NAME}: needs a 1-D device mesh (the tensor-parallel dim), got {device_mesh.ndim} dims")
        if module.out_features % 2:
            raise ValueError(
                f"{_NAME}: the linear's out_features ({module.out_features}) must be even: [gate; up], two halves"
            )
        hidden, ranks = module.out_features // 2, device_mesh.size()
        if hidden % ranks:
            raise ValueError(
                f"{_NAME}: the {hidden} hidden features (out_features / 2) must split evenly among the {ranks} ranks"
            )
        distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            functools.partial(self._output_fn, self.use_local_output),
        )
        module.forward = types.MethodType(_local_linear, module)
        module.register_state_dict_post_hook(_refuse_resharded)
        return module

