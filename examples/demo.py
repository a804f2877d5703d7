"""Checks each Keel op against torch and prints its time beside torch's.

For each op: the largest error of Keel and of torch against a float64
reference (Keel must be within the dtype's tolerance), then the medians of
interleaved timings (keel, torch, clone, keel, ...) from one run, so the ratios
compare like with like under the same machine load. Torch's side is the eager
expression the op replaces. `clone` copies the op's inputs into fresh tensors:
the floor for an op that returns new tensors (allocation, page faults, one
write). The ops and inputs are those of the benchmark report
(benches/report/cases.py); `scripts/report.sh` adds torch.compile and plots.
"""
import argparse
import os
import sys

import torch

import keel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches", "report"))
from cases import make_cases, tolerance  # noqa: E402
from measure import time_case  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--thp", action="store_true", help="say that THP_MEM_ALLOC_ENABLE=1 is set (scripts/demo.sh)")
    ap.add_argument("--size", default="large", choices=["large", "small"], help="the report's shapes")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of timed rounds per op")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, keel {keel.__version__}"
          f"{', THP_MEM_ALLOC_ENABLE=1' if a.thp else ''}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    ok = True
    print(f"{'op':26} {'dev':4} {'dtype':8} {'shape':13}  {'err keel':>8} {'err torch':>9}  "
          f"{'keel ms':>8} {'torch ms':>8} {'clone ms':>8}  {'speedup':>7} {'keel/clone':>10}")
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            for case in make_cases(device, dtype, a.size):
                row = time_case(case, device, compile_=False, budget_s=a.budget)
                (ek, et), t = (row["err"]["keel"], row["err"]["eager"]), row["ms"]
                good = ek <= tolerance(dtype)
                ok &= good
                print(f"{case.name:26} {device:4} {str(dtype)[6:]:8} {case.shape:13}  {ek:8.1e} {et:9.1e}  "
                      f"{t['keel']:8.2f} {t['eager']:8.2f} {t['clone']:8.2f}  "
                      f"{t['eager'] / t['keel']:6.2f}x {t['keel'] / t['clone']:10.2f}{'' if good else '  BAD'}")
    if not torch.cuda.is_available():
        print("cuda: skipped (torch.cuda.is_available() is False on this machine)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
