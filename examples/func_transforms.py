"""torch.func through Keel's kernels: time of ``vjp`` and of per-example gradients
(``vmap(grad(...))``), Keel's typed API against torch's own ops, in one process.

Rows: ``vjp`` of each norm on ``[rows, hidden]`` (the pullback applied once),
its ``jvp`` there (a tangent on ``x``: Keel's forward and backward kernels,
docs/BENCHMARKS.md session 116) and the same tangent under
``torch.autograd.forward_ad`` with a weight requiring a gradient (a module's,
in grad mode: a graph recorded beside it, session 117), the per-example input and weight gradients of
``sum(norm(x_i, w) * t)`` over a batch of examples with a shared weight, and a
Hessian-vector product (``jvp(grad(...))``) of ``sum((norm(x, w) * t)^2)`` on a
small ``[64, 512]``.
Calls interleaved, best of `--reps`, float32, on `--device` (CUDA calls
synchronised).

    python examples/func_transforms.py [--rows 4096] [--hidden 4096] [--reps 7] [--device cpu]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad as fwAD
from torch.func import grad, jvp, vjp, vmap

import keel

NORMS = {
    "rms_norm": (lambda x, w: keel.rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6)),
    "layer_norm": (lambda x, w: keel.layer_norm(x, w), lambda x, w: F.layer_norm(x, x.shape[-1:], w)),
}


def _best(fns, reps, sync):
    """Each of `fns` timed `reps` times, interleaved, after one warm-up call: the best."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _vjp_once(norm, x, w, g):
    def run():
        _, pull = vjp(norm, x, w)
        return pull(g)

    return run


def _jvp(norm, x, w, v):
    return lambda: jvp(lambda x: norm(x, w), (x,), (v,))


def _forward_ad(norm, x, w, v):
    w = w.detach().requires_grad_()

    def run():
        with fwAD.dual_level():
            return fwAD.unpack_dual(norm(fwAD.make_dual(x, v), w)).tangent

    return run


def _per_example(norm, x, w, t):
    f = vmap(grad(lambda x, w: (norm(x, w) * t).sum(), (0, 1)), in_dims=(0, None))
    return lambda: f(x, w)


def _hvp(norm, x, w, t, v):
    loss = grad(lambda x: (norm(x, w) * t).square().sum())
    return lambda: jvp(loss, (x,), (v,))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    h, dev = args.hidden, torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev)

    where = f"{torch.get_num_threads()} threads" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    print(f"torch {torch.__version__}, {where}, float32, best of {args.reps}")
    print(f"{'case':<48} {'keel ms':>9} {'torch ms':>9} {'speedup':>8}")
    x, g, w = randn(args.rows, h), randn(args.rows, h), randn(h)
    batches = [(64, 128, min(h, 512)), (16, args.rows // 8, h)]
    for name, (ours, theirs) in NORMS.items():
        k, r = _best([_vjp_once(ours, x, w, g), _vjp_once(theirs, x, w, g)], args.reps, sync)
        print(f"{f'vjp {name} [{args.rows}, {h}]':<48} {k * 1e3:>9.2f} {r * 1e3:>9.2f} {r / k:>7.2f}x")
        k, r = _best([_jvp(ours, x, w, g), _jvp(theirs, x, w, g)], args.reps, sync)
        print(f"{f'jvp {name} [{args.rows}, {h}]':<48} {k * 1e3:>9.2f} {r * 1e3:>9.2f} {r / k:>7.2f}x")
        k, r = _best([_forward_ad(ours, x, w, g), _forward_ad(theirs, x, w, g)], args.reps, sync)
        print(f"{f'forward_ad {name}, weight requires grad':<48} {k * 1e3:>9.2f} {r * 1e3:>9.2f} {r / k:>7.2f}x")
        for b, s, c in batches:
            xb, t, wb = randn(b, s, c), randn(s, c), randn(c)
            k, r = _best([_per_example(ours, xb, wb, t), _per_example(theirs, xb, wb, t)], args.reps, sync)
            print(f"{f'per-example grads {name} {b} x [{s}, {c}]':<48} {k * 1e3:>9.2f} {r * 1e3:>9.2f} {r / k:>7.2f}x")
        r_, c = min(args.rows, 64), min(h, 512)
        xs, t, v, ws = randn(r_, c), randn(r_, c), randn(r_, c), randn(c)
        k, r = _best([_hvp(ours, xs, ws, t, v), _hvp(theirs, xs, ws, t, v)], args.reps, sync)
        print(f"{f'hessian-vector product {name} [{r_}, {c}]':<48} {k * 1e3:>9.2f} {r * 1e3:>9.2f} {r / k:>7.2f}x")


if __name__ == "__main__":
    main()
