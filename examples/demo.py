"""Checks each Keel op against torch and prints its time beside torch's.

Timings are interleaved (keel, torch, clone, keel, ...) and the medians
compared, so the ratios come from one run under the same machine load.
`x.clone()` is the floor for any op returning a new tensor: allocating and
writing the output.
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


def main():
    thp = "--thp" in sys.argv
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, keel {keel.__version__}"
          f"{', THP_MEM_ALLOC_ENABLE=1' if thp else ''}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    ok = True
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
            x = torch.randn(4096, 4096, device=device).to(dtype)
            w = torch.randn(4096, device=device).to(dtype)
            ref = F.rms_norm(x.double(), (4096,), w.double(), 1e-6)
            err = (keel.rms_norm(x, w, 1e-6).double() - ref).abs().max().item()
            good = err <= tol * (1 + ref.abs().max().item())
            ok &= good

            def run(f):
                return lambda: (f(), sync())

            t = interleaved({
                "keel": run(lambda: torch.ops.keel.rms_norm(x, w, 1e-6)),
                "torch": run(lambda: F.rms_norm(x, (4096,), w, 1e-6)),
                "clone": run(lambda: x.clone()),
            })
            print(f"rms_norm {device:4} {str(dtype)[6:]:8} 4096x4096  max|err| {err:.2e} {'OK ' if good else 'BAD'} "
                  f" keel {t['keel']:7.2f} ms  torch {t['torch']:7.2f} ms  clone {t['clone']:7.2f} ms  "
                  f"speedup {t['torch'] / t['keel']:5.2f}x  keel/clone {t['keel'] / t['clone']:4.2f}")
    if not torch.cuda.is_available():
        print("cuda: skipped (torch.cuda.is_available() is False on this machine)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
