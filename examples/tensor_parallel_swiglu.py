"""A tensor-parallel Llama MLP, forward + backward, on two CPU processes (gloo):
``keel.nn.SwiGLU`` (``keel.nn.GateUpColwiseParallel`` on its fused
``gate_up_proj``, ``RowwiseParallel`` on ``down_proj``) against torch's own
plan for the same MLP in three linears (``ColwiseParallel`` on ``gate_proj``
and ``up_proj``, ``RowwiseParallel`` on ``down_proj``, ``F.silu(gate) * up``),
the same weights and inputs in one run. Prints each one's median time, the
ratio (torch's time over Keel's: above 1, Keel is faster) and the largest
difference of the outputs.

    python examples/tensor_parallel_swiglu.py [TOKENS HIDDEN FFN]   # default 2048 1024 2816
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

import keel
import keel.nn

from _gloo import ROUNDS, median_ms, mesh, spawn


class LlamaMLP(nn.Module):
    """Hugging Face's ``LlamaMLP``: three linears."""

    def __init__(self, hidden, ffn, dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _worker(rank, store, tokens, hidden, ffn):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with mesh(rank, store, (2,)) as m:
        rows = []
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            ref = LlamaMLP(hidden, ffn, dtype)
            fused = keel.nn.SwiGLU.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj)
            torch_plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            parallelize_module(ref, m, torch_plan)
            parallelize_module(fused, m, {"gate_up_proj": keel.nn.GateUpColwiseParallel(), "down_proj": RowwiseParallel()})
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
            rows.append((str(dtype).replace("torch.", ""), *_timed(ref, fused, x)))
        if rank == 0:
            print(f"tensor-parallel Llama MLP, [{tokens}, {hidden}] -> {ffn} -> {hidden}, 2 gloo ranks, 1 thread each, "
                  f"forward + backward, median of {ROUNDS} (torch {torch.__version__})")
            print("| dtype | torch (3 linears) ms | keel.nn.SwiGLU ms | torch / keel | max |keel - torch| |")
            print("|---|---|---|---|---|")
            for dtype, t_torch, t_keel, diff in rows:
                print(f"| {dtype} | {t_torch:.1f} | {t_keel:.1f} | {t_torch / t_keel:.2f} | {diff:.2e} |")


def _timed(ref, fused, x):
    """Median ms of `ref`'s and `fused`'s forward + backward on `x`, and the
    largest difference of their outputs."""
    outs = {}

    def step(module, key):
        out = module(x)
        out.sum().backward()
        outs[key] = out.detach() + 0  # waits for the all-reduce

    t_torch = median_ms(lambda: step(ref, "torch"))
    t_keel = median_ms(lambda: step(fused, "keel"))
    diff = (outs["keel"].float() - outs["torch"].float()).abs().max().item()
    return t_torch, t_keel, diff


def main():
    tokens, hidden, ffn = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (2048, 1024, 2816)
    spawn(_worker, 2, tokens, hidden, ffn)


if __name__ == "__main__":
    main()
