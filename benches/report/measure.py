"""One measuring run of the report (a child process of `report.py`, so that
`THP_MEM_ALLOC_ENABLE` is set before torch allocates anything): the machine,
its memory bandwidth, every case timed as Keel / torch eager / torch.compile /
clone of the inputs, and per-call overhead. Writes JSON.

    python benches/report/measure.py --out run.json [--devices cpu,cuda] [--size large|small]
"""
import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

import keel
from cases import DECODE_OPS, OVERHEAD_MODES, make_cases, max_rel_err, tiny_cases, tolerance
from timing import agreeing, extra_passes_arg, interleaved, kernel_us, passes_arg, per_call, rounds

try:
    from tqdm import tqdm
except ImportError:  # the report installs tqdm; smoke tests may run without it

    class tqdm:  # noqa: N801 - tqdm's name, for the calls made of it here
        def __init__(self, *_, total=0, **__):
            self.total = total

        def update(self, _):
            pass

        def close(self):
            pass


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


# What each of `keel.cpu_capability()`'s levels runs, in the report's words.
_SIMD = {
    "avx512": "AVX-512 with AVX512-BF16 (16 lanes)",
    "avx2": "AVX2 with FMA and F16C (8 lanes)",
    "default": "no explicit SIMD: portable lanes",
}


def _simd() -> str:
    """Which of Keel's SIMD levels its CPU kernels run here (as the kernels chose
    it at run time, under any `KEEL_CPU_CAPABILITY`), so that reports from
    different CPUs, or levels, are told apart."""
    level = keel.cpu_capability()
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.machine()}: portable lanes (no explicit SIMD)"
    text = _SIMD.get(level, level)
    cap = os.environ.get("KEEL_CPU_CAPABILITY", "").strip()
    return f"{text} (KEEL_CPU_CAPABILITY={cap})" if cap else text


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def machine(devices) -> dict:
    m = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu_model(),
        "simd": _simd(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "keel": keel.__version__,
        "python": platform.python_version(),
        "thp_sysfs": _thp(),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", ""),
        "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_", ""),
    }
    if "cuda" in devices:
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), driver=_driver(),
                 cuda=torch.version.cuda)
    return m


def bandwidth(device: str) -> dict:
    """GB/s (bytes read + written) of a fresh clone and of a copy into an existing tensor."""
    mib = 256 if device == "cuda" else 64
    x = torch.randn(mib * 2**18, device=device)
    y = torch.empty_like(x)
    t = interleaved({"clone": lambda: x.clone(), "copy": lambda: y.copy_(x)}, device, budget_s=2.0)
    moved = 2 * x.numel() * 4
    return {"bytes": moved, "clone_GBps": moved / t["clone"] / 1e9, "copy_GBps": moved / t["copy"] / 1e9}


def faster(start: dict, end: dict) -> dict:
    """The bandwidth line of a device's run from :func:`bandwidth` measured
    at its start and at its end: each GB/s the faster of the two, the
    stricter line (a fresh VM's first clones read 1.0 GB/s in one run, 6-8 a
    minute later); both measures kept under ``measures``."""
    line = {k: max(start[k], end[k]) for k in ("clone_GBps", "copy_GBps")}
    return {"bytes": start["bytes"], **line, "measures": {"start": start, "end": end}}


# The contenders whose GPU kernel time a CUDA row records beside its wall time.
KERNEL_TIMED = ("keel", "eager", "compile")

# Passes through the cases (`time_cases`). With three, session 50's second
# run had one row whose Keel time was slowed in two passes of three (64, 18
# and 63 ms; 18-20 when run again alone); with five, a row's median needs
# three slowed passes to move.
PASSES = 5

# The most passes a row takes after PASSES while its passes disagree
# (`time_cases`): with nine, its median needs five slowed passes to move.
EXTRA_PASSES = 4


def own_code(fn: Callable) -> Callable:
    """A copy of `fn` with a code object of its own.

    torch.compile (Dynamo) keeps its compiled variants on the code object it
    compiles, and after `recompile_limit` (8) of them runs that code eager
    from then on, with a logged warning only. The report's torch expressions
    serve several cases each (`_rms_norm` ten a process: three large cases
    and two decode ones, in each dtype), so until session 50 the last two
    cases' "torch.compile" was torch eager behind Dynamo's frame hook. Each
    case now compiles its own copy: one variant each, none shared."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    g = types.FunctionType(code.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    g.__kwdefaults__, g.__qualname__, g.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    g.__dict__.update(fn.__dict__)
    return g


def _graphs() -> Optional[int]:
    """The graphs Dynamo has captured in this process so far (None where this
    torch does not count them)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private counter; without it the check is skipped
        return None


def contenders(case, compile_: bool, typed: bool = False) -> Tuple[dict, Dict[str, Callable]]:
    """The row of `case` so far (what it is, each contender's error against
    float64) and the calls to time: Keel, torch eager, torch.compile of the
    eager expression, a clone of the inputs (the floor), a copy of them into
    tensors already there for an in-place case (its floor: it allocates
    nothing), and the typed API (`keel.*`) where `typed` and the case has one."""
    row = {"op": case.name, "shape": case.shape, "nbytes": case.nbytes, "bandwidth_bound": case.bandwidth_bound,
           "backward": case.backward, "inplace": case.inplace}
    ref = case.reference()
    fns = {"keel": lambda: case.run(case.keel), "eager": lambda: case.run(case.torch)}

    def err(fn):
        # An in-place case is checked on fresh copies of its inputs.
        fresh = tuple(a.clone() for a in case.args) if case.inplace else None
        return max_rel_err(case.run(fn, fresh), ref)

    errs = {"keel": err(case.keel), "eager": err(case.torch)}
    if typed and case.typed is not None:
        fns["typed"] = lambda: case.run(case.typed)
        errs["typed"] = err(case.typed)
    if compile_:
        try:
            compiled = torch.compile(own_code(case.torch), dynamic=False)
            before = _graphs()
            errs["compile"] = err(compiled)
            if before is not None and _graphs() == before:
                raise RuntimeError("Dynamo captured no graph: the call ran eager")
            fns["compile"] = lambda: case.run(compiled)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            errs.pop("compile", None)
    args = [case.args[i] for i in case.clone_args]
    fns["clone"] = lambda: [a.clone() for a in args]
    row["clone_nbytes"] = 2 * sum(a.numel() * a.element_size() for a in args)  # read and written
    if case.inplace:
        # An in-place op allocates nothing: its floor is a copy of the same
        # inputs into tensors already there (already written: no first-touch
        # faults), timed beside it, as the clone is for the others.
        dst = [a.clone() for a in args]
        fns["copy"] = lambda: [d.copy_(a) for d, a in zip(dst, args)]
        row["copy_nbytes"] = row["clone_nbytes"]
    row["err"] = errs
    return row, fns


def _failed(case, device: str, dname: str, e: Exception) -> dict:
    """The row of a case that raised: it says why, so that one broken op
    costs its row, not the run."""
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    print(f"measure: {case.name} {device} {dname}: {msg}", file=sys.stderr)
    return {"op": case.name, "shape": case.shape, "device": device, "dtype": dname, "ok": False, "error": msg}


def _finish(row: dict, times: Dict[str, List[List[float]]], faults: Dict[str, List[float]], device: str,
            dname: str) -> dict:
    """`row` with its times: each contender's median of its passes' medians
    (`ms`; `ms_passes` keeps each pass's), its median page faults a call (CPU),
    its device and dtype, and whether Keel's error (and the typed API's, where
    timed) is within tolerance."""
    med = statistics.median
    row["ms_passes"] = {k: [med(p) * 1e3 for p in v] for k, v in times.items()}
    row["ms"] = {k: med(v) for k, v in row["ms_passes"].items()}
    if device == "cpu":
        row["faults"] = {k: med(v) for k, v in faults.items()}  # fresh outputs, or reused memory
    worst = max(row["err"]["keel"], row["err"].get("typed", 0.0))
    row.update(device=device, dtype=dname, ok=worst <= tolerance(DTYPES[dname]))
    return row


def time_cases(cases, device: str, dname: str, compile_: bool, budget_s: float, passes: int = PASSES,
               typed: bool = False, kernels: bool = True, ctx=contextlib.nullcontext, desc: str = "",
               extra: int = EXTRA_PASSES):
    """Yields the row of each of `cases`, in their order, timed as
    `contenders` in interleaved rounds (`timing.rounds`) over `passes` passes
    through all the cases, `budget_s / passes` seconds of rounds a case a
    pass, under `ctx`.

    A burst of load on the machine (this VM has some lasting seconds) then
    falls into one pass of a row, not the whole of it, and the median of the
    passes' medians leaves it out. A row whose passes do not agree on Keel's
    time (`timing.agreeing`: no majority of them within `UNSTEADY` of each
    other) is timed in further passes through the rows still in that state,
    up to `extra` more, until they do; `extra_passes` in its row counts them.
    On CUDA with `kernels`, a row also gets the GPU kernel time per call of
    Keel, eager and compile (`kernel_us`), which a wall time bound by the CPU
    hides. A case that raises becomes a failed row."""
    live = []  # [case, row, fns, times, faults]
    for case in cases:
        try:
            with ctx():
                row, fns = contenders(case, compile_, typed)
            live.append([case, row, fns, {k: [] for k in fns}, {k: [] for k in fns}])
        except Exception as e:  # noqa: BLE001 - reported in the row and the exit status
            yield _failed(case, device, dname, e)
    per_pass = dict(min_reps=max(2, math.ceil(5 / passes)), max_reps=math.ceil(41 / passes))
    bar = tqdm(total=passes * len(live), desc=desc, file=sys.stderr, leave=False)
    done: Dict[int, dict] = {}  # the finished rows not yet yielded, by position
    first = 0  # the position of the first row not yet yielded
    for p in range(passes + extra):
        for at, item in enumerate(live):
            case, row, fns, times, faults = item
            if fns is None:
                continue
            if p >= passes:
                bar.total += 1
            # Each pass goes on rotating the contenders' order from where the
            # case's earlier passes left it.
            start = sum(len(r) for r in times["keel"])
            try:
                with ctx():
                    t, f = rounds(fns, device, budget_s / passes, start=start, **per_pass)
            except Exception as e:  # noqa: BLE001
                item[2] = None
                done[at] = _failed(case, device, dname, e)
                continue
            finally:
                bar.update(1)
            for k in fns:
                times[k].append(t[k])
                faults[k] += f[k]
            if p < passes - 1:
                continue
            if p < passes + extra - 1 and not agreeing([statistics.median(t) for t in times["keel"]]):
                continue
            if p >= passes:
                row["extra_passes"] = p - passes + 1
            if device == "cuda" and kernels:
                try:
                    with ctx():
                        row["kernel_us"] = {k: kernel_us(fns[k]) for k in KERNEL_TIMED if k in fns}
                except Exception as e:  # noqa: BLE001 - the profiler's failure costs the column, not the row
                    row["kernel_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            done[at] = _finish(row, times, faults, device, dname)
            item[2] = None  # its inputs and compiled code may go
        # The finished rows up to the first that is not, in the cases' order.
        while first in done:
            yield done.pop(first)
            first += 1
        if first == len(live):
            break
    bar.close()


def save(out: dict, path: str) -> None:
    """Writes the run so far (rewritten after every case, so that a run cut
    short still leaves its rows)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", default="cpu" + (",cuda" if torch.cuda.is_available() else ""))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--size", default="large", choices=["large", "small"])
    ap.add_argument("--ops", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--decode-ops", default=",".join(DECODE_OPS),
                    help="comma-separated case names timed again at decode shapes (empty: none)")
    ap.add_argument("--label", default="")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of timed rounds per case")
    ap.add_argument("--passes", type=passes_arg, default=PASSES, help="passes through the cases, each timing every case "
                    "for budget/passes seconds (a burst of load then spoils one pass of a row, not all of it)")
    ap.add_argument("--extra-passes", type=extra_passes_arg, default=EXTRA_PASSES,
                    help="the most further passes a row takes while its passes disagree on Keel's time")
    ap.add_argument("--no-overhead", action="store_true", help="skip the per-call overhead of tiny calls")
    ap.add_argument("--no-kernel-times", action="store_true",
                    help="CUDA: skip each row's GPU kernel times (torch.profiler, about a second a row)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    devices = [d for d in a.devices.split(",") if d]
    for d in devices:
        if d not in ("cpu", "cuda"):
            sys.exit(f"measure: --devices: unknown device {d!r} (cpu, cuda)")
        if d == "cuda" and not torch.cuda.is_available():
            sys.exit("measure: --devices: cuda was asked for, but torch finds no CUDA device")
    names = [n for n in a.ops.split(",") if n]
    decode_names = [n for n in a.decode_ops.split(",") if n]
    out = {"label": a.label, "size": a.size, "passes": a.passes, "extra_passes": a.extra_passes,
           "machine": machine(devices), "bandwidth": {},
           "rows": [], "decode": [], "overhead": [], "complete": False}
    for device in devices:
        start = out["bandwidth"][device] = bandwidth(device)
        for dname in a.dtypes.split(","):
            dtype = DTYPES[dname]
            cases = make_cases(device, dtype, a.size, names)
            for row in time_cases(cases, device, dname, not a.no_compile, a.budget, a.passes,
                                  kernels=not a.no_kernel_times, extra=a.extra_passes,
                                  desc=f"{a.label or 'run'} {device} {dname}"):
                out["rows"].append(row)
                save(out, a.out)
            del cases
            decode = make_cases(device, dtype, "decode", decode_names) if decode_names else []
            # Decoding runs under no_grad (as Hugging Face's generate() does);
            # the typed API is timed too: it skips the Python autograd kernel there.
            for row in time_cases(decode, device, dname, not a.no_compile, a.budget, a.passes, typed=True,
                                  kernels=not a.no_kernel_times, ctx=torch.no_grad, extra=a.extra_passes,
                                  desc=f"{a.label or 'run'} {device} {dname} decode"):
                out["decode"].append(row)
                save(out, a.out)
            del decode
        out["bandwidth"][device] = faster(start, bandwidth(device))
        # On CUDA a call is launch-bound and steady; fewer calls measure it as well.
        calls, rounds = (2000, 3) if device == "cuda" else (20000, 5)
        for mode, ctx in ({} if a.no_overhead else OVERHEAD_MODES).items():
            with ctx():
                for name, kf, kt, tf in tiny_cases(device):
                    out["overhead"].append({"device": device, "name": name, "mode": mode,
                                            "keel_us": per_call(kf, device, calls, rounds) * 1e6 if kf else None,
                                            "typed_us": per_call(kt, device, calls, rounds) * 1e6 if kt else None,
                                            "torch_us": per_call(tf, device, calls, rounds) * 1e6})
    out["complete"] = True
    save(out, a.out)
    sys.exit(0 if all(r["ok"] for r in out["rows"] + out["decode"]) else 1)


if __name__ == "__main__":
    main()
