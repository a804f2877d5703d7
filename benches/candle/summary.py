"""Keel against candle-nn from criterion's saved results: one markdown row per
(op, dtype, shape) with both medians and the speedup. Run after
`cargo bench --manifest-path benches/candle/Cargo.toml`:

    python3 benches/candle/summary.py [criterion dir] > docs/report/vs_candle.md
"""
import glob
import json
import os
import platform
import sys
import time


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "target", "criterion")
    runs = {}
    for path in glob.glob(os.path.join(root, "**", "new", "benchmark.json"), recursive=True):
        b = json.load(open(path))
        est = json.load(open(os.path.join(os.path.dirname(path), "estimates.json")))
        key = (b["group_id"], b["value_str"])
        runs.setdefault(key, {})[b["function_id"]] = est["median"]["point_estimate"] / 1e6
        runs[key]["bytes"] = (b.get("throughput") or {}).get("Bytes")
    if not runs:
        sys.exit(f"no criterion results under {root}: run cargo bench --manifest-path benches/candle/Cargo.toml")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.machine()) if os.path.exists("/proc/cpuinfo") else platform.machine()
    print(f"Keel against candle-nn 0.11 (CPU), criterion medians, {time.strftime('%Y-%m-%d')}, {cpu}, "
          f"{os.cpu_count()} cores; both return a fresh output per call and run on rayon's pool.\n")
    print("`floor` is a fresh copy of an output's worth of input, the least an op that returns a new tensor pays: "
          "the faster of one on the calling thread and one over rayon's pool (for outputs of 512K elements or more). "
          "`best possible` is candle's time over that floor, what a kernel as fast as the copy would gain; `Keel / floor` "
          "is how far Keel is above it.\n")
    print("| op | dtype | shape | Keel ms | candle ms | floor ms | Keel speedup | best possible | Keel / floor | Keel GB/s | candle GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst, under = None, []
    for (group, shape), r in sorted(runs.items()):
        if "keel" not in r or "candle" not in r:
            continue
        op, dtype = group.rsplit("/", 1)
        speedup = r["candle"] / r["keel"]
        worst = speedup if worst is None else min(worst, speedup)
        gbps = (lambda ms: f"{r['bytes'] / ms / 1e6:.1f}") if r["bytes"] else (lambda ms: "-")
        floors = [r[k] for k in ("clone", "clone_par") if k in r]
        floor = min(floors) if floors else None
        fl = f"{floor:.3g}" if floor else "-"
        best = f"{r['candle'] / floor:.2f}x" if floor else "-"
        above = f"{r['keel'] / floor:.2f}" if floor else "-"
        if speedup < 2:
            under.append(f"{op} {dtype} {shape} ({speedup:.2f}x; best possible {best})")
        print(f"| {op} | {dtype} | {shape} | {r['keel']:.3g} | {r['candle']:.3g} | {fl} | {speedup:.2f}x | {best} | "
              f"{above} | {gbps(r['keel'])} | {gbps(r['candle'])} |")
    print(f"\nLowest speedup: {worst:.2f}x (target: at least 2x on every row).")
    if under:
        print("\nUnder 2x: " + "; ".join(under) + ". Where `best possible` is under 2x, candle is within that factor of "
              "a plain fresh copy of the output: 2x candle would take a kernel at about half a copy's time there "
              "(Keel's prefault of its output gets it below the copy, not that far).")


if __name__ == "__main__":
    main()
