"""``keel.set_cuda_target_checks`` and ``keel.cuda_target_checks``: cross_entropy's
CUDA check of class targets, on or off."""
import ctypes
import functools


@functools.lru_cache(maxsize=None)
def _exports(path: str):
    """The library's ``keel_set_cuda_target_checks`` and ``keel_cuda_target_checks``
    (plain C functions), through ctypes: the library torch loaded already, so the
    same process state."""
    lib = ctypes.CDLL(path)
    setter, getter = lib.keel_set_cuda_target_checks, lib.keel_cuda_target_checks
    setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
    getter.argtypes, getter.restype = [], ctypes.c_int
    return setter, getter


def _result(name: str, v: int) -> bool:
    if v < 0:
        raise RuntimeError(f"keel.{name}: the library could not tell the check's state")
    return bool(v)


def set_checks(path: str, enabled: bool) -> bool:
    """Sets the check of the library at ``path``; returns whether it was on."""
    if not isinstance(enabled, bool):
        raise TypeError(f"keel.set_cuda_target_checks: enabled must be a bool, got {type(enabled).__name__}")
    return _result("set_cuda_target_checks", _exports(path)[0](int(enabled)))


def checks(path: str) -> bool:
    """Whether the check of the library at ``path`` is on."""
    return _result("cuda_target_checks", _exports(path)[1]())
