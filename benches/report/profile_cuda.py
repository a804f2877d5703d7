"""Where a report case's time goes on CUDA: each contender (Keel, torch eager)
run under torch.profiler, with the wall time per call (between two
synchronisations), the GPU kernels' time per call, and each kernel's share.
A wall time well above the kernels' time means the call is bound by the CPU
(Python, the dispatcher, autograd), not by the GPU; for such calls it also
prints where the CPU time goes:

- for a forward + backward case, the time for the forward call and for the
  backward call to return (no synchronisation between them: the CPU's time,
  unless something inside waits for the GPU);
- the profiler's CPU events with the most self time per call (a
  `cudaStreamSynchronize`, `cudaMalloc` or Python autograd node stands out).

    python benches/report/profile_cuda.py [--ops "layer_norm fwd+bwd,softmax fwd+bwd"] [--dtypes bfloat16]

`--device cpu` runs the same on CPU tensors (no kernel times there): a check of
the script without a GPU, and the CPU-side cost of the same Python path.
"""
import argparse
import functools
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cases import make_cases
from measure import DTYPES
from timing import device_kernels, per_call


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kernels_us(fn, iters: int, device: str) -> tuple:
    """(total GPU kernel µs per call, [(kernel, µs per call)] longest first,
    [(CPU event, self µs per call, calls per call)] most self time first)."""
    fn()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        _sync(device)
    rows = device_kernels(prof, iters)
    cpu = [(a.key, a.self_cpu_time_total / iters, a.count / iters) for a in prof.key_averages()]
    cpu.sort(key=lambda r: -r[1])
    return sum(us for _, us in rows), rows, cpu


def phases_us(case, op, device: str, iters: int) -> tuple:
    """(forward µs, backward µs) per call of a forward + backward case: the
    time each call takes to return, best of three rounds of `iters`, with one
    synchronisation before each round and none between the calls."""
    best = [float("inf"), float("inf")]
    for _ in range(3):
        spent = [0.0, 0.0]
        _sync(device)
        for _ in range(iters):
            args = case.leaves()
            t0 = time.perf_counter()
            out = op(*args)
            t1 = time.perf_counter()
            case.backward_of(out)
            t2 = time.perf_counter()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
        _sync(device)
        best = [min(b, s / iters * 1e6) for b, s in zip(best, spent)]
    return tuple(best)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="rms_norm fwd+bwd,layer_norm fwd+bwd,fused_add_rms_norm fwd+bwd,"
                                     "softmax fwd+bwd,cross_entropy fwd+bwd,rms_norm,softmax")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--size", default="large", help="the cases' size (cases.make_cases)")
    ap.add_argument("--cpu-events", type=int, default=10, help="CPU events printed per contender")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("profile_cuda: torch finds no CUDA device")
    names = [n for n in a.ops.split(",") if n]
    for dname in a.dtypes.split(","):
        for case in make_cases(a.device, DTYPES[dname], a.size, names):
            for who, op in (("keel", case.keel), ("eager", case.torch)):
                fn = functools.partial(case.run, op)
                # Best of three rounds of `iters` calls between two synchronisations.
                wall = per_call(fn, a.device, calls=a.iters, rounds=3) * 1e6
                gpu, rows, cpu = kernels_us(fn, a.iters, a.device)
                print(f"{case.name} {dname} {case.shape} {who}: wall {wall:.1f} us/call, kernels {gpu:.1f} us/call")
                for name, us in rows[:8]:
                    print(f"    {us:8.1f} us  {name[:110]}")
                if case.backward:
                    fwd, bwd = phases_us(case, op, a.device, a.iters)
                    print(f"    CPU: forward call {fwd:.1f} us, backward call {bwd:.1f} us")
                for name, us, calls in cpu[: a.cpu_events]:
                    print(f"    CPU self {us:8.1f} us  x{calls:<5.2g} {name[:100]}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
