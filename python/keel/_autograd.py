"""Autograd formulas for Keel's ops.

The stable C ABI cannot register autograd, so it is done here, once, at import
and before any op is used (registering after first use breaks AOT dispatch).
"""
import torch


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.ops.keel.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps)
    return (
        grad_input if ctx.needs_input_grad[0] else None,
        grad_weight if weight is not None and ctx.needs_input_grad[1] else None,
        None,
    )


def register() -> None:
    torch.library.register_autograd("keel::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
