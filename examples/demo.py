"""Checks each Keel op against torch and prints its time beside torch's.

For each op: the largest error of Keel and of torch against a float64
reference (Keel must be within the dtype's tolerance), then the medians of
interleaved timings (keel, torch, clone, keel, ...) from one run, so the ratios
compare like with like under the same machine load; each op is timed in
five passes through all of them (up to four more where most passes disagree), and
its median pass kept. Torch's side is the eager
expression the op replaces. `clone` copies the op's inputs into fresh tensors:
the floor for an op that returns new tensors (allocation, page faults, one
write). The ops and inputs are those of the benchmark report
(benches/report/cases.py); `scripts/report.sh` adds torch.compile and plots.
It runs with the report's glibc allocator settings (benches/report/malloc.py:
outputs of 1 MiB or more are fresh memory for every contender), starting
itself again with them where the environment lacks them.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches", "report"))
from malloc import settings  # noqa: E402


def _with_report_malloc():
    """Starts this script again with `settings()` in its environment, unless it
    has them already: glibc reads them only when a process starts. With its
    defaults, the mmap threshold moves with what was freed, and one contender's
    output can be memory freed before (no page faults) beside another's fresh
    memory, which the timings would then compare."""
    want = settings()
    if any(os.environ.get(k) != v for k, v in want.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **want})


if __name__ == "__main__":
    _with_report_malloc()

import torch  # noqa: E402

import keel  # noqa: E402
from cases import make_cases  # noqa: E402
from measure import PASSES, time_cases  # noqa: E402
from timing import passes_arg  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--thp", action="store_true", help="say that THP_MEM_ALLOC_ENABLE=1 is set (scripts/demo.sh)")
    ap.add_argument("--size", default="large", choices=["large", "small"], help="the report's shapes")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of timed rounds per op")
    ap.add_argument("--passes", type=passes_arg, default=PASSES, help="passes through the ops, each timing every op for "
                    "budget/passes seconds (a burst of load then spoils one pass of an op, not all of it)")
    a = ap.parse_args()
    glibc = ", ".join(f"{k}={os.environ.get(k)}" for k in settings())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, keel {keel.__version__}"
          f"{', THP_MEM_ALLOC_ENABLE=1' if a.thp else ''}; glibc {glibc}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    ok = True
    print(f"{'op':26} {'dev':4} {'dtype':8} {'shape':13}  {'err keel':>8} {'err torch':>9}  "
          f"{'keel ms':>8} {'torch ms':>8} {'clone ms':>8}  {'speedup':>7} {'keel/clone':>10}")
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            cases = make_cases(device, dtype, a.size)
            dname = str(dtype)[6:]
            for row in time_cases(cases, device, dname, False, a.budget, a.passes, desc=f"{device} {dname}"):
                if "error" in row:  # the op raised: say so, and go on with the others
                    ok = False
                    print(f"{row['op']:26} {device:4} {dname:8} {row['shape']:13}  FAILED: {row['error']}")
                    continue
                (ek, et), t = (row["err"]["keel"], row["err"]["eager"]), row["ms"]
                ok &= row["ok"]
                print(f"{row['op']:26} {device:4} {dname:8} {row['shape']:13}  {ek:8.1e} {et:9.1e}  "
                      f"{t['keel']:8.2f} {t['eager']:8.2f} {t['clone']:8.2f}  "
                      f"{t['eager'] / t['keel']:6.2f}x {t['keel'] / t['clone']:10.2f}{'' if row['ok'] else '  BAD'}")
            del cases
    if not torch.cuda.is_available():
        print("cuda: skipped (torch.cuda.is_available() is False on this machine)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
