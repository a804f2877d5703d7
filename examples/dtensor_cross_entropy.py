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
import sys

import torch
import torch.nn.functional as F

import keel

from _gloo import ROUNDS, median_ms, mesh, spawn


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


def _table(title, keys, rows):
    """Prints `rows` (`keys`' columns, then the call's name, ms and loss), each
    with the ratio to the torch row of the same keys (torch's ms over its)."""
    k = len(keys)
    torch_ms = {r[:k]: r[k + 1] for r in rows if r[k].startswith("torch F")}
    print(title)
    print("| " + " | ".join(keys) + " | call | ms | torch ms / ms | loss |")
    print("|---" * (k + 4) + "|")
    for r in rows:
        *key, name, ms, loss = r
        print("| " + " | ".join(key) + f" | {name} | {ms:.0f} | {torch_ms[tuple(key)] / ms:.2f}x | {loss:.6f} |")


def _logits(n, v, dtype):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(0)).to(dtype)


def _target(n, v):
    return torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))


def _worker(rank, store, n, v):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    calls = {
        "keel.cross_entropy": (keel.cross_entropy, contextlib.nullcontext),
        "torch F.cross_entropy": (F.cross_entropy, None),
        "torch.ops.keel.cross_entropy (gathers)": (torch.ops.keel.cross_entropy, contextlib.nullcontext),
    }
    with mesh(rank, store, (2,)) as m:
        rows = []
        for dim in (0, 1):
            for dtype in (torch.float32, torch.bfloat16):
                d = distribute_tensor(_logits(n, v, dtype), m, [Shard(dim)])
                t = distribute_tensor(_target(n, v), m, [Shard(0) if dim == 0 else Replicate()])
                for name, (fn, ctx) in calls.items():
                    ms, loss = _timed(fn, ctx or (loss_parallel if dim == 1 else contextlib.nullcontext), d, t)
                    rows.append((f"Shard({dim})", str(dtype).split(".")[1], name, ms, loss))
        if rank == 0:
            _table(
                f"[{n}, {v}] logits over 2 gloo ranks, one torch thread each; forward + backward, median of {ROUNDS}",
                ("sharded", "dtype"),
                rows,
            )


REFUSED_2D = "torch's loss_parallel refuses logits on a 2-D mesh: nothing to compare Keel with"


def _worker_2d(rank, store, n, v):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    calls = {
        "keel.cross_entropy sum": (lambda x, t: keel.cross_entropy(x, t, reduction="sum"), contextlib.nullcontext),
        "torch F.cross_entropy sum": (lambda x, t: F.cross_entropy(x, t, reduction="sum"), loss_parallel),
        "torch.ops.keel.cross_entropy sum (gathers)": (
            lambda x, t: torch.ops.keel.cross_entropy(x, t, reduction="sum"),
            contextlib.nullcontext,
        ),
        "keel.cross_entropy mean": (keel.cross_entropy, contextlib.nullcontext),
    }
    with mesh(rank, store, (2, 2)) as m:
        target = distribute_tensor(_target(n, v), m, [Shard(0), Replicate()])
        rows = []
        for dtype in (torch.float32, torch.bfloat16):
            d = distribute_tensor(_logits(n, v, dtype), m, [Shard(0), Shard(1)])
            for name, (fn, ctx) in calls.items():
                try:
                    ms, loss = _timed(fn, ctx, d, target)
                except ValueError as e:  # every rank alike
                    if not name.startswith("torch F"):
                        raise
                    if rank == 0:
                        print(f"{REFUSED_2D} (torch {torch.__version__}: {e}); torch 2.15's takes them")
                    return
                rows.append((str(dtype).split(".")[1], name, ms, loss))
        if rank == 0:
            _table(
                f"[{n}, {v}] logits (Shard(0), Shard(1)) over a (2, 2) mesh of gloo ranks, one torch thread each; "
                f"forward + backward, median of {ROUNDS}",
                ("dtype",),
                rows,
            )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--2d"]
    n, v = (int(a) for a in args[:2]) if len(args) > 1 else (4096, 32000)
    worker, ranks = (_worker_2d, 4) if "--2d" in sys.argv else (_worker, 2)
    spawn(worker, ranks, n, v)
