"""Typed Python API over ``torch.ops.keel``."""
from typing import Optional, Tuple

import torch
from torch import Tensor


def rms_norm(input: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """RMS normalisation over the last dimension.

    Same result as ``torch.nn.functional.rms_norm(input, (input.shape[-1],), weight, eps)``,
    in one pass over memory, with f32 accumulation (f64 for float64 inputs).

    Args:
        input: ``[..., n]`` float32, float16, bfloat16 (CPU and CUDA) or float64 (CPU).
            Non-contiguous inputs are made contiguous first.
        weight: optional ``[n]`` scale, same dtype and device as ``input``.
        eps: added to the mean square before the square root; finite and >= 0.

    Returns:
        A new tensor shaped like ``input``. Differentiable in ``input`` and ``weight``.
    """
    return torch.ops.keel.rms_norm(input.contiguous(), None if weight is None else weight.contiguous(), eps)


def layer_norm(
    input: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5
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
    return torch.ops.keel.layer_norm(input.contiguous(), _c(weight), _c(bias), eps)


def fused_add_rms_norm(
    input: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6
) -> Tuple[Tensor, Tensor]:
    """``s = input + residual`` and ``rms_norm(s, weight, eps)`` in one pass over memory.

    The pre-norm step of a transformer block. Returns ``(rms_norm(s), s)``, the same as
    ``s = input + residual; (F.rms_norm(s, (n,), weight, eps), s)``: ``s`` is rounded to the
    dtype before it is normalised, as in torch. Unlike vLLM's op it is out of place.

    Args:
        input, residual: ``[..., n]``, same shape, dtype and device.
        weight: optional ``[n]`` scale. eps: finite and >= 0.

    Returns:
        ``(normed, sum)``, both shaped like ``input``. Differentiable in ``input``,
        ``residual`` and ``weight``.
    """
    return torch.ops.keel.fused_add_rms_norm(input.contiguous(), residual.contiguous(), _c(weight), eps)


def silu_and_mul(input: Tensor) -> Tensor:
    """SwiGLU gate: ``silu(input[..., :d]) * input[..., d:]`` for ``input[..., 2d]``.

    The first half is the gate, the second the up projection (vLLM's layout).
    f32 math, one rounding. Differentiable.
    """
    return torch.ops.keel.silu_and_mul(input.contiguous())


def gelu_and_mul(input: Tensor, approximate: str = "none") -> Tensor:
    """GeGLU gate: ``gelu(input[..., :d], approximate) * input[..., d:]`` for ``input[..., 2d]``.

    ``approximate`` is ``"none"`` (exact, erf) or ``"tanh"``, as in ``F.gelu``; anything
    else raises a RuntimeError. f32 math, one rounding. Differentiable.
    """
    return torch.ops.keel.gelu_and_mul(input.contiguous(), approximate)


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()
