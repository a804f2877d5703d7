"""Cross-entropy forward + backward of DTensor logits on CPU processes (gloo),
sharded on their rows (``Shard(0)``) or their classes (``Shard(1)``, a
tensor-parallel vocabulary): Keel's typed API, the op itself (which gathers the
logits) and torch's ``F.cross_entropy`` (under ``loss_parallel`` for the classes),
each on the same inputs in one run; prints the median times and the ratios to
torch (torch's time over each call's: above 1, faster than torch).

With ``--2d``: four processes on a ``(2, 2)`` mesh, the rows sharded along its
first dim and the classes along its second (``(Shard(0), Shard(1))``, as torch
2.15's ``loss_parallel`` takes them), the loss a ``"sum"`` (torch's refuses a
``"mean"`` there; Keel's is timed too).

    python examples/dtensor_cross_entropy.py [N V] [--2d]   # default 4096 32000
"""
import contextlib
import datetime
import sys
import tempfile

import torch
import torch.nn.functional as F

import keel

from _gloo_timing import ROUNDS, median_ms


def _timed(fn, ctx, logits, target):
    """Median ms of `fn`'s forward + backward on `logits` under `ctx()`, and the
    loss (whole)."""

    def step():
        x = logits.detach().requires_grad_()
        with ctx():
            loss = fn(x, target)
            loss.backward()
        return loss

    return median_ms(step), step().full_tensor().item()


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
                ms, loss = _timed(fn, ctx or (loss_parallel if dim == 1 else contextlib.nullcontext), d, t)
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


def _worker_2d(rank, tmp, n, v):
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=600)
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2, 2))
    target = distribute_tensor(torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1)), mesh, [Shard(0), Replicate()])
    calls = {
        "keel.cross_entropy sum": (lambda x, t: keel.cross_entropy(x, t, reduction="sum"), contextlib.nullcontext),
        "torch F.cross_entropy sum": (lambda x, t: F.cross_entropy(x, t, reduction="sum"), loss_parallel),
        "torch.ops.keel.cross_entropy sum (gathers)": (lambda x, t: torch.ops.keel.cross_entropy(x, t, reduction="sum"), contextlib.nullcontext),
        "keel.cross_entropy mean": (keel.cross_entropy, contextlib.nullcontext),
    }
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0)).to(dtype)
        d = distribute_tensor(logits, mesh, [Shard(0), Shard(1)])
        for name, (fn, ctx) in calls.items():
            ms, loss = _timed(fn, ctx, d, target)
            rows.append((str(dtype).split(".")[1], name, ms, loss))
    if rank == 0:
        print(f"[{n}, {v}] logits (Shard(0), Shard(1)) over a (2, 2) mesh of gloo ranks, one torch thread each; "
              f"forward + backward, median of {ROUNDS}")
        print("| dtype | call | ms | torch ms / ms | loss |")
        print("|---|---|---|---|---|")
        torch_ms = {r[0]: r[2] for r in rows if r[1].startswith("torch F")}
        for dt, name, ms, loss in rows:
            print(f"| {dt} | {name} | {ms:.0f} | {torch_ms[dt] / ms:.2f}x | {loss:.6f} |")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--2d"]
    n, v = (int(a) for a in args[:2]) if len(args) > 1 else (4096, 32000)
    worker, ranks = (_worker_2d, 4) if "--2d" in sys.argv else (_worker, 2)
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.start_processes(worker, args=(tmp, n, v), nprocs=ranks, start_method="spawn")
