"""Drop-in modules built on Keel's ops."""
import numbers
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..functional import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Keel's ``torch.nn.RMSNorm``: same constructor, parameters and state dict.

    ``normalized_shape`` may span several trailing dimensions (they are
    normalised together, as in torch). ``eps=None`` uses
    ``torch.finfo(input.dtype).eps``, as torch does.
    """

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - k:]) != self.normalized_shape:
            raise RuntimeError(
                f"keel.nn.RMSNorm: input of shape {tuple(x.shape)} does not end in normalized_shape {self.normalized_shape}"
            )
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        n = 1
        for s in self.normalized_shape:
            n *= s
        w = None if self.weight is None else self.weight.reshape(n)
        return rms_norm(x.reshape(*x.shape[: x.dim() - k], n), w, eps).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
