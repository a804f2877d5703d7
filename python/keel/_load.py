"""Loads Keel's native library into torch and checks the torch version."""
import ctypes
import functools
import glob
import os
import re

import torch

MIN_TORCH = (2, 10)


def parse_version(v: str) -> tuple:
    """(major, minor) of a torch version string such as '2.15.0+cu130'."""
    m = re.match(r"(\d+)\.(\d+)", v)
    if not m:
        raise ImportError(f"keel: cannot parse the torch version {v!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(v: str) -> None:
    """Raises ImportError when torch is older than the stable ABI Keel needs."""
    if parse_version(v) < MIN_TORCH:
        raise ImportError(
            f"keel needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (its stable C ABI); "
            f"this is torch {v}. Upgrade torch: pip install 'torch>=2.10'"
        )


def load() -> str:
    """Loads the library once; returns its path."""
    check_torch_version(torch.__version__)
    here = os.path.dirname(os.path.abspath(__file__))
    # `_C.so` since session 72; an older build named it `_C.abi3.so`, which a
    # stray copy could leave beside it (and which sorts first).
    exact = os.path.join(here, "_C.so")
    libs = [exact] if os.path.isfile(exact) else sorted(glob.glob(os.path.join(here, "_C*.so")))
    if not libs:
        raise ImportError(f"keel: native library _C*.so not found in {here}; reinstall keel")
    torch.ops.load_library(libs[0])
    if not hasattr(torch.ops.keel, "rms_norm"):
        raise ImportError(
            f"keel: {libs[0]} loaded but registered no ops (its reason was printed to stderr above)"
        )
    return libs[0]


@functools.lru_cache(maxsize=None)
def c_function(path: str, name: str, argtypes: tuple, restype):
    """The plain C function ``name`` that the library at ``path`` exports (one an op
    cannot be: it takes no tensor to dispatch on), through ctypes: the library torch
    loaded already, so the same process state."""
    fn = getattr(ctypes.CDLL(path), name)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn
