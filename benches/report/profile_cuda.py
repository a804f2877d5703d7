"""Where a report case's time goes on CUDA: each contender (Keel, torch eager)
run under torch.profiler, with the wall time per call (between two
synchronisations), the GPU kernels' time per call, and each kernel's share.
A wall time well above the kernels' time means the call is bound by the CPU
(Python, the dispatcher, autograd), not by the GPU.

    python benches/report/profile_cuda.py [--ops "layer_norm fwd+bwd,softmax fwd+bwd"] [--dtypes bfloat16]
"""
import argparse
import functools
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cases import make_cases
from measure import DTYPES
from timing import per_call


def kernels_us(fn, iters: int) -> tuple:
    """(total GPU kernel µs per call, [(kernel, µs per call)] longest first)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / iters
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    return sum(per.values()), rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="rms_norm fwd+bwd,layer_norm fwd+bwd,fused_add_rms_norm fwd+bwd,"
                                     "softmax fwd+bwd,cross_entropy fwd+bwd,rms_norm,softmax")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_cuda: torch finds no CUDA device")
    names = [n for n in a.ops.split(",") if n]
    for dname in a.dtypes.split(","):
        for case in make_cases("cuda", DTYPES[dname], "large", names):
            for who, op in (("keel", case.keel), ("eager", case.torch)):
                fn = functools.partial(case.run, op)
                # Best of three rounds of `iters` calls between two synchronisations.
                wall = per_call(fn, "cuda", calls=a.iters, rounds=3) * 1e6
                gpu, rows = kernels_us(fn, a.iters)
                print(f"{case.name} {dname} {case.shape} {who}: wall {wall:.1f} us/call, kernels {gpu:.1f} us/call")
                for name, us in rows[:8]:
                    print(f"    {us:8.1f} us  {name[:110]}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
