"""What the gloo examples share (``dtensor_cross_entropy.py``,
``tensor_parallel_swiglu.py``): starting the CPU processes, each one's process
group and device mesh, and the timing. Run from ``examples/``'s scripts, which
find it beside them."""
import contextlib
import datetime
import math
import statistics
import tempfile
import time

import torch

ROUNDS = 5


def spawn(worker, ranks, *args):
    """Runs `worker(rank, store, *args)` on `ranks` spawned processes, `store` a
    file for their process group (:func:`mesh`), in a directory removed after."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.start_processes(worker, args=(f"{tmp}/store", *args), nprocs=ranks, start_method="spawn")


@contextlib.contextmanager
def mesh(rank, store, shape):
    """A CPU device mesh of `shape` over a gloo process group of all the ranks
    (one torch thread each); the group is destroyed after, once every rank is
    done."""
    torch.set_num_threads(1)
    world = math.prod(shape)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    from torch.distributed.device_mesh import init_device_mesh

    try:
        yield init_device_mesh("cpu", shape)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def median_ms(fn):
    """Median ms of `fn` over ROUNDS after one warm-up, every rank starting each
    round together (a barrier)."""
    fn()
    times = []
    for _ in range(ROUNDS):
        torch.distributed.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
