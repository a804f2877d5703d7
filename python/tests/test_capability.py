"""`keel.cpu_capability()` and `KEEL_CPU_CAPABILITY`: the level reported is the CPU's
best lowered to the variable's cap, each level computes what torch does, and an
unknown value is reported and ignored.

Each level runs in a fresh process (the variable is read once per process).
`scripts/test.sh` also runs the op tests under `avx2` and `default`.
"""
import os
import platform
import subprocess
import sys

import pytest
import torch

import keel
from keel._capability import LEVELS

X86 = platform.machine() in ("x86_64", "AMD64")

# Each level's results against torch's, in a fresh process: rms_norm, layer_norm
# (forward and backward), softmax and silu_and_mul on rows long enough for every
# vector path and its tail, in each dtype. Prints the level, then the worst error
# relative to the tolerance (<= 1 passes).
PROBE = r"""
import torch, keel
level = keel.cpu_capability()
torch.manual_seed(0)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
worst = 0.0
def check(name, got, want, dtype):
    global worst
    scale = want.double().abs().max().clamp_min(1.0)
    err = ((got.double() - want.double()).abs().max() / scale).item()
    worst = max(worst, err / TOL[dtype])
    if err > TOL[dtype]:
        print("MISMATCH", name, dtype, err)
for dtype in TOL:
    for rows, cols in ((5, 4096), (3, 1000), (2, 37)):
        x = (torch.randn(rows, cols) * 2 + 0.5).to(dtype)
        w = (torch.rand(cols) + 0.5).to(dtype)
        b = torch.randn(cols).to(dtype)
        ref = lambda f, *a: f(*[t.double() for t in a]).to(dtype)
        check("rms_norm", keel.rms_norm(x, w, 1e-6), ref(lambda x, w: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6), x, w), dtype)
        check("softmax", keel.softmax(x), ref(lambda x: torch.softmax(x, -1), x), dtype)
        gate = torch.cat([x, x.flip(-1)], -1)
        check("silu_and_mul", keel.silu_and_mul(gate), ref(lambda g: torch.nn.functional.silu(g[:, :cols]) * g[:, cols:], gate), dtype)
        xg = x.clone().requires_grad_()
        y = keel.layer_norm(xg, w, b, 1e-5)
        gy = torch.randn(rows, cols).to(dtype)
        (gx,) = torch.autograd.grad(y, xg, gy)
        xd = x.double().requires_grad_()
        yd = torch.nn.functional.layer_norm(xd, (cols,), w.double(), b.double(), 1e-5)
        (gxd,) = torch.autograd.grad(yd, xd, gy.double())
        check("layer_norm", y.detach(), yd.detach().to(dtype), dtype)
        check("layer_norm backward", gx, gxd.to(dtype), dtype)
print(level)
print(worst)
"""


def _run(cap):
    """(level, worst error / tolerance, stderr) of PROBE with KEEL_CPU_CAPABILITY=cap
    (None: unset)."""
    env = dict(os.environ)
    env.pop("KEEL_CPU_CAPABILITY", None)
    if cap is not None:
        env["KEEL_CPU_CAPABILITY"] = cap
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    assert "MISMATCH" not in out.stdout, out.stdout
    return lines[-2], float(lines[-1]), out.stderr


@pytest.fixture(scope="module")
def best():
    """The level with no cap: the CPU's best."""
    level, worst, err = _run(None)
    assert worst <= 1.0
    assert "KEEL_CPU_CAPABILITY" not in err, err
    return level


def test_the_best_level_fits_the_cpu(best):
    assert best in LEVELS
    if not X86:
        assert best == "default"
        return
    with open("/proc/cpuinfo") as f:
        flags = set(next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "").split())
    # Necessary conditions only: a VM may hide a feature that pulp also asks for.
    if not {"avx2", "fma", "f16c"} <= flags:
        assert best == "default", flags
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        assert best != "avx512", flags


@pytest.mark.parametrize("cap", LEVELS)
def test_each_cap_lowers_the_level_and_keeps_the_values(best, cap):
    level, worst, err = _run(cap)
    assert level == min(best, cap, key=LEVELS.index), (best, cap, level)
    assert worst <= 1.0, (cap, worst)
    assert "KEEL_CPU_CAPABILITY" not in err, err
    if X86 and cap != "avx512":
        print(f"KEEL_CPU_CAPABILITY={cap}: ran {level} (best {best}); worst error {worst:.3g} of the tolerance")


@pytest.mark.parametrize("cap", [" AVX2 ", "sse4", ""])
def test_case_blanks_and_unknown_values(best, cap):
    level, worst, err = _run(cap)
    assert worst <= 1.0
    if cap.strip() == "":
        assert level == best and "KEEL_CPU_CAPABILITY" not in err, err
    elif cap == "sse4":
        assert level == best
        assert "KEEL_CPU_CAPABILITY=sse4 is not one of default, avx2, avx512; ignored" in err, err
    else:
        assert level == min(best, "avx2", key=LEVELS.index)


def test_in_process_level_matches_the_variable():
    """This process's own level: under the cap this run of the tests set, if any."""
    level = keel.cpu_capability()
    assert level in LEVELS
    cap = os.environ.get("KEEL_CPU_CAPABILITY", "").strip().lower()
    if cap in LEVELS:
        assert LEVELS.index(level) <= LEVELS.index(cap)
    # The ops run at that level here too: one call, against torch.
    x = torch.randn(4, 300)
    torch.testing.assert_close(keel.softmax(x), torch.softmax(x, -1))
