"""The comparison report: Keel against torch eager and torch.compile for every
op, on CPU and (where present) CUDA, with the machine's memory bandwidth and
per-call overhead, written as markdown and PNG plots.

    python benches/report/report.py --out docs/report            # what scripts/report.sh runs
    python benches/report/report.py --out /tmp/r --size small --no-plots   # smoke test
    python benches/report/report.py --out /tmp/r --devices cuda   # the CUDA rows alone (no THP run: that one is CPU)

Each configuration runs in its own process: once as torch allocates by
default, and once with `THP_MEM_ALLOC_ENABLE=1` (torch's huge-page
allocation) on CPU. CUDA is measured in the first.

Both run with glibc's allocator settings fixed as `malloc.py` says (every
output of 1 MiB or more fresh memory, freed heap memory kept mapped), as the
demo does too.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from malloc import settings  # noqa: E402
from render import markdown, plots  # noqa: E402
from timing import extra_passes_arg, passes_arg  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for REPORT.md, the plots and the raw JSON")
    ap.add_argument("--size", default="large", choices=["large", "small"])
    ap.add_argument("--ops", default="")
    ap.add_argument("--dtypes", default=None, help="comma-separated dtypes (default: float32,bfloat16)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-thp", action="store_true", help="skip the THP_MEM_ALLOC_ENABLE=1 run")
    ap.add_argument("--devices", default=None,
                    help="comma-separated devices (default: cpu, and cuda where torch finds one); the "
                         "THP_MEM_ALLOC_ENABLE=1 run, a CPU one, only where cpu is among them")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of timed rounds per case")
    ap.add_argument("--passes", type=passes_arg, default=None,
                    help="passes through the cases, each timing every case for budget/passes seconds "
                         "(default: measure.py's PASSES)")
    ap.add_argument("--extra-passes", type=extra_passes_arg, default=None,
                    help="the most further passes a row takes while its passes disagree on Keel's time "
                         "(default: measure.py's EXTRA_PASSES)")
    ap.add_argument("--no-kernel-times", action="store_true",
                    help="CUDA: skip each row's GPU kernel times (torch.profiler)")
    ap.add_argument("--decode-ops", default=None,
                    help="comma-separated ops timed again at decode shapes (default: every forward op; '' for none)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    malloc = settings()
    configs = [("", malloc, a.devices)]
    if not a.no_thp and (a.devices is None or "cpu" in a.devices.split(",")):
        configs.append(("THP_MEM_ALLOC_ENABLE=1", {**malloc, "THP_MEM_ALLOC_ENABLE": "1"}, "cpu"))
    runs, failed = [], False
    for label, env, devices in configs:
        path = os.path.join(a.out, f"raw{'-thp' if label else ''}.json")
        cmd = [sys.executable, os.path.join(HERE, "measure.py"), "--out", path, "--size", a.size, "--label", label]
        cmd += ["--ops", a.ops] if a.ops else []
        cmd += ["--dtypes", a.dtypes] if a.dtypes else []
        cmd += ["--no-compile"] if a.no_compile else []
        cmd += ["--no-kernel-times"] if a.no_kernel_times else []
        cmd += ["--decode-ops", a.decode_ops] if a.decode_ops is not None else []
        cmd += ["--devices", devices] if devices else []
        cmd += ["--budget", str(a.budget)]
        cmd += ["--passes", str(a.passes)] if a.passes is not None else []
        cmd += ["--extra-passes", str(a.extra_passes)] if a.extra_passes is not None else []
        rc = subprocess.run(cmd, env={**os.environ, **env}).returncode
        if not os.path.exists(path):
            sys.exit(f"report: the measuring run '{label or 'default'}' failed (exit {rc})")
        failed |= rc != 0
        with open(path) as f:
            runs.append(json.load(f))
    images = [] if a.no_plots else plots(runs, a.out)
    with open(os.path.join(a.out, "REPORT.md"), "w") as f:
        f.write(markdown(runs, images))
    print(f"wrote {os.path.join(a.out, 'REPORT.md')}" + ("" if a.no_plots else " and " + ", ".join(images)))
    if failed:
        sys.exit("report: some Keel result was outside its tolerance (see the err column)")


if __name__ == "__main__":
    main()
