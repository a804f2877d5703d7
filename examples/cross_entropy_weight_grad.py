"""Forward + backward time of class-weighted cross-entropy whose weights need a
gradient, Keel against torch eager, in one process.

torch gives no gradient to class weights with class indices (its nll_loss has
none), so its row is the same call with weights that need none: the least a
training step with such weights could cost in torch. Keel's rows: weights that
need a gradient, and weights that need none. Calls interleaved, best of
`--reps`, on the CPU.

    python examples/cross_entropy_weight_grad.py [--n 2048] [--v 32000] [--reps 5]
"""
import argparse
import time

import torch
import torch.nn.functional as F

import keel


def _time(fn, x, t, w, weight_grad):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_(weight_grad)
    start = time.perf_counter()
    fn(xl, t, wl).backward()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--v", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"[{args.n}, {args.v}] logits, torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.reps}")
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(args.n, args.v, generator=g) * 2).to(dtype)
        t = torch.randint(0, args.v, (args.n,), generator=g)
        w = (torch.rand(args.v, generator=g) + 0.5).to(dtype)
        for s in (0.0, 0.1):
            rows = {
                "torch, weights without gradient": (lambda a, b, c: F.cross_entropy(a, b, weight=c, label_smoothing=s), False),
                "keel, weights without gradient": (lambda a, b, c: keel.cross_entropy(a, b, weight=c, label_smoothing=s), False),
                "keel, weights with gradient": (lambda a, b, c: keel.cross_entropy(a, b, weight=c, label_smoothing=s), True),
            }
            best = {name: float("inf") for name in rows}
            for _ in range(args.reps):
                for name, (fn, wg) in rows.items():
                    best[name] = min(best[name], _time(fn, x, t, w, wg))
            base = best["torch, weights without gradient"]
            for name, secs in best.items():
                print(f"{str(dtype):15} smoothing {s}  {name:32} {secs * 1e3:7.1f} ms  torch/this {base / secs:4.2f}x")


if __name__ == "__main__":
    main()
