"""``keel.cpu_capability()``: which SIMD level Keel's CPU kernels run at."""
import ctypes
import functools

LEVELS = ("default", "avx2", "avx512")


@functools.lru_cache(maxsize=None)
def _export(path: str):
    """The library's ``keel_cpu_capability`` (a plain C function), through ctypes:
    the library torch loaded already, so the same process state."""
    fn = ctypes.CDLL(path).keel_cpu_capability
    fn.argtypes = []
    fn.restype = ctypes.c_char_p
    return fn


def cpu_capability(path: str) -> str:
    """The level of the library at ``path`` (see ``keel.cpu_capability``)."""
    name = _export(path)()
    if name is None:
        raise RuntimeError("keel.cpu_capability: the library could not tell its SIMD level")
    return name.decode()
