"""The stable-ABI layer: every argument kind crosses the dispatcher intact,
and ops are registered for the three dispatch keys."""
import torch

import keel

A = torch.empty(0)  # the anchor tensor the dispatcher picks the CPU kernel from


def test_every_argument_kind_is_unboxed():
    vals, typed = torch.ops.keel._abi_selftest(A, torch.ones(3, 4), -7, 2.5, True, "héllo", [4, -2, 9], torch.bfloat16)
    s = "héllo".encode()
    expected = [12, -7, 2.5, 1, len(s), sum(s), 4, -2, 9]
    assert vals.dtype == torch.float64 and vals.tolist() == expected
    assert typed.dtype == torch.bfloat16 and typed.shape == (0,)


def test_none_false_and_empty_list():
    vals, typed = torch.ops.keel._abi_selftest(A, None, 0, -0.0, False, "", [], torch.float16)
    assert vals.tolist() == [-1, 0, 0.0, 0, 0, 0]
    assert typed.dtype == torch.float16


def test_many_calls_do_not_leak_optional_arguments():
    t = torch.ones(2)
    import sys

    before = sys.getrefcount(t)
    for _ in range(1000):
        torch.ops.keel._abi_selftest(A, t, 1, 1.0, True, "x", [1, 2], torch.float32)
    assert sys.getrefcount(t) == before


def test_kernels_registered_for_cpu_cuda_and_meta():
    for op in ("rms_norm", "rms_norm_backward"):
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"keel::{op}", key), (op, key)


def test_library_is_the_wheels_one_build_for_every_python():
    """The wheel names no Python ABI (setup.py): tagged ``py3-none-<platform>``, so
    pip offers it to every CPython, free-threaded builds included, and its library
    is ``keel/_C.so``, no one interpreter's extension module."""
    import os

    assert os.path.basename(keel.LIBRARY_PATH) == "_C.so", keel.LIBRARY_PATH
    tags = _wheel_tags()
    assert tags and all(t.startswith("py3-none-") for t in tags), tags


def _wheel_tags():
    import importlib.metadata

    wheel = importlib.metadata.distribution("keel").read_text("WHEEL")
    return [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]


# The libraries a manylinux library may ask for that Keel's can: glibc's and libgcc_s
# (PEP 600's policies list these among those every such system has).
_MANYLINUX_LIBS = {
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


def test_library_keeps_the_wheels_manylinux_promise():
    """A wheel tagged ``manylinux_2_N`` (build_wheel) holds a library that asks for
    no glibc symbol newer than 2.N and no library outside glibc and libgcc_s, and
    that unwinds with the process's libgcc_s: zig's own unwinder, linked in, was
    handed torch's C++ exception on the first error an op raised and crashed."""
    import re
    import shutil
    import subprocess

    import pytest

    platform = _wheel_tags()[0].split("-")[2]
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", platform)
    if not m:
        pytest.skip(f"the wheel is tagged {platform}: a local build, for this machine's glibc")
    if shutil.which("readelf") is None:
        pytest.skip("no readelf (binutils) here to read the library with")
    floor = (int(m[1]), int(m[2]))

    def readelf(*args):
        return subprocess.run(["readelf", "-W", *args, keel.LIBRARY_PATH], capture_output=True, text=True, check=True).stdout

    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]", readelf("-d")))
    assert needed and needed <= _MANYLINUX_LIBS, needed
    glibc = {tuple(int(p) for p in v.split(".")[:2]) for v in re.findall(r"Name: GLIBC_([\d.]+)", readelf("-V"))}
    assert glibc and max(glibc) <= floor, (sorted(glibc)[-3:], platform)
    assert "libgcc_s.so.1" in needed
    assert re.search(r"\bUND _Unwind_RaiseException@", readelf("--dyn-syms")), "the library carries its own unwinder"


def test_package_is_marked_typed():
    """PEP 561: the installed package carries py.typed, so type checkers read the
    typed API's annotations."""
    import os

    assert os.path.isfile(os.path.join(os.path.dirname(keel.__file__), "py.typed"))


def test_installed_distribution_carries_its_license():
    """The wheel names its license (Apache-2.0, as Cargo.toml) and carries the
    text, which the license asks of every copy."""
    import importlib.metadata

    dist = importlib.metadata.distribution("keel")
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    files = [f for f in dist.files or () if f.name == "LICENSE"]
    assert len(files) == 1, dist.files
    text = files[0].read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
