"""Keel: fused GPU and CPU kernels for PyTorch, written in Rust against torch's
stable C ABI, so one wheel serves every torch from 2.10 on.

Ops live in ``torch.ops.keel.*``; typed wrappers here (``keel.rms_norm``,
``keel.layer_norm``, ``keel.fused_add_rms_norm`` (and ``keel.fused_add_rms_norm_``, in place), ``keel.silu_and_mul``,
``keel.gelu_and_mul``, ``keel.softmax``, ``keel.cross_entropy``, ``keel.cross_entropy_with_lse``,
``keel.rotary_embedding``, and ``keel.rotary_embedding_`` in place) and drop-in modules in ``keel.nn``.
All ops have CPU/CUDA/Meta kernels and work under ``torch.compile``; all but the in-place
ones (names ending in ``_``, for inference) have autograd. ``python -m keel`` prints what
Keel runs on and checks every op against torch (``keel._info``).
"""
from . import _load

LIBRARY_PATH = _load.load()

from . import _capability  # noqa: E402


def cpu_capability() -> str:
    """The SIMD level Keel's CPU kernels run at in this process.

    ``"avx512"`` (16-lane AVX-512 with AVX512-BF16), ``"avx2"`` (8-lane AVX2 with FMA
    and F16C) or ``"default"`` (no explicit SIMD: the portable loops). That is the
    CPU's best, lowered to the level the environment variable ``KEEL_CPU_CAPABILITY``
    names (``default``, ``avx2`` or ``avx512``, the names of torch's
    ``ATEN_CPU_CAPABILITY``; it never raises the level). The variable is read once per
    process, at the first CPU kernel call or at this function's first call, whichever
    comes first: set it before starting Python. An unknown value is reported on stderr
    and ignored. On other CPUs than x86-64, ``"default"``.
    """
    return _capability.cpu_capability(LIBRARY_PATH)


from . import _target_checks  # noqa: E402


def set_cuda_target_checks(enabled: bool) -> bool:
    """Turns cross_entropy's check of class targets on CUDA on (the default) or off,
    for the whole process; returns whether it was on.

    The check raises a RuntimeError naming ``target`` where a class index is out of
    range and not ``ignore_index``. It reads a count back from the GPU, so each
    forward waits for the work queued on its stream: the host cannot queue the next
    step's kernels while the GPU runs this one's (``keel.cross_entropy``'s backward,
    given the forward's log-sum-exp, does not check again). Off, nothing is read back
    and nothing waits, and a bad target gives its row a NaN loss (so a ``"mean"`` or
    ``"sum"`` is NaN) and a NaN gradient instead of the error, as during CUDA graph
    capture, where the check cannot run. CPU kernels check either way (no wait), and
    probability targets have nothing to check. On at the start of a process, unless
    the environment variable ``KEEL_CUDA_TARGET_CHECKS`` is ``0`` (``1`` or unset: on;
    another value is reported on stderr and ignored). Not traced by ``torch.compile``:
    call it outside compiled code.
    """
    return _target_checks.set_checks(LIBRARY_PATH, enabled)


def cuda_target_checks() -> bool:
    """Whether cross_entropy checks class targets on CUDA (``set_cuda_target_checks``)."""
    return _target_checks.checks(LIBRARY_PATH)


from . import _autograd  # noqa: E402

_autograd.register()

from . import _inplace  # noqa: E402

_inplace.register()

from . import _fake  # noqa: E402

_fake.register()

from . import _autocast  # noqa: E402

_autocast.register()

from . import _vmap  # noqa: E402

_vmap.register()

from . import _dtensor  # noqa: E402

_dtensor.register()

from . import nn  # noqa: E402
from .functional import (  # noqa: E402
    cross_entropy,
    cross_entropy_with_lse,
    fused_add_rms_norm,
    fused_add_rms_norm_,
    gelu_and_mul,
    layer_norm,
    rms_norm,
    rotary_embedding,
    rotary_embedding_,
    silu_and_mul,
    softmax,
)

__version__ = "0.1.0"
__all__ = [
    "rms_norm",
    "layer_norm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_",
    "silu_and_mul",
    "gelu_and_mul",
    "softmax",
    "cross_entropy",
    "cross_entropy_with_lse",
    "rotary_embedding",
    "rotary_embedding_",
    "nn",
    "cpu_capability",
    "set_cuda_target_checks",
    "cuda_target_checks",
    "LIBRARY_PATH",
]
