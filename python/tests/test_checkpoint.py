"""Activation checkpointing and saved-tensor hooks around Keel's ops: the
gradients are those of the plain run.

Non-reentrant checkpointing (``use_reentrant=False``, what FSDP's activation
checkpointing and Hugging Face's ``gradient_checkpointing_kwargs`` use) stops
its recomputation early by raising ``_StopRecomputationError`` from a
saved-tensor hook and catching it by type. Keel's formula saves its tensors
inside the op's Python autograd kernel, so that exception must reach the
checkpoint as itself. Under torch 2.13-2.15 a Rust autograd kernel, between
the op and its Python formula until session 33, raised it again as a
RuntimeError, and every such backward failed."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import keel

ops = torch.ops.keel


class Block(torch.nn.Module):
    """Linear layers and each op with a formula, with parameters, called one of
    the three ways users call them (`how`)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.up, self.mid = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
        self.rms, self.ln, self.rms2 = keel.nn.RMSNorm(32), keel.nn.LayerNorm(32), keel.nn.RMSNorm(32)

    def forward(self, x):
        h = self.up(x)
        if self.how == "modules":
            h = keel.silu_and_mul(self.ln(self.rms(h)))
            s, r = keel.fused_add_rms_norm(self.mid(h), self.mid(h).flip(0), self.rms2.weight)
            return keel.softmax(keel.gelu_and_mul(torch.cat([s, r], -1)), 0.7)
        if self.how == "typed":
            h = keel.rms_norm(h, self.rms.weight)
            h = keel.silu_and_mul(keel.layer_norm(h, self.ln.weight, self.ln.bias))
            s, r = keel.fused_add_rms_norm(self.mid(h), self.mid(h).flip(0), self.rms2.weight)
            return keel.softmax(keel.gelu_and_mul(torch.cat([s, r], -1)), 0.7)
        h = ops.rms_norm(h, self.rms.weight, 1e-6)
        h = ops.silu_and_mul(ops.layer_norm(h, self.ln.weight, self.ln.bias, 1e-5))
        s, r = ops.fused_add_rms_norm(self.mid(h), self.mid(h).flip(0), self.rms2.weight, 1e-6)
        return ops.softmax(ops.gelu_and_mul(torch.cat([s, r], -1), "none"), 0.7)


def _grads(model, x, mode):
    model.zero_grad()
    x = x.detach().requires_grad_()
    if mode == "plain":
        y = model(x)
    elif mode == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            y = model(x)
    else:
        y = checkpoint(model, x, use_reentrant=(mode == "reentrant"))
    target = torch.arange(y.shape[0]) % y.shape[1]
    (keel.cross_entropy(y, target) + y.square().mean()).backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("how", ["modules", "typed", "torch.ops.keel"])
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant", "save_on_cpu"])
def test_gradients_match_the_plain_run(how, mode):
    torch.manual_seed(0)
    model, x = Block(how), torch.randn(6, 16)
    want = _grads(model, x, "plain")
    got = _grads(model, x, mode)
    for g, w in zip(got, want):
        # The same kernels on the same inputs: the same bits.
        torch.testing.assert_close(g, w, rtol=0, atol=0)
