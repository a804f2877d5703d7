"""The timing the two-process gloo examples share (``dtensor_cross_entropy.py``,
``tensor_parallel_swiglu.py``): run from ``examples/``'s scripts, which find it
beside them."""
import statistics
import time

import torch

ROUNDS = 5


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
