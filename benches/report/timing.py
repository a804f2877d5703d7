"""Interleaved timing: every contender of a case is run in turn (a, b, c, a,
b, c, ...) and each one's median is kept, so that ratios compare like with
like under the same machine load. On CUDA each sample is a batch of calls
between two synchronisations, sized to last at least a millisecond, so the
synchronisation does not dominate short kernels.
"""
import argparse
import resource
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple


def _sync(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def _once(fn: Callable, sync: Callable, inner: int) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter() - t) / inner


def _minor_faults() -> int:
    """This process's minor page faults so far (all threads): one per fresh
    page a store touches first (4 KiB, or 2 MiB on a huge page)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rounds(fns: Dict[str, Callable], device: str = "cpu", budget_s: float = 1.5, min_reps: int = 5,
           max_reps: int = 41, start: int = 0) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """Seconds per call of each function, and its minor page faults per call,
    sampled in interleaved rounds: ({name: [s, ...]}, {name: [faults, ...]}).

    The number of rounds fits `budget_s` (within [min_reps, max_reps]); each
    function is called once first (warm-up, lazy compilation). The faults
    say whether a call's outputs were fresh memory or memory reused from an
    earlier free, which sets what its time can be on a CPU.

    Round `r` starts at function `start + r` (modulo their number) and goes
    round from there, so that each function follows each of the others in
    turn. A call leaves the machine in a state the next call pays for (freed
    memory to reuse or fresh pages to fault in, caches filled): in a fixed
    order, the function that always ran after eager's call was timed against
    eager's leftovers alone.
    """
    sync = _sync(device)
    est = {}
    for k, f in fns.items():
        _once(f, sync, 1)
        est[k] = max(_once(f, sync, 1), 1e-7)
    # Batch short calls so each sample lasts >= 1 ms (CPU: >= 0.2 ms).
    floor = 1e-3 if device == "cuda" else 2e-4
    inner = {k: max(1, int(floor / t)) for k, t in est.items()}
    per_round = sum(est[k] * inner[k] for k in fns)
    reps = int(min(max_reps, max(min_reps, budget_s / max(per_round, 1e-9))))
    times = {k: [] for k in fns}
    flt = {k: [] for k in fns}
    names = list(fns)
    for r in range(reps):
        at = (start + r) % len(names)
        for k in names[at:] + names[:at]:
            f = fns[k]
            before = _minor_faults()
            times[k].append(_once(f, sync, inner[k]))
            flt[k].append((_minor_faults() - before) / inner[k])
    return times, flt


def _whole(text: str) -> int:
    """`text` as a whole number, for argparse: refused, saying so, where it is not one."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def passes_arg(text: str) -> int:
    """The argparse type of `--passes` (report.py, measure.py, the demo): a
    whole number of passes through the cases, at least 1."""
    n = _whole(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def extra_passes_arg(text: str) -> int:
    """The argparse type of `--extra-passes` (report.py, measure.py): a whole
    number of further passes a row may take, 0 or more."""
    n = _whole(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


# The spread (slowest over fastest) within which a row's passes agree.
UNSTEADY = 1.25


def agreeing(passes: List[float]) -> bool:
    """Whether most of `passes` (one contender's time in each pass of a row:
    more than half of them) lie within UNSTEADY of each other. Such a group
    holds the median pass (of an odd count; both middle ones of an even
    count), so the median is a time that most passes agree on, not one that
    a load moving during the row made. One pass agrees with itself."""
    s = sorted(passes)
    k = len(s) // 2 + 1
    return any(s[i + k - 1] <= UNSTEADY * s[i] for i in range(len(s) - k + 1))


def interleaved(fns: Dict[str, Callable], device: str = "cpu", budget_s: float = 1.5,
                min_reps: int = 5, max_reps: int = 41, faults: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Median seconds per call of each function, timed in interleaved
    `rounds`; given `faults` (a dict), also the median minor page faults per
    call of each, into it."""
    times, flt = rounds(fns, device, budget_s, min_reps, max_reps)
    if faults is not None:
        faults.update({k: statistics.median(v) for k, v in flt.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def per_call(fn: Callable, device: str = "cpu", calls: int = 20000, rounds: int = 5) -> float:
    """Best-of-rounds mean seconds of a call in a tight loop (per-call overhead)."""
    sync = _sync(device)
    for _ in range(200):
        fn()
    return min(_once(fn, sync, calls) for _ in range(rounds))


def device_kernels(prof, iters: int) -> List[Tuple[str, float]]:
    """[(kernel, µs per call)] of the device events (kernels, memsets, copies)
    in a torch.profiler trace of `iters` calls, longest first."""
    import torch

    per: Dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / iters
    return sorted(per.items(), key=lambda kv: -kv[1])


def kernel_us(fn: Callable, iters: int = 10) -> float:
    """µs per call that `fn` keeps the GPU busy: the sum of its device events
    under torch.profiler, over `iters` calls after one untimed call. Unlike a
    wall time, it leaves out the CPU's part of a call (Python, the
    dispatcher, the launch), which the GPU hides only where a kernel outlasts
    the next call's CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(us for _, us in device_kernels(prof, iters))
