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
    import importlib.metadata
    import os

    assert os.path.basename(keel.LIBRARY_PATH) == "_C.so", keel.LIBRARY_PATH
    wheel = importlib.metadata.distribution("keel").read_text("WHEEL")
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    assert tags and all(t.startswith("py3-none-") for t in tags), tags


def test_package_is_marked_typed():
    """PEP 561: the installed package carries py.typed, so type checkers read the
    typed API's annotations."""
    import os

    assert os.path.isfile(os.path.join(os.path.dirname(keel.__file__), "py.typed"))
