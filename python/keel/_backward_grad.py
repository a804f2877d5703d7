"""The derivatives of Keel's backward operators (``keel::rms_norm_backward`` ...).

Keel's own formulas call a backward op's ``_nograd`` twin, only with grad mode
off (a backward that must record a graph takes ``_twice`` instead). These are
for a backward op called directly, through ``torch.ops.keel``, on inputs that
need a gradient: without an autograd kernel of its own, torch's fallback gave
such a call's inputs no gradient at all, with only a warning.

Each backward op's autograd kernel is built as the forward ops' are
(``_autograd._autograd_kernel``): where an argument requires a gradient, an
autograd.Function whose forward runs the twin (Keel's kernels: the values do
not depend on whether a gradient is wanted) and whose backward differentiates
the backward op written in torch's differentiable ops (:data:`REFS`: each
gradient in closed form, in Keel's accumulation dtype, so that no autograd runs
inside it and ``torch.func`` transforms and forward-mode AD take it too:
``_torch_version``). That backward records a graph where one is wanted, so
derivatives of any order follow.

``cross_entropy_backward``'s ``lse`` is a cache of each row's log-sum-exp of
the logits (the kernel recomputes it where its rounding would cost accuracy):
the op's value does not depend on it, so it gets no gradient, and the logits'
gradient is that of the op with the lse as their function.
"""
import math

import torch
import torch.nn.functional as F

from . import _twice
from ._common import acc_dtype, mean_over, plus, times


def _rows(t):
    """`t`'s values summed over every dim but the last (a parameter's gradient)."""
    return t.reshape(-1, t.shape[-1]).sum(0)


def _rms_norm(grad_out, x, weight, eps):
    # y = a r w, r = (mean(a^2) + eps)^-1/2: dx = r gy - a r^3 mean(gy a), gy = g w.
    acc = acc_dtype(x)
    a, g = x.to(acc), grad_out.to(acc)
    r = torch.rsqrt(plus(a.square().mean(-1, keepdim=True), eps))
    gy = g if weight is None else g * weight.to(acc)
    gx = r * gy - a * r.pow(3) * (gy * a).mean(-1, keepdim=True)
    gw = None if weight is None else _rows(g * a * r).to(x.dtype)
    return gx.to(x.dtype), gw


def _layer_norm(grad_out, x, weight, bias, eps):
    # xhat = c r, c = a - mean(a) (centred twice, as the kernel and _twice do):
    # dx = r (gy - mean(gy) - xhat mean(gy xhat)), gy = g w.
    acc = acc_dtype(x)
    a, g = x.to(acc), grad_out.to(acc)
    c = a - a.mean(-1, keepdim=True)
    c = c - c.mean(-1, keepdim=True)
    r = torch.rsqrt(plus(c.square().mean(-1, keepdim=True), eps))
    xhat = c * r
    gy = g if weight is None else g * weight.to(acc)
    gx = r * (gy - gy.mean(-1, keepdim=True) - xhat * (gy * xhat).mean(-1, keepdim=True))
    gw = None if weight is None else _rows(g * xhat).to(x.dtype)
    gb = None if bias is None else _rows(g).to(x.dtype)
    return gx.to(x.dtype), gw, gb


def _fused_add_rms_norm(grad_out, grad_sum, s, weight, eps):
    gs, gw = _rms_norm(grad_out, s, weight, eps)
    return (gs if grad_sum is None else gs + grad_sum), gw


def _gated(grad_out, x, act):
    """``(g b act'(a), g act(a))`` for ``x = (a, b)``; `act` gives (act, act')."""
    acc = acc_dtype(x)
    a, b = x.to(acc).chunk(2, -1)
    g = grad_out.to(acc)
    f, df = act(a)
    return (torch.cat([g * b * df, g * f], -1).to(x.dtype),)


def _silu(a):
    s = torch.sigmoid(a)
    return a * s, s * plus(a * (1 - s), 1)


def _gelu(a):
    cdf = times(plus(torch.erf(times(a, math.sqrt(0.5))), 1), 0.5)
    return a * cdf, cdf + times(a * torch.exp(times(a, -0.5) * a), 1 / math.sqrt(2 * math.pi))


def _gelu_tanh(a):
    # The kernels' sigmoid form: a sigmoid(2u), u = sqrt(2/pi) (a + 0.044715 a^3).
    k = 2 * math.sqrt(2 / math.pi)
    s = torch.sigmoid(times(a + times(a, 0.044715) * a * a, k))
    return a * s, s + times(a * s * (1 - s), k) * plus(times(a, 3 * 0.044715) * a, 1)


def _silu_and_mul(grad_out, x):
    return _gated(grad_out, x, _silu)


def _gelu_and_mul(grad_out, x, approximate="none"):
    return _gated(grad_out, x, _gelu_tanh if approximate == "tanh" else _gelu)


def _softmax(grad_out, y, scale):
    return (_twice.softmax_backward(grad_out, y, scale),)


def _cross_entropy(grad, logits, target, ignore_index, label_smoothing, reduction, lse=None, weight=None):
    """Each row's ``dl/dx_c = p_c sum_k w_k q_k - w_c q_c`` times its share of
    `grad`: ``q = (1 - s) t + s / C`` for probabilities `t`, ``(1 - s)
    onehot(target) + s / C`` for class indices (0 on ignored rows); ``w`` 1 where
    no weights are given. ``"mean"`` divides by the rows (probabilities) or by the
    sum of the live targets' weights (class indices; NaN where that is 0, as
    torch's loss)."""
    acc = acc_dtype(logits)
    x = logits.to(acc)
    n, c = x.shape
    s = label_smoothing
    w = torch.ones(c, dtype=acc, device=x.device) if weight is None else weight.to(acc)
    g = grad.to(acc)
    if target.dtype.is_floating_point:
        q = plus(times(target.to(acc), 1 - s), s / c)
        g = g / n if reduction == "mean" else g
        live = None
    else:
        live = target != ignore_index
        q = (1 - s) * F.one_hot(torch.where(live, target, 0), c).to(acc) + s / c
        if reduction == "mean":
            g = mean_over(g, torch.where(live, w[torch.where(live, target, 0)], 0.0).sum())
    wq = w * q
    rows = torch.softmax(x, -1) * wq.sum(-1, keepdim=True) - wq
    gx = rows * (g[:, None] if g.dim() else g)
    if live is not None:
        gx = torch.where(live[:, None], gx, 0.0)
    return (gx.to(logits.dtype),)


def _rotary(grad_out, cos, sin, interleaved):
    # The backward rotates by the opposite angle: linear in each of its tensors.
    return (_twice.rotary(grad_out, cos, -sin, interleaved),)


REFS = {
    "rms_norm_backward": _rms_norm,
    "layer_norm_backward": _layer_norm,
    "fused_add_rms_norm_backward": _fused_add_rms_norm,
    "silu_and_mul_backward": _silu_and_mul,
    "gelu_and_mul_backward": _gelu_and_mul,
    "softmax_backward": _softmax,
    "cross_entropy_backward": _cross_entropy,
    "rotary_embedding_backward": _rotary,
}
"""Each backward op in torch's differentiable ops: its outputs from all of its
arguments (defaults filled in), None for an output that is an empty stand-in
(a weight's gradient where no weight is given)."""


def _setup(ctx, inputs, output):
    """Saves every argument (the tensors for backward, the others on `ctx`); the
    empty outputs (a missing weight's stand-in) get no gradient."""
    tensors = [a if isinstance(a, torch.Tensor) else None for a in inputs]
    ctx.save_for_backward(*tensors)
    ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
    outs = output if isinstance(output, tuple) else (output,)
    empty = [o for o in outs if o.numel() == 0]
    if empty:
        ctx.mark_non_differentiable(*empty)
    ctx.set_materialize_grads(False)


def _backward_of(ref):
    """The backward of a backward op whose torch version is `ref`: the
    vector-Jacobian product of `ref` at the saved arguments, with a graph where
    one is wanted (``_twice.wanted``)."""

    def backward(ctx, *grads):
        args = [o if t is None else t for t, o in zip(ctx.saved_tensors, ctx.others)]
        graph = _twice.wanted(*grads, *args)
        needs = ctx.needs_input_grad
        result = [None] * len(needs)
        take = [i for i, a in enumerate(args[: len(needs)]) if needs[i] and isinstance(a, torch.Tensor)]
        with torch.enable_grad():
            outs = ref(*args)
        # (An output that depends on no argument needing a gradient has no graph.)
        pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and g is not None and o.requires_grad]
        if take and pairs:
            got = torch.autograd.grad(
                [o for o, _ in pairs],
                [args[i] for i in take],
                [g.to(o.dtype) for o, g in pairs],
                create_graph=graph,
                allow_unused=True,
            )
            for i, g in zip(take, got):
                result[i] = g
        return tuple(result)

    return backward


FORMULAS = {name: (_backward_of(ref), _setup) for name, ref in REFS.items()}
"""Each backward op's (backward, setup_context), as ``_autograd.FORMULAS``."""
