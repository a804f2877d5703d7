"""``python -m keel``: what Keel runs on here, and a self-check of every op.

Prints the versions (Keel, its library, torch, CUDA, Python), the CPU and the SIMD
level Keel's CPU kernels run at, the GPUs torch sees, and then checks each op's
forward and gradients against torch's own ops run in float64, on every device torch
offers (CPU, and CUDA where a GPU is usable), in float32, float16 and bfloat16; the in-place
ops against their out-of-place forms, bit for bit. Exits 1 where a check fails, so
that the output is worth pasting into a bug report, and the exit status worth a
script's test.
"""
import argparse
import os
import platform
import sys
import sysconfig
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import keel

# The largest error a check allows, relative to the largest magnitude of the
# float64 result it is held to: a few units in the last place of the dtype, beside
# the float32 accumulation's rounding over rows of 256.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

ROWS, COLS = 8, 256


class Case(NamedTuple):
    """One op's check: its inputs in float64 (drawn from a generator; rounded
    to the checked dtype by :func:`check`), Keel's call, torch's float64
    reference of the same, and which inputs take a gradient."""

    name: str
    inputs: Callable[[torch.Generator], Tuple]
    keel: Callable
    torch: Callable
    grads: Sequence[int]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _norm_inputs(gen):
    return (_randn(gen, ROWS, COLS), 1 + 0.1 * _randn(gen, COLS))


def _fused_inputs(gen):
    return (_randn(gen, ROWS, COLS), *_norm_inputs(gen))


def _rms_norm_ref(x, w):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w


def _rope_inputs(gen):
    seq, heads, dim = 4, 2, 64
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), 10000.0 ** -(torch.arange(0, dim, 2) / dim))
    return (_randn(gen, 1, seq, heads, dim), angles.cos(), angles.sin())


def _rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((a * c - b * s, b * c + a * s), -1)


def _ce_inputs(gen):
    target = torch.randint(0, COLS, (ROWS,), generator=gen)
    target[1] = -100  # an ignored row
    return (3 * _randn(gen, ROWS, COLS), target)


CASES = (
    Case("rms_norm", _norm_inputs, lambda x, w: keel.rms_norm(x, w, 1e-6), _rms_norm_ref, (0, 1)),
    Case("layer_norm", lambda g: (*_norm_inputs(g), 0.1 * _randn(g, COLS)),
         lambda x, w, b: keel.layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (COLS,), w, b, 1e-5),
         (0, 1, 2)),
    Case("fused_add_rms_norm", _fused_inputs,
         lambda x, r, w: keel.fused_add_rms_norm(x, r, w, 1e-6),
         lambda x, r, w: (_rms_norm_ref(x + r, w), x + r), (0, 1, 2)),
    Case("silu_and_mul", lambda g: (_randn(g, ROWS, 2 * COLS),), keel.silu_and_mul,
         lambda h: F.silu(h[..., :COLS]) * h[..., COLS:], (0,)),
    Case("gelu_and_mul", lambda g: (_randn(g, ROWS, 2 * COLS),), lambda h: keel.gelu_and_mul(h, "tanh"),
         lambda h: F.gelu(h[..., :COLS], approximate="tanh") * h[..., COLS:], (0,)),
    Case("softmax", lambda g: (4 * _randn(g, ROWS, COLS),), lambda x: keel.softmax(x, 0.125),
         lambda x: torch.softmax(x * 0.125, -1), (0,)),
    Case("cross_entropy", _ce_inputs, lambda x, t: keel.cross_entropy(x, t, label_smoothing=0.1),
         lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), (0,)),
    Case("rotary_embedding", _rope_inputs, keel.rotary_embedding, _rope_ref, (0,)),
)


def _as_tuple(out) -> Tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _rel_err(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """The largest error of `got` over all its tensors, relative to the largest
    magnitude of `want` (inf where a shape differs or a value is not finite)."""
    worst = 0.0
    for g, w in zip(got, want):
        if g is None or g.shape != w.shape:
            return float("inf")
        scale = w.abs().max().item() or 1.0
        err = (g.double().cpu() - w.cpu()).abs().max().item() / scale
        worst = max(worst, err if err == err else float("inf"))
    return worst


def check(case: Case, dtype: torch.dtype, device: str) -> float:
    """The largest relative error of Keel's forward outputs and gradients
    against torch's float64 reference, on inputs rounded to `dtype` first."""
    gen = torch.Generator().manual_seed(0)
    raw = case.inputs(gen)
    # The same rounded values for both: the dtype's rounding of the inputs is not Keel's error.
    rounded = [t.to(dtype) if t.is_floating_point() else t for t in raw]
    mine = [t.to(device, copy=True).requires_grad_(i in case.grads) for i, t in enumerate(rounded)]
    ref = [t.to(torch.float64, copy=True).requires_grad_(i in case.grads) if t.is_floating_point() else t
           for i, t in enumerate(rounded)]
    out, want = _as_tuple(case.keel(*mine)), _as_tuple(case.torch(*ref))
    err = _rel_err(out, want)
    # Gradients from one fixed cotangent per output.
    cot = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    torch.autograd.backward(out, [c.to(dtype).to(device) for c in cot])
    torch.autograd.backward(want, [c.to(dtype).double() for c in cot])
    return max(err, _rel_err([mine[i].grad for i in case.grads], [ref[i].grad for i in case.grads]))


def check_inplace(dtype: torch.dtype, device: str) -> List[Tuple[str, bool]]:
    """Whether each in-place op gives its out-of-place form's bits."""
    gen = torch.Generator().manual_seed(1)
    x, r, w = (t.to(dtype).to(device) for t in _fused_inputs(gen))
    want_y, want_s = keel.fused_add_rms_norm(x, r, w, 1e-6)
    keel.fused_add_rms_norm_(x, r, w, 1e-6)
    fused = torch.equal(x, want_y) and torch.equal(r, want_s)
    q, cos, sin = (t.to(dtype).to(device) for t in _rope_inputs(gen))
    want_q = keel.rotary_embedding(q, cos, sin)
    keel.rotary_embedding_(q, cos, sin)
    return [("fused_add_rms_norm_", fused), ("rotary_embedding_", torch.equal(q, want_q))]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def python_build(version: str, free_threaded_build: bool, gil_enabled: bool) -> str:
    """``Python X.Y.Z``, and on a free-threaded build whether the GIL is off (an
    extension module that needs it turns it back on at import)."""
    if not free_threaded_build:
        return f"Python {version}"
    return f"Python {version} free-threaded (GIL {'enabled' if gil_enabled else 'disabled'})"


def _python() -> str:
    """`python_build` of the running interpreter."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return python_build(platform.python_version(), bool(sysconfig.get_config_var("Py_GIL_DISABLED")), gil)


def devices() -> List[str]:
    """The devices to check: the CPU, and CUDA where torch can use a GPU."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def describe() -> List[str]:
    """The lines that say what Keel runs on here."""
    env = os.environ.get("KEEL_CPU_CAPABILITY")
    lines = [
        f"keel {keel.__version__}: {keel.LIBRARY_PATH}",
        f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}), "
        f"{_python()}, {platform.system()} {platform.machine()}",
        f"CPU: {_cpu_name()}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}; "
        f"Keel's CPU kernels: {keel.cpu_capability()}"
        + (f" (KEEL_CPU_CAPABILITY={env})" if env else ""),
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"CUDA device {i}: {p.name}, compute capability {p.major}.{p.minor}, "
                         f"{p.total_memory / 2**30:.0f} GiB")
    else:
        lines.append("CUDA: not used (torch.cuda.is_available() is False)")
    checks = os.environ.get("KEEL_CUDA_TARGET_CHECKS")
    lines.append(f"cross_entropy's CUDA target check: {'on' if keel.cuda_target_checks() else 'off'}"
                 + (f" (KEEL_CUDA_TARGET_CHECKS={checks})" if checks else ""))
    return lines


def self_check(on: Sequence[str]) -> Tuple[List[str], bool]:
    """One line per op, dtype and device of `on`, and whether all passed. A check
    that raises fails with the error's first line."""
    lines, ok = [], True
    for device in on:
        for dtype in DTYPES:
            tag = f"{device} {str(dtype).replace('torch.', '')}"
            for case in CASES:
                try:
                    err = check(case, dtype, device)
                    good = err <= TOLERANCE[dtype]
                    lines.append(f"{'ok  ' if good else 'FAIL'} {tag} {case.name}: error {err:.1e} "
                                 f"(tolerance {TOLERANCE[dtype]:.1e}), forward and gradients")
                except Exception as e:  # noqa: BLE001 - reported as the op's failure
                    good = False
                    lines.append(f"FAIL {tag} {case.name}: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
                ok &= good
            try:
                results = check_inplace(dtype, device)
            except Exception as e:  # noqa: BLE001 - reported as the op's failure
                results = [(f"in-place ops ({type(e).__name__}: {str(e).strip().splitlines()[0]})", False)]
            for name, good in results:
                lines.append(f"{'ok  ' if good else 'FAIL'} {tag} {name}: "
                             f"{'the out-of-place bits' if good else 'differs from the out-of-place op'}")
                ok &= good
    return lines, ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keel", description=__doc__.splitlines()[0])
    parser.add_argument("--no-check", action="store_true", help="print the environment only")
    args = parser.parse_args(argv)
    for line in describe():
        print(line)
    if args.no_check:
        return 0
    on = devices()
    lines, ok = self_check(on)
    print(f"self-check on {', '.join(on)}:")
    for line in lines:
        print("  " + line)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
