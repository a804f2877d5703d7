"""Keel's CPU ops in forked processes, as DataLoader workers are.

Keel's CPU kernels split their work over torch's intra-op pool
(`torch_parallel_for`), not a pool of their own, so a forked child behaves as
it does for torch's own ops: torch's OpenMP pool does not survive a fork, and
a child that runs a parallel op with more than one thread hangs, for
`torch.exp` as for `keel.rms_norm`. DataLoader workers set one thread first
(`torch.set_num_threads(1)`), and so must any other forked child. These tests
check that Keel needs nothing more: the ops run in such children after the
parent ran them on its pool, and give the parent's results.
"""
import multiprocessing
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import keel

pytestmark = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="this platform has no fork"
)

# Large enough that the parent's calls split over torch's threads.
ROWS, COLS = 2048, 1024


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, COLS, generator=g)
    return x, torch.randn(COLS, generator=g), torch.randint(0, COLS, (ROWS,), generator=g)


def _ops(x, w, t):
    """One call of each op family, as a tuple of tensors."""
    return (
        keel.rms_norm(x, w, 1e-6),
        keel.layer_norm(x, w, None, 1e-5),
        keel.softmax(x),
        keel.silu_and_mul(x),
        keel.cross_entropy(x, t),
    )


class _Batches(Dataset):
    """Item i: the ops on the rows of batch i (a quarter of the inputs)."""

    def __init__(self, x, w, t):
        self.x, self.w, self.t = x, w, t

    def __len__(self):
        return 4

    def __getitem__(self, i):
        rows = slice(i * ROWS // 4, (i + 1) * ROWS // 4)
        return _ops(self.x[rows], self.w, self.t[rows])


def test_dataloader_fork_workers_run_keel_ops_after_the_parent_did():
    x, w, t = _inputs()
    batches = _Batches(x, w, t)
    want = [batches[i] for i in range(len(batches))]  # here, on the parent's threads
    loader = DataLoader(
        batches, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120
    )
    got = list(loader)
    assert len(got) == 4
    for i, (g, e) in enumerate(zip(got, want)):
        for a, b in zip(g, e):
            # Row-wise kernels: a row's result does not depend on how many threads ran.
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m: f"batch {i}: {m}")


def test_forked_child_with_one_thread_runs_keel_ops():
    x, w, t = _inputs()
    want = _ops(x, w, t)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        ok = b"0"
        try:
            import signal

            signal.alarm(120)
            torch.set_num_threads(1)
            got = _ops(x, w, t)
            ok = b"1" if all(torch.equal(a, b) for a, b in zip(got, want)) else b"2"
        finally:
            os.write(write, ok)
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    result = os.read(read, 1)
    os.close(read)
    assert os.WIFEXITED(status), f"the child died: wait status {status}"
    assert result == b"1", {b"0": "the child raised", b"2": "the child's results differ"}.get(result, result)
