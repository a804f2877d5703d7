"""``keel.set_cuda_target_checks`` and ``keel.cuda_target_checks``: cross_entropy's
CUDA check of class targets, on or off."""
import ctypes

from . import _load


def _call(path: str, name: str, *args) -> bool:
    """The library's ``keel_<name>`` on ``args`` (ints): 1 on, 0 off, -1 failed."""
    fn = _load.c_function(path, f"keel_{name}", (ctypes.c_int,) * len(args), ctypes.c_int)
    v = fn(*args)
    if v < 0:
        raise RuntimeError(f"keel.{name}: the library could not tell the check's state")
    return bool(v)


def set_checks(path: str, enabled: bool) -> bool:
    """Sets the check of the library at ``path``; returns whether it was on."""
    if not isinstance(enabled, bool):
        raise TypeError(f"keel.set_cuda_target_checks: enabled must be a bool, got {type(enabled).__name__}")
    return _call(path, "set_cuda_target_checks", int(enabled))


def checks(path: str) -> bool:
    """Whether the check of the library at ``path`` is on."""
    return _call(path, "cuda_target_checks")
