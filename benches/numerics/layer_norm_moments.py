"""How accurate are the CUDA layer_norm forward's moments? A float32 model of
the kernel's arithmetic in numpy, against float64, for the current kernel and
the two variants on branches (docs/GPU.md, "The next run"; figures in
docs/BENCHMARKS.md, session 32).

    python benches/numerics/layer_norm_moments.py   # a second

Each of 128 threads takes its elements as the 16-byte vector loop does (pack
t, t + 128, ... of 4 float32) and sums them in that order, in float32; the
block's sums are exact here (the kernels' tree of warp shuffles adds at most
a few roundings, the same for every scheme). Printed: the largest and mean
relative error of the row variance over 8 rows of 4096.

- per-thread (the current kernel, `thr` 0.5; exp/ln-fwd-loose, 0.9375): each
  thread's sums about its first element, re-read about its own mean where
  d1^2 > thr * s2 / n, then combined as Chan et al.;
- row shift (exp/ln-fwd-rowshift, as the backward): every thread's sums about
  the mean of the row's first 16 elements, once more about k + m1 where
  m1^2 > m2 / 2.
"""
import numpy as np

F32 = np.float32
THREADS, N = 128, 4


def _thread_elems(xr):
    packs = len(xr) // N
    for t in range(THREADS):
        idx = [p * N + j for p in range(t, packs, THREADS) for j in range(N)]
        if idx:
            yield xr[idx]


def per_thread(xr, thr):
    ns, means, m2s = [], [], []
    for v in _thread_elems(xr):
        k, s1, s2 = v[0], F32(0), F32(0)
        for e in v:
            d = F32(e - k)
            s1, s2 = F32(s1 + d), F32(F32(d * d) + s2)
        n = F32(len(v))
        d1 = F32(s1 / n)
        mean_t = F32(k + d1)
        if F32(d1 * d1) <= F32(thr) * F32(s2 / n):
            m2 = F32(s2 - F32(s1 * d1))
        else:
            m2 = F32(0)
            for e in v:
                d = F32(e - mean_t)
                m2 = F32(F32(d * d) + m2)
        ns.append(n), means.append(mean_t), m2s.append(m2)
    ns, means, m2s = (np.array(a, F32) for a in (ns, means, m2s))
    mean = F32(np.sum((ns * means).astype(np.float64)) / len(xr))
    dm = (means - mean).astype(F32)
    return F32(np.sum((m2s + ns * dm * dm).astype(np.float64)) / len(xr))


def row_shift(xr):
    k = F32(np.sum(xr[:16]) / F32(16))
    for p in range(2):
        s1s, s2s = [], []
        for v in _thread_elems(xr):
            s1, s2 = F32(0), F32(0)
            for e in v:
                d = F32(e - k)
                s1, s2 = F32(s1 + d), F32(F32(d * d) + s2)
            s1s.append(s1), s2s.append(s2)
        m1 = F32(F32(np.sum(np.array(s1s, np.float64))) / len(xr))
        m2 = F32(F32(np.sum(np.array(s2s, np.float64))) / len(xr))
        m1m1 = F32(m1 * m1)
        if p == 0 and not m1m1 <= F32(0.5) * m2:
            k = F32(k + m1)
            continue
        return F32(m2 - m1m1)


def main():
    rng = np.random.default_rng(0)
    rows = {
        "randn": rng.standard_normal((8, 4096)),
        "randn + 1000": rng.standard_normal((8, 4096)) + 1000,
        "randn * 1e-3 + 1": rng.standard_normal((8, 4096)) * 1e-3 + 1,
        "Student t, 2 degrees": rng.standard_t(2, (8, 4096)),
        "randn, every 512th channel 300": np.where(np.arange(4096) % 512 == 0, 300.0, 0) + rng.standard_normal((8, 4096)),
    }
    schemes = {"current": lambda r: per_thread(r, 0.5), "loose": lambda r: per_thread(r, 0.9375), "rowshift": row_shift}
    print("| rows | " + " | ".join(schemes) + " |")
    print("|---|" + "---|" * len(schemes))
    for name, x in rows.items():
        x = x.astype(F32)
        cells = []
        for f in schemes.values():
            errs = [abs(float(f(r)) - np.var(r.astype(np.float64))) / np.var(r.astype(np.float64)) for r in x]
            cells.append(f"{max(errs):.1e} (mean {np.mean(errs):.1e})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
