"""Cross-entropy forward + backward of DTensor logits on two CPU processes (gloo),
sharded on their rows (``Shard(0)``) or their classes (``Shard(1)``, a
tensor-parallel vocabulary): Keel's typed API, the op itself (which gathers the
logits) and torch's ``F.cross_entropy`` (under ``loss_parallel`` for the classes),
each on the same inputs in one run; prints the median times and the ratios to
torch (torch's time over each call's: above 1, faster than torch).

    python examples/dtensor_cross_entropy.py [N V]   # default 4096 32000
"""
import contextlib
import datetime
import sys
import tempfile

import torch
import torch.nn.functional as F

import keel

from _gloo_timing import ROUNDS, median_ms


def _worker(rank, tmp, n, v):
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,))
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    calls = {
        "keel.cross_entropy": (keel.cross_entropy, contextlib.nullcontext),
        "torch F.cross_entropy": (F.cross_entropy, None),
        "torch.ops.keel.cross_entropy (gathers)": (torch.ops.keel.cross_entropy, contextlib.nullcontext),
    }
    rows = []
    for dim in (0, 1):
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0)).to(dtype)
            d = distribute_tensor(logits, mesh, [Shard(dim)])
            t = distribute_tensor(target, mesh, [Shard(0) if dim == 0 else Replicate()])
            for name, (fn, ctx) in calls.items():
                ctx = ctx or (loss_parallel if dim == 1 else contextlib.nullcontext)

                def step():
                    x = d.detach().requires_grad_()
                    with ctx():
                        loss = fn(x, t)
                        loss.backward()
                    return loss

                ms = median_ms(step)
                loss = step().full_tensor().item()
                rows.append((f"Shard({dim})", str(dtype).split(".")[1], name, ms, loss))
    if rank == 0:
        print(f"[{n}, {v}] logits over 2 gloo ranks, one torch thread each; forward + backward, median of {ROUNDS}")
        print("| sharded | dtype | call | ms | torch ms / ms | loss |")
        print("|---|---|---|---|---|---|")
        torch_ms = {(r[0], r[1]): r[3] for r in rows if r[2].startswith("torch F")}
        for s, dt, name, ms, loss in rows:
            print(f"| {s} | {dt} | {name} | {ms:.0f} | {torch_ms[(s, dt)] / ms:.2f}x | {loss:.6f} |")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    n, v = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4096, 32000)
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.start_processes(_worker, args=(tmp, n, v), nprocs=2, start_method="spawn")
