"""``keel.cpu_capability()``: which SIMD level Keel's CPU kernels run at."""
import ctypes

from . import _load

LEVELS = ("default", "avx2", "avx512")


def cpu_capability(path: str) -> str:
    """The level of the library at ``path`` (see ``keel.cpu_capability``)."""
    name = _load.c_function(path, "keel_cpu_capability", (), ctypes.c_char_p)()
    if name is None:
        raise RuntimeError("keel.cpu_capability: the library could not tell its SIMD level")
    return name.decode()
