"""Peak extra memory of cross-entropy forward + backward, Keel against torch eager.

Each measurement runs in a fresh process on the CPU: make logits [N, V] (and
targets), reset the kernel's peak-RSS counter, run loss + backward, and report
peak RSS minus the RSS before the call: the memory the call needed beyond its
inputs, gradient included.

    python examples/cross_entropy_memory.py [--n 4096] [--v 32000] [--json]
"""
import argparse
import json
import subprocess
import sys

CHILD = r"""
import sys, torch, torch.nn.functional as F
impl, dtype, n, v = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if impl == "keel":
    import keel
    f = keel.cross_entropy
else:
    f = F.cross_entropy
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
g = torch.Generator().manual_seed(0)
x = torch.randn(n, v, generator=g).to(dtype).requires_grad_()
t = torch.randint(0, v, (n,), generator=g)
f(x[:2], t[:2]).backward()  # warm up (lazy init), then drop the small grad
x.grad = None
before = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
f(x, t).backward()
print(rss("VmHWM") - before)
"""


def measure(impl, dtype, n, v):
    out = subprocess.run([sys.executable, "-c", CHILD, impl, dtype, str(n), str(v)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return int(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--v", type=int, default=32000)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = p.parse_args()
    sizes = {"float32": 4, "bfloat16": 2}
    r = {"n": a.n, "v": a.v, "logits_bytes": {d: a.n * a.v * s for d, s in sizes.items()}}
    for dtype in sizes:
        r[dtype] = {impl: measure(impl, dtype, a.n, a.v) for impl in ("keel", "torch")}
    if a.json:
        print(json.dumps(r))
        return
    mib = 2**20
    print(f"cross_entropy forward+backward, logits [{a.n}, {a.v}], CPU: peak memory beyond the inputs")
    print("| dtype | logits | Keel | torch eager | Keel / logits | torch / logits |")
    print("|---|---|---|---|---|---|")
    for dtype in sizes:
        lg, k, t = r["logits_bytes"][dtype], r[dtype]["keel"], r[dtype]["torch"]
        print(f"| {dtype} | {lg / mib:.0f} MiB | {k / mib:.0f} MiB | {t / mib:.0f} MiB | {k / lg:.2f} | {t / lg:.2f} |")


if __name__ == "__main__":
    main()
