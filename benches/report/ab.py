"""Keel at two revisions on one machine, side by side: the rows of
`measure.py` runs made with a baseline wheel and with the new one.

    python benches/report/ab.py --base b1.json b2.json --new n1.json n2.json \\
        [--base-label 94b306d] [--new-label HEAD] [--out AB.md] [--threshold 0.03]

`scripts/gpu-run.sh ab` makes the runs (baseline and new alternated, each in
its own process, as the two wheels cannot share one) and calls this. It
answers "did this change make its row slower?" on whatever GPU a session is
lent, without a report from another card to compare with.

Each row's time is the least over a side's runs (noise only adds time); the
ratio is new / base, and each side's largest error against float64 is
shown (a kernel variant must stay as accurate). The torch eager time of the
same row is shown for both sides too: torch did not change between the runs,
so where its ratio is far from 1 the machine moved, and the row's Keel ratio
is marked as unsure. The
per-call overhead rows compare the same way (`torch.ops.keel` column), and so
do the GPU kernel times of CUDA rows where the runs recorded them
(`kernel_us`: a CPU-bound row's wall time hides its kernel's).
"""
import argparse
import json
import sys
from typing import Dict, List, Optional, Tuple


def _load(paths: List[str]) -> List[dict]:
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    return runs


def _best(runs: List[dict], section: str, key, value, pick=min) -> Dict[tuple, float]:
    """The least (or, with `pick=max`, largest) `value(entry)` per
    `key(entry)` over the runs' `section` entries (entries whose call failed,
    `value` None, are left out)."""
    best: Dict[tuple, float] = {}
    for run in runs:
        for e in run.get(section, []):
            v = value(e)
            if v is None:
                continue
            k = key(e)
            best[k] = pick(best.get(k, v), v)
    return best


def _row_key(r: dict) -> tuple:
    return (r["device"], r["op"], r["dtype"], r["shape"])


def _keel(r: dict) -> Optional[float]:
    return None if "error" in r else r["ms"]["keel"]


def _eager(r: dict) -> Optional[float]:
    return None if "error" in r else r["ms"]["eager"]


def _err(r: dict) -> Optional[float]:
    return None if "error" in r else r["err"]["keel"]


def _kernel(who: str):
    """Reads contender `who`'s GPU kernel µs per call of a row (None where not recorded)."""
    return lambda r: None if "error" in r else r.get("kernel_us", {}).get(who)


def _overhead_key(o: dict) -> tuple:
    return (o["device"], o["name"], o.get("mode", "grad mode"))


def _verdict(ratio: float, control: Optional[float], threshold: float) -> str:
    if control is not None and abs(control - 1) > threshold:
        return "unsure (torch moved too)"
    if ratio > 1 + threshold:
        return "**slower**"
    if ratio < 1 - threshold:
        return "faster"
    return "same"


def _side_by_side(base: List[dict], new: List[dict], section: str, key, keel, torch_,
                  threshold: float) -> List[Tuple[tuple, float, float, float, str]]:
    """(key, base Keel time, new Keel time, torch's new / base, verdict) for
    every entry of `section` that both sides measured, in the new runs' order;
    `keel` and `torch_` read an entry's times."""
    bk, nk = _best(base, section, key, keel), _best(new, section, key, keel)
    bt, nt = _best(base, section, key, torch_), _best(new, section, key, torch_)
    out = []
    for k in nk:
        if k in bk:
            control = nt[k] / bt[k] if k in nt and k in bt else None
            out.append((k, bk[k], nk[k], control, _verdict(nk[k] / bk[k], control, threshold)))
    return out


def compare(base: List[dict], new: List[dict], threshold: float) -> List[Tuple[tuple, float, float, float, str]]:
    """(row key, base ms, new ms, torch's new / base, verdict) for every row
    that both sides measured, in the new runs' order."""
    return _side_by_side(base, new, "rows", _row_key, _keel, _eager, threshold)


def errors(base: List[dict], new: List[dict]) -> Dict[tuple, Tuple[float, float]]:
    """(base, new) largest Keel error against float64 per row both measured."""
    b, n = _best(base, "rows", _row_key, _err, max), _best(new, "rows", _row_key, _err, max)
    return {k: (b[k], n[k]) for k in n if k in b}


def compare_kernels(base: List[dict], new: List[dict], threshold: float) -> List[Tuple[tuple, float, float, float, str]]:
    """As `compare`, for the rows' GPU kernel time per call (µs), where both
    sides recorded it; torch eager's kernel time is the control."""
    return _side_by_side(base, new, "rows", _row_key, _kernel("keel"), _kernel("eager"), threshold)


def compare_overhead(base: List[dict], new: List[dict], threshold: float) -> List[Tuple[tuple, float, float, float, str]]:
    """As `compare`, for the per-call overhead entries (µs)."""
    return _side_by_side(base, new, "overhead", _overhead_key, lambda o: o["keel_us"], lambda o: o["torch_us"],
                         threshold)


def markdown(base: List[dict], new: List[dict], base_label: str, new_label: str, threshold: float) -> str:
    m = new[0]["machine"]
    where = m.get("gpu") or m.get("cpu", "?")
    extra = f", driver {m['driver']}, CUDA {m['cuda']}" if "driver" in m else ""
    lines = [f"# Keel {base_label} against {new_label}", "",
             f"Measured {m['date']} on **{where}**{extra}, torch {m['torch']}: {len(base)} run(s) of {base_label} "
             f"and {len(new)} of {new_label}, alternated, each row the least over a side's runs. A row is slower or "
             f"faster where new / base is beyond 1 +- {threshold:g}; unsure where torch eager's time of the same row "
             "moved that much between the sides (the machine, not Keel).", "",
             f"| device | op | dtype | shape | {base_label} ms | {new_label} ms | new / base | torch new / base | | "
             "err base | err new |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    errs = errors(base, new)
    for k, b, n, c, v in compare(base, new, threshold):
        dev, op, dt, shape = k
        cs = f"{c:.3f}" if c is not None else "-"
        eb, en = (f"{e:.1e}" for e in errs[k]) if k in errs else ("-", "-")
        lines.append(f"| {dev} | {op} | {dt} | {shape} | {b:.4f} | {n:.4f} | {n / b:.3f} | {cs} | {v} | {eb} | {en} |")
    kern = compare_kernels(base, new, threshold)
    if kern:
        lines += ["", "## GPU kernel time per call (torch.profiler)", "",
                  f"| device | op | dtype | shape | {base_label} µs | {new_label} µs | new / base | torch new / base | |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for (dev, op, dt, shape), b, n, c, v in kern:
            cs = f"{c:.3f}" if c is not None else "-"
            lines.append(f"| {dev} | {op} | {dt} | {shape} | {b:.1f} | {n:.1f} | {n / b:.3f} | {cs} | {v} |")
    over = compare_overhead(base, new, threshold)
    if over:
        lines += ["", "## Per-call overhead (`torch.ops.keel`)", "",
                  f"| device | op | mode | {base_label} µs | {new_label} µs | new / base | torch new / base | |",
                  "|---|---|---|---|---|---|---|---|"]
        for (dev, name, mode), b, n, c, v in over:
            cs = f"{c:.3f}" if c is not None else "-"
            lines.append(f"| {dev} | {name} | {mode} | {b:.2f} | {n:.2f} | {n / b:.3f} | {cs} | {v} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", nargs="+", required=True, help="measure.py JSON files made with the baseline wheel")
    ap.add_argument("--new", nargs="+", required=True, help="measure.py JSON files made with the new wheel")
    ap.add_argument("--base-label", default="base")
    ap.add_argument("--new-label", default="new")
    ap.add_argument("--threshold", type=float, default=0.03, help="the ratio's distance from 1 that counts")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    a = ap.parse_args()
    base, new = _load(a.base), _load(a.new)
    if not base or not new:
        sys.exit("ab: no runs on one side")
    text = markdown(base, new, a.base_label, a.new_label, a.threshold)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
