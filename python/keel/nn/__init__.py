"""Drop-in modules built on Keel's ops."""
import numbers
import sys
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .._common import acc_of
from .._dtensor import _MODULE as _DTENSOR
from ..functional import _dense, _handle, _has_torch_function, _overridden, cross_entropy, layer_norm, rms_norm, silu_and_mul
from ._convert import convert

__all__ = ["RMSNorm", "LlamaRMSNorm", "LayerNorm", "SwiGLU", "GateUpColwiseParallel", "checkpointable", "CrossEntropyLoss", "convert"]

# torch.distributed.tensor (_DTENSOR) takes 0.46 s to import: GateUpColwiseParallel
# and checkpointable, which need it, are loaded on first use (``__getattr__``), and SwiGLU looks for
# DTensors only where that module has been imported.


if TYPE_CHECKING:
    from ._checkpoint import checkpointable
    from ._tensor_parallel import GateUpColwiseParallel


def __getattr__(name: str):
    if name == "GateUpColwiseParallel":
        from ._tensor_parallel import GateUpColwiseParallel

        return GateUpColwiseParallel
    if name == "checkpointable":
        from ._checkpoint import checkpointable

        return checkpointable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _shape(normalized_shape) -> tuple:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


def _flat(module_name: str, x: Tensor, normalized_shape: tuple, functional) -> tuple:
    """(x as [..., n], n) for the trailing normalized_shape dims of x: x itself
    where normalized_shape is one dim. Where x is not a dense tensor (sparse,
    nested: its shape or reshape fails) or not a tensor at all, the error is
    that of `functional` (the module's op) on x, naming op and argument."""
    try:
        return _flat_dense(module_name, x, normalized_shape)
    except (RuntimeError, AttributeError):
        if not isinstance(x, Tensor) or not _dense(x):
            functional(x)
        raise


def _flat_dense(module_name: str, x: Tensor, normalized_shape: tuple) -> tuple:
    k = len(normalized_shape)
    if k == 0:
        # torch's norms refuse it too; reshaped to [..., 1], each element would be
        # normalised on its own.
        raise RuntimeError(f"{module_name}: normalized_shape must have at least one dim, got ()")
    if k == 1 and x.dim() >= 1 and x.shape[-1] == normalized_shape[0]:
        # The common case, with no view: a view costs about 1.5 us on CPU (measured).
        return x, normalized_shape[0]
    if tuple(x.shape[x.dim() - k:]) != normalized_shape:
        raise RuntimeError(
            f"{module_name}: input of shape {tuple(x.shape)} does not end in normalized_shape {normalized_shape}"
        )
    n = 1
    for s in normalized_shape:
        n *= s
    return x.reshape(*x.shape[: x.dim() - k], n), n


def _param(module_name: str, arg: str, p: Optional[Tensor], x: Tensor, normalized_shape: tuple,
           n: int) -> Optional[Tensor]:
    """Parameter `arg` of module `module_name` as ``[n]`` in ``x``'s dtype.

    It must have the shape ``normalized_shape``, as torch's modules require.
    Where that is one dim and the parameter is too, the op checks the width
    itself (naming the argument); anywhere else a parameter is flattened, so it
    is checked here first: one of another shape with as many elements (``(8, 4)``
    for ``(4, 8)``, ``(2, 4)`` for ``(8,)``) would be taken silently, in the wrong
    order. float32 parameters with bfloat16 or float16 activations (mixed
    precision, autocast) are cast, as torch's modules accept them; the cast is
    differentiable, so the gradient reaches the parameter in its own dtype."""
    if p is None:
        return None
    if p.dim() != 1 or len(normalized_shape) != 1:
        if tuple(p.shape) != normalized_shape:
            raise RuntimeError(
                f"{module_name}: argument '{arg}' must have shape {normalized_shape} (normalized_shape), "
                f"got {tuple(p.shape)}"
            )
        p = p.reshape(n)
    if p.dtype != x.dtype and p.is_floating_point() and x.is_floating_point():
        p = p.to(x.dtype)
    return p


def _unflat(out: Tensor, flat: Tensor, x: Tensor) -> Tensor:
    """The op's result `out` on `flat` (from :func:`_flat`), shaped like `x`."""
    return out if flat is x else out.reshape(x.shape)


# RMSNorm's default eps by input dtype, as torch resolves ``eps=None``: the
# epsilon of the dtype it computes in (its "opmath" type, pytorch/pytorch#142848,
# torch 2.7 on), float32's for float16 and bfloat16 inputs, not the input dtype's
# (``torch.finfo(torch.bfloat16).eps`` is 0.0078, 65536 times float32's).
# Keel computes in that dtype too (``acc_of``).
_DEFAULT_EPS = {t: torch.finfo(acc_of(t)).eps for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


def _default_eps(x: Tensor) -> float:
    """:class:`RMSNorm`'s eps where it was given None, as torch's (``_DEFAULT_EPS``);
    0.0 for a dtype Keel's ops do not take (the op then refuses the input, naming it)."""
    return _DEFAULT_EPS.get(x.dtype, 0.0)


def _rms_norm_module(
    x: Tensor,
    normalized_shape: tuple,
    weight: Optional[Tensor],
    eps: Optional[float],
    round_before_weight: bool = False,
) -> Tensor:
    """:class:`RMSNorm`'s forward. A function of its own, checked for
    ``__torch_function__`` as torch.nn.functional's are, so that torch.fx
    records the module as one call (the shape and dtype checks here cannot run
    on its proxies) and tensor subclasses and modes see that call."""
    if _has_torch_function(x, weight) and _overridden(x, weight):
        return _handle(_rms_norm_module, (x, weight), x, normalized_shape, weight, eps, round_before_weight)
    flat, n = _flat("keel.nn.RMSNorm", x, normalized_shape, rms_norm)
    w = _param("keel.nn.RMSNorm", "weight", weight, x, normalized_shape, n)
    out = rms_norm(flat, w, _default_eps(x) if eps is None else eps, round_before_weight)
    return _unflat(out, flat, x)


def _layer_norm_module(
    x: Tensor, normalized_shape: tuple, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> Tensor:
    """:class:`LayerNorm`'s forward, a function for the reason given at :func:`_rms_norm_module`."""
    if _has_torch_function(x, weight, bias) and _overridden(x, weight, bias):
        return _handle(_layer_norm_module, (x, weight, bias), x, normalized_shape, weight, bias, eps)
    flat, n = _flat("keel.nn.LayerNorm", x, normalized_shape, layer_norm)
    w = _param("keel.nn.LayerNorm", "weight", weight, x, normalized_shape, n)
    b = _param("keel.nn.LayerNorm", "bias", bias, x, normalized_shape, n)
    out = layer_norm(flat, w, b, eps)
    return _unflat(out, flat, x)


# _LOOKUP: the modules' forwards read their parameters and buffers from the
# module's own ``_parameters`` / ``_buffers`` dict: ``self.weight`` goes through
# ``nn.Module.__getattr__``, a Python function, 0.45 us a lookup ([1, 64]
# LayerNorm under no_grad: 7.0 -> 6.1 us a call, measured). Where the name is
# not in that dict, ``self.weight`` after all: a parametrization's property
# (``torch.nn.utils.parametrize``), or the plain attribute that
# ``torch.nn.utils.weight_norm`` sets. What ``torch.func.functional_call`` and
# FSDP put in its place, they put in that dict.


class RMSNorm(nn.Module):
    """Keel's ``torch.nn.RMSNorm``: same constructor, parameters and state dict.

    ``normalized_shape`` may span several trailing dimensions (they are
    normalised together, as in torch). ``eps=None`` uses the epsilon of the
    dtype torch computes in, as torch does: ``torch.finfo(torch.float32).eps``
    for float32, float16 and bfloat16 inputs, float64's for float64. A weight of another float
    dtype than the input (float32 parameters, bfloat16 activations) is cast to
    the input's dtype, where torch multiplies by it in float32: the results
    agree within the input dtype's rounding.

    ``round_before_weight=True`` (keyword only, Keel's own) rounds ``x / rms``
    to the input's dtype before the weight multiplies it, as Hugging Face's
    ``LlamaRMSNorm`` does: see :func:`keel.rms_norm`.
    """

    # The class's value for modules pickled before the option existed.
    round_before_weight: bool = False

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        round_before_weight: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.round_before_weight = round_before_weight
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters  # see _LOOKUP
        w = p["weight"] if "weight" in p else self.weight
        return _rms_norm_module(x, self.normalized_shape, w, self.eps, self.round_before_weight)

    def extra_repr(self) -> str:
        extra = ", round_before_weight=True" if self.round_before_weight else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{extra}"


def _llama_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:class:`LlamaRMSNorm`'s forward, a function for the reason given at :func:`_rms_norm_module`."""
    if _has_torch_function(x, weight) and _overridden(x, weight):
        return _handle(_llama_rms_norm, (x, weight), x, weight, eps)
    if weight.dtype == x.dtype:
        return rms_norm(x, weight, eps, round_before_weight=True)
    # Hugging Face multiplies the rounded normalised value by a weight of another dtype
    # in torch's promotion of the two (float32 parameters, bfloat16 activations: a
    # float32 result); the op takes one dtype, so the product is torch's.
    return weight * rms_norm(x, None, eps)


class LlamaRMSNorm(nn.Module):
    """Keel's Hugging Face ``LlamaRMSNorm`` (Mistral's, Qwen2's, Qwen3's ... are copies of it):
    the same constructor, ``weight`` parameter, ``variance_epsilon`` and state dict.

    ``weight * (x / rms).to(x.dtype)``, ``x / rms`` in float32 (float64 for float64
    inputs, where Hugging Face computes in float32): :func:`keel.rms_norm` with
    ``round_before_weight=True`` in one pass where the weight has the input's dtype;
    otherwise the normalised value from Keel, times the weight in torch's promotion of
    the two dtypes, as Hugging Face computes it (float32 parameters with bfloat16
    activations give a float32 result). ``keel.nn.convert`` puts it in place of
    Hugging Face's own.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        p = self._parameters  # see _LOOKUP
        w = p["weight"] if "weight" in p else self.weight
        return _llama_rms_norm(hidden_states, w, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class LayerNorm(nn.Module):
    """Keel's ``torch.nn.LayerNorm``: same constructor, parameters and state dict.

    ``normalized_shape`` may span several trailing dimensions (normalised
    together, as in torch); ``bias=False`` or ``elementwise_affine=False`` drop
    the parameters as torch does. Parameters of another float dtype than the
    input are cast to it, as in :class:`RMSNorm`.
    """

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        kw = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **kw))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **kw))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters  # see _LOOKUP
        w = p["weight"] if "weight" in p else self.weight
        b = p["bias"] if "bias" in p else self.bias
        return _layer_norm_module(x, self.normalized_shape, w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class SwiGLU(nn.Module):
    """The SwiGLU feed-forward of Llama-style models, gated by ``keel.silu_and_mul``.

    ``down(silu(gate(x)) * up(x))`` with the gate and up projections fused in one
    ``gate_up_proj`` (``[gate; up]`` stacked, vLLM's layout), so the activation reads
    one ``[..., 2 * hidden]`` tensor. ``SwiGLU.from_linears(gate, up, down)`` converts
    an existing MLP (e.g. a Hugging Face ``LlamaMLP``'s ``gate_proj``, ``up_proj``,
    ``down_proj``) with the same result.

    Tensor parallelism: :class:`keel.nn.GateUpColwiseParallel` on ``gate_up_proj``
    (each rank holds its share of the gate rows and of the up rows) and torch's
    ``RowwiseParallel`` on ``down_proj``. torch's plain ``ColwiseParallel`` on
    ``gate_up_proj`` would give a rank gate rows or up rows only: the forward
    refuses it with a RuntimeError.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: Optional[int] = None,
                 bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.hidden_features = hidden_features
        self.gate_up_proj = nn.Linear(in_features, 2 * hidden_features, bias=bias, **kw)
        self.down_proj = nn.Linear(hidden_features, out_features or in_features, bias=bias, **kw)

    @classmethod
    def from_linears(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> "SwiGLU":
        """A SwiGLU computing ``down(silu(gate(x)) * up(x))`` from those three layers' weights."""
        if gate.weight.shape != up.weight.shape or down.in_features != gate.out_features:
            raise ValueError("keel.nn.SwiGLU.from_linears: gate and up must have the same shape, "
                             "and down must take their output")
        bias = gate.bias is not None
        if (up.bias is not None) != bias or (down.bias is not None) != bias:
            raise ValueError("keel.nn.SwiGLU.from_linears: gate, up and down must all have a bias or none")
        m = cls(gate.in_features, gate.out_features, down.out_features, bias=bias,
                device=gate.weight.device, dtype=gate.weight.dtype)
        with torch.no_grad():
            m.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight], 0))
            m.down_proj.weight.copy_(down.weight)
            if bias:
                m.gate_up_proj.bias.copy_(torch.cat([gate.bias, up.bias], 0))
                m.down_proj.bias.copy_(down.bias)
        return m

    def forward(self, x: Tensor) -> Tensor:
        if _DTENSOR in sys.modules:
            return self._forward_dtensor(x)
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def _forward_dtensor(self, x: Tensor) -> Tensor:
        """The forward where DTensors may be about (tensor parallelism): a fused
        weight sharded on its rows in one piece is refused (each rank would
        hold gate rows or up rows, not both). ``silu_and_mul`` gates the
        DTensor output of :class:`GateUpColwiseParallel`
        (``use_local_output=False``) on each rank."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        weight = self.gate_up_proj.weight
        if isinstance(weight, DTensor):
            for i, p in enumerate(weight.placements):
                # Not GateUpColwiseParallel's _StridedShard (no Shard in torch 2.10-2.15; kept so).
                one_piece = isinstance(p, Shard) and not isinstance(p, _StridedShard)
                if one_piece and p.dim == 0 and weight.device_mesh.size(i) > 1:
                    raise RuntimeError(
                        "keel.nn.SwiGLU: gate_up_proj's weight is sharded on its rows in one piece (torch's "
                        "ColwiseParallel?), so a rank holds gate rows or up rows, not both of a pair, and "
                        "silu_and_mul would multiply the wrong halves; shard it with keel.nn.GateUpColwiseParallel()"
                    )
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class CrossEntropyLoss(nn.Module):
    """Keel's ``torch.nn.CrossEntropyLoss``: ``[N, V]`` logits and ``[N]`` class indices,
    or torch's other layouts (``[V]`` with a 0-dim target; ``[N, V, d1, ...]``, classes in
    dim 1, with ``[N, d1, ...]``), or probabilities (a float target shaped like the
    logits), as :func:`keel.cross_entropy` takes them.

    The same ``ignore_index``, ``reduction`` and ``label_smoothing`` as torch, through
    :func:`keel.cross_entropy` (fused: forward + backward allocate one logits-sized buffer).
    The constructor's signature is torch's. ``weight`` (one float weight per class) is
    kept as a buffer, as torch keeps it (it follows ``.to()`` and is in the
    ``state_dict``), and applied as :func:`keel.cross_entropy`'s ``weight``. Integer
    targets other than int64 raise a RuntimeError naming ``target``; torch's deprecated
    ``size_average`` and ``reduce`` are refused here. For a language model's ``[B, S, V]`` logits, flatten
    (``loss_fn(logits.view(-1, vocab), labels.view(-1))``) or pass
    ``logits.transpose(1, 2)`` as for torch: neither copies the logits.
    """

    def __init__(
        self,
        weight: Optional[Tensor] = None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        if weight is not None and not isinstance(weight, Tensor):
            raise TypeError(f"keel.nn.CrossEntropyLoss: argument 'weight' must be a Tensor or None, got {type(weight).__name__}")
        if size_average is not None or reduce is not None:
            raise ValueError(
                "keel.nn.CrossEntropyLoss: arguments 'size_average' and 'reduce' (deprecated in torch) are not "
                "supported: use 'reduction'"
            )
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(
                f"keel.nn.CrossEntropyLoss: argument 'reduction' must be \"mean\", \"sum\" or \"none\", got {reduction!r}"
            )
        self.register_buffer("weight", weight)
        self.weight: Optional[Tensor]
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        buffers = self._buffers  # see _LOOKUP
        w = buffers["weight"] if "weight" in buffers else self.weight
        return cross_entropy(input, target, self.ignore_index, self.label_smoothing, self.reduction, weight=w)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction}, label_smoothing={self.label_smoothing}"
