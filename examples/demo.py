"""Checks each Keel op against torch and prints its time beside torch's.

For each op: the max error of Keel and of torch against an f64 reference (Keel
must be within the dtype's tolerance), then the medians of interleaved timings
(keel, torch, clone, keel, ...) from one run, so the ratios compare like with
like under the same machine load. Torch's side is the eager expression the op
replaces. `clone` copies the op's inputs into fresh tensors: the floor for an
op that returns new tensors (allocation, page faults, one write).
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import keel


def interleaved(fns, reps=21):
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def cases(device, dtype):
    """(name, shape, keel fn, torch fn, f64 reference fn, inputs)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    n = 4096
    x, r, w, b = rnd(n, n), rnd(n, n), rnd(n), rnd(n)
    xg = rnd(n, 2 * n)
    d = n

    def dbl(*ts):
        return [t.double() for t in ts]

    def fused_torch(x, r, w):
        s = x + r
        return F.rms_norm(s, (n,), w, 1e-6), s

    # cross_entropy forward + backward on [4096, 32000]; every 8th row ignored.
    logits = rnd(n, 32000)
    tgt = torch.randint(0, 32000, (n,), generator=g)
    tgt[::8] = -100
    tgt = tgt.to(device)

    def ce_fwd_bwd(f, z):
        z = z.detach().requires_grad_()
        loss = f(z, tgt)
        (grad,) = torch.autograd.grad(loss, z)
        return loss, grad

    # rotary_embedding on q [4, 1024, 32, 128] with Llama's angles (NeoX layout).
    q = rnd(4, 1024, 32, 128)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    ang = torch.outer(torch.arange(1024, dtype=torch.float64), inv)
    cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)

    def rope_torch(q, cos, sin):
        c, s_ = cos[None, :, None, :], sin[None, :, None, :]
        q1, q2 = q[..., :64], q[..., 64:]
        return torch.cat([q1 * c - q2 * s_, q2 * c + q1 * s_], -1)

    return [
        ("rms_norm", "4096x4096", lambda: torch.ops.keel.rms_norm(x, w, 1e-6),
         lambda: F.rms_norm(x, (n,), w, 1e-6), lambda: F.rms_norm(*dbl(x), (n,), *dbl(w), 1e-6), [x]),
        ("layer_norm", "4096x4096", lambda: torch.ops.keel.layer_norm(x, w, b, 1e-5),
         lambda: F.layer_norm(x, (n,), w, b, 1e-5), lambda: F.layer_norm(*dbl(x), (n,), *dbl(w, b), 1e-5), [x]),
        ("fused_add_rms_norm", "4096x4096", lambda: torch.ops.keel.fused_add_rms_norm(x, r, w, 1e-6),
         lambda: fused_torch(x, r, w),
         lambda: (F.rms_norm((x + r).double(), (n,), w.double(), 1e-6), (x + r).double()), [x, r]),
        ("silu_and_mul", "4096x8192", lambda: torch.ops.keel.silu_and_mul(xg),
         lambda: F.silu(xg[:, :d]) * xg[:, d:], lambda: F.silu(xg.double()[:, :d]) * xg.double()[:, d:], [xg]),
        ("gelu_and_mul", "4096x8192", lambda: torch.ops.keel.gelu_and_mul(xg, "none"),
         lambda: F.gelu(xg[:, :d]) * xg[:, d:], lambda: F.gelu(xg.double()[:, :d]) * xg.double()[:, d:], [xg]),
        ("gelu_and_mul tanh", "4096x8192", lambda: torch.ops.keel.gelu_and_mul(xg, "tanh"),
         lambda: F.gelu(xg[:, :d], approximate="tanh") * xg[:, d:],
         lambda: F.gelu(xg.double()[:, :d], approximate="tanh") * xg.double()[:, d:], [xg]),
        ("softmax", "4096x4096", lambda: torch.ops.keel.softmax(x, 1.0),
         lambda: torch.softmax(x, -1), lambda: torch.softmax(x.double(), -1), [x]),
        ("cross_entropy f+b", "4096x32000", lambda: ce_fwd_bwd(keel.cross_entropy, logits),
         lambda: ce_fwd_bwd(F.cross_entropy, logits), lambda: ce_fwd_bwd(F.cross_entropy, logits.double()), [logits]),
        ("rotary_embedding", "4x1024x32x128", lambda: torch.ops.keel.rotary_embedding(q, cos, sin, False),
         lambda: rope_torch(q, cos, sin), lambda: rope_torch(*dbl(q, cos, sin)), [q]),
    ]


def max_err(out, ref):
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    return max(((o.double() - r).abs().max() / (1 + r.abs().max())).item() for o, r in zip(outs, refs))


def main():
    thp = "--thp" in sys.argv
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, keel {keel.__version__}"
          f"{', THP_MEM_ALLOC_ENABLE=1' if thp else ''}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    ok = True
    print(f"{'op':18} {'dev':4} {'dtype':8} {'shape':13}  {'err keel':>8} {'err torch':>9}  "
          f"{'keel ms':>8} {'torch ms':>8} {'clone ms':>8}  {'speedup':>7} {'keel/clone':>10}")
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for dtype, tol in [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]:
            for name, shape, kf, tf, rf, inputs in cases(device, dtype):
                ref = rf()
                ek, et = max_err(kf(), ref), max_err(tf(), ref)
                good = ek <= tol
                ok &= good

                def run(f):
                    return lambda: (f(), sync())

                t = interleaved({
                    "keel": run(kf),
                    "torch": run(tf),
                    "clone": run(lambda: [i.clone() for i in inputs]),
                })
                print(f"{name:18} {device:4} {str(dtype)[6:]:8} {shape:13}  {ek:8.1e} {et:9.1e}  "
                      f"{t['keel']:8.2f} {t['torch']:8.2f} {t['clone']:8.2f}  "
                      f"{t['torch'] / t['keel']:6.2f}x {t['keel'] / t['clone']:10.2f}{'' if good else '  BAD'}")
                del ref
    if not torch.cuda.is_available():
        print("cuda: skipped (torch.cuda.is_available() is False on this machine)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
