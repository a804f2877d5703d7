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
the backward op written in torch's differentiable ops (:data:`REFS`, built on
``_twice``'s forward references, in Keel's accumulation dtype). That backward
records a graph where one is wanted, so derivatives of any order follow.

``cross_entropy_backward``'s ``lse`` is a cache of each row's log-sum-exp of
the logits (the kernel recomputes it where its rounding would cost accuracy):
the op's value does not depend on it, so it gets no gradient, and the logits'
gradient is that of the op with the lse as their function.
"""
import torch
from torch.autograd import forward_ad as fwAD

from . import _twice


def _leaf(t):
    """`t` where it can be differentiated against already (or is no floating-point
    tensor), else a leaf of its own with its values (and its tangent, where it
    carries one: ``_forward_ad``)."""
    if t is None or not t.is_floating_point() or t.requires_grad:
        return t
    primal, tangent = fwAD.unpack_dual(t)
    leaf = primal.detach().requires_grad_()
    return leaf if tangent is None else fwAD.make_dual(leaf, tangent)


def _vjp(fn, inputs, grad):
    """``J^T grad`` of `fn` (one tensor out) at `inputs`, with a graph: a
    function of `grad` and of each floating-point input (:func:`_leaf`); None for
    None inputs, zeros for those `fn` does not read."""
    leaves = [_leaf(t) for t in inputs]
    out = fn(*leaves)
    live = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
    got = torch.autograd.grad(out, [leaves[i] for i in live], grad.to(out.dtype), create_graph=True, allow_unused=True)
    result = [None] * len(inputs)
    for i, g in zip(live, got):
        result[i] = torch.zeros_like(leaves[i]) if g is None else g
    return tuple(result)


def _rms_norm(grad_out, x, weight, eps):
    return _vjp(lambda x, w: _twice.rms_norm(x, w, eps), (x, weight), grad_out)


def _layer_norm(grad_out, x, weight, bias, eps):
    return _vjp(lambda x, w, b: _twice.layer_norm(x, w, b, eps), (x, weight, bias), grad_out)


def _fused_add_rms_norm(grad_out, grad_sum, s, weight, eps):
    gs, gw = _vjp(lambda s, w: _twice.rms_norm(s, w, eps), (s, weight), grad_out)
    return (gs if grad_sum is None else gs + grad_sum), gw


def _silu_and_mul(grad_out, x):
    return _vjp(_twice.gated, (x,), grad_out)


def _gelu_and_mul(grad_out, x, approximate="none"):
    return _vjp(lambda x: _twice.gated(x, approximate), (x,), grad_out)


def _softmax(grad_out, y, scale):
    return (_twice.softmax_backward(grad_out, y, scale),)


def _cross_entropy(grad, logits, target, ignore_index, label_smoothing, reduction, lse=None, weight=None):
    loss = lambda x, t, w: _twice.cross_entropy(x, t, ignore_index, label_smoothing, reduction, w)[0]  # noqa: E731
    return _vjp(loss, (logits, target, weight), grad)[:1]


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
        graph = _twice.wanted()
        args = [o if t is None else t for t, o in zip(ctx.saved_tensors, ctx.others)]
        needs = ctx.needs_input_grad
        result = [None] * len(needs)
        take = [i for i, a in enumerate(args[: len(needs)]) if needs[i] and isinstance(a, torch.Tensor)]
        with torch.enable_grad():
            outs = ref(*args)
        pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and g is not None]
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
