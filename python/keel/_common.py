"""Two conventions of Keel's ops that its Python layers share: the accumulation
dtype, and one device for all tensor arguments."""
import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Keel's accumulation dtype for `t`: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def one_device(name, named):
    """The device of the tensor arguments (`named`: (name, value) pairs); raises,
    as the real kernels do, where they differ (used where the Meta kernel sees
    only meta stand-ins)."""
    tensors = [(n, v) for n, v in named if isinstance(v, torch.Tensor)]
    first, device = tensors[0][0], tensors[0][1].device
    for n, t in tensors[1:]:
        if t.device != device:
            raise RuntimeError(f"keel::{name}: argument '{n}' is on {t.device} but '{first}' is on {device}")
    return device
