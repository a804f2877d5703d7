"""Every Keel op called from several Python threads at once, as a threaded server
calls them (torch lets go of the GIL while an op runs): each call gives what the
same call gives alone, bit for bit. In a fresh interpreter, so that the threads'
calls are the process's first (the lazy set-up: torch's thread count, on CUDA
the kernels' module loads, race with each other)."""
import subprocess
import sys

import pytest

from conftest import devices

_SCRIPT = r"""
import sys, threading
import torch
import keel

device = sys.argv[1]
torch.manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(device=device, dtype=dtype)


x, w, b = randn(256, 4096), randn(4096), randn(4096)
xb = randn(256, 4096, dtype=torch.bfloat16)
gate = randn(128, 8192, dtype=torch.bfloat16)
q, cos, sin = randn(2, 64, 8, 128), randn(64, 64), randn(64, 64)
logits, target = randn(64, 32000), torch.randint(0, 32000, (64,), device=device)


def rms_norm_grads():
    xg = x.detach().requires_grad_()
    keel.rms_norm(xg, w).square().sum().backward()
    return xg.grad


def in_place(r):
    h = x.clone()
    keel.fused_add_rms_norm_(h, r, w)
    return torch.cat([h, r])


def rotary_in_place():
    k = q.clone()
    keel.rotary_embedding_(k, cos, sin)
    return k


CALLS = [
    lambda: keel.rms_norm(x, w),
    lambda: keel.rms_norm(xb, w.bfloat16()),
    lambda: keel.layer_norm(x, w, b),
    lambda: torch.cat(keel.fused_add_rms_norm(x, x.flip(0), w)),
    lambda: keel.softmax(xb, 0.5),
    lambda: keel.silu_and_mul(gate),
    lambda: keel.gelu_and_mul(gate),
    lambda: keel.gelu_and_mul(gate, "tanh"),
    lambda: keel.rotary_embedding(q, cos, sin),
    lambda: keel.cross_entropy(logits, target),
    lambda: torch.cat([t.reshape(-1) for t in keel.cross_entropy_with_lse(logits, target)]),
    rms_norm_grads,
    lambda: in_place(x.flip(0).contiguous()),
    rotary_in_place,
]
THREADS, ROUNDS = 4, 5
got = [[None] * len(CALLS) for _ in range(THREADS)]
failed = []
start = threading.Barrier(THREADS)


def work(t):
    try:
        start.wait()
        for r in range(ROUNDS):
            # Each thread in its own order, so that different ops overlap.
            for i in range(len(CALLS)):
                k = (i + t + r) % len(CALLS)
                got[t][k] = CALLS[k]()
        if device == "cuda":
            torch.cuda.synchronize()
    except BaseException as e:  # reported below; a thread's exception is otherwise lost
        failed.append(repr(e))


threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
for th in threads:
    th.start()
for th in threads:
    th.join()
assert not failed, failed
for k, call in enumerate(CALLS):
    want = call()
    for t in range(THREADS):
        assert torch.equal(got[t][k], want), (k, t, (got[t][k] - want).abs().max().item())
print("ok")
"""


@pytest.mark.parametrize("device", devices())
def test_ops_from_several_threads_at_once(device):
    run = subprocess.run([sys.executable, "-c", _SCRIPT, device], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stderr[-3000:])
