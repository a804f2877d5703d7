"""Typed Python API over ``torch.ops.keel``."""
from typing import Optional

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
