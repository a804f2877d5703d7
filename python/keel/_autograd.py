"""Autograd formulas for Keel's ops.

The stable C ABI cannot build autograd graph nodes, so the formulas are
registered here, once, at import and before any op is used (registering after
first use breaks AOT dispatch), as an ``Autograd`` kernel of Keel's own
(``_autograd_kernel``), on each op itself, in every torch version. The Python
exceptions of the formula (a saved-tensor hook's, as non-reentrant activation
checkpointing raises to stop its recomputation) reach the caller as they are.
Each formula calls the ``_nograd`` twin of the op's backward operator (the
backward operators have autograd kernels of their own, ``_backward_grad``, for
direct calls), except in a backward that must itself be differentiable
(``create_graph=True``): see ``_twice``.
"""
import torch

from . import _backward_grad, _func, _torch_version, _twice
from ._common import acc_dtype, class_weighted, heads_contiguous, mean_over, nograd, schema_defaults

ops = torch.ops.keel


_TWINS = {}


def _twin(name):
    """The ``_nograd`` twin's overload of backward op `name` (its kernels, no
    autograd kernel: the formulas call it with grad mode off)."""
    op = _TWINS.get(name)
    if op is None:
        op = _TWINS[name] = getattr(ops, nograd(name)).default
    return op


def _grad(ctx, i, g):
    """`g` if input `i` needs a gradient, else None."""
    return g if ctx.needs_input_grad[i] else None


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, round_before_weight = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.round_before_weight = round_before_weight


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    if _twice.wanted(grad, x, weight):
        args = (x, weight, ctx.eps, ctx.round_before_weight)
        gx, gw, _, _ = _twice.vjp(_twice.rms_norm, args, (grad,), ctx.needs_input_grad)
        return gx, gw, None, None
    # x as the forward got it: the backward reads a strided one in place too.
    # The same kernel for either rounding: see `keel.rms_norm`.
    gx, gw = _twin("rms_norm_backward")(grad.contiguous(), x, weight, ctx.eps)
    return _grad(ctx, 0, gx), _grad(ctx, 1, gw) if weight is not None else None, None, None


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps = eps


def _layer_norm_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    if _twice.wanted(grad, x, weight, bias):
        gx, gw, gb, _ = _twice.vjp(_twice.layer_norm, (x, weight, bias, ctx.eps), (grad,), ctx.needs_input_grad)
        return gx, gw, gb, None
    gx, gw, gb = _twin("layer_norm_backward")(grad.contiguous(), x, weight, bias, ctx.eps)
    return (
        _grad(ctx, 0, gx),
        _grad(ctx, 1, gw) if weight is not None else None,
        _grad(ctx, 2, gb) if bias is not None else None,
        None,
    )


def _fused_add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, eps, round_before_weight = inputs
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or getattr(ctx, "dual", False)):
        # The sum depends on neither input needing a gradient (only the weight
        # does): it needs none either, as torch's `input + residual` then. But
        # not through `_with_jvp`: a non-differentiable output gets no tangent.
        ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps
    ctx.round_before_weight = round_before_weight
    ctx.set_materialize_grads(False)


def _fused_add_rms_norm_backward(ctx, grad_out, grad_sum):
    s, weight = ctx.saved_tensors
    if grad_out is None and grad_sum is None:
        return None, None, None, None, None
    if _twice.wanted(grad_out, grad_sum, s, weight):
        needs = (True, weight is not None and ctx.needs_input_grad[2], False)
        args = (s, weight, ctx.eps, ctx.round_before_weight)
        gs, gw, _, _ = _twice.vjp(_twice.rms_norm, args, (grad_out,), needs)
        g = grad_sum if gs is None else gs if grad_sum is None else gs + grad_sum
        return _grad(ctx, 0, g), _grad(ctx, 1, g), gw, None, None
    if grad_out is None:
        grad_out = torch.zeros_like(s)
    grad_sum = None if grad_sum is None else grad_sum.contiguous()
    g, gw = _twin("fused_add_rms_norm_backward")(grad_out.contiguous(), grad_sum, s, weight, ctx.eps)
    # input and residual get the same gradient, as one tensor for both, as torch's own
    # add backward returns it: the engine never updates a gradient in place while
    # another reference to it is alive, and for two leaves AccumulateGrad gives each
    # .grad its own tensor (it steals only a gradient that nothing else holds).
    # A clone here cost a 4096x4096 read and a fresh write on every backward, also
    # where neither input is a leaf (a transformer's residual stream).
    return _grad(ctx, 0, g), _grad(ctx, 1, g), _grad(ctx, 2, gw) if weight is not None else None, None, None


def _silu_and_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_and_mul_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    if _twice.wanted(grad, x):
        return tuple(_twice.vjp(_twice.gated, (x,), (grad,), ctx.needs_input_grad))
    return _grad(ctx, 0, _twin("silu_and_mul_backward")(grad.contiguous(), x))


def _gelu_and_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1]


def _gelu_and_mul_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    if _twice.wanted(grad, x):
        gelu = lambda t: _twice.gated(t, ctx.approximate)  # noqa: E731
        return _twice.vjp(gelu, (x,), (grad,), ctx.needs_input_grad)[0], None
    return _grad(ctx, 0, _twin("gelu_and_mul_backward")(grad.contiguous(), x, ctx.approximate)), None


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    if _twice.wanted(grad, y):
        return _grad(ctx, 0, _twice.softmax_backward(grad, y, ctx.scale)), None
    return _grad(ctx, 0, _twin("softmax_backward")(grad.contiguous(), y, ctx.scale)), None


def _cross_entropy_setup(ctx, inputs, output):
    # `output`: the loss and each row's lse, from the twin of cross_entropy_with_lse (`KEEPS`).
    logits, target, ignore_index, label_smoothing, reduction, weight = inputs
    ctx.save_for_backward(logits, target, output[1], weight)
    ctx.args = (ignore_index, label_smoothing, reduction)


def _cross_entropy_backward(ctx, grad):
    logits, target, lse, weight = ctx.saved_tensors
    gw = _ce_weight_grad(ctx, grad, logits, target, weight, lse)
    gt = _ce_target_grad(ctx, grad, logits, target, weight, lse)
    if _twice.wanted(grad, logits, target, weight):
        loss = lambda t: _twice.cross_entropy(t, target, *ctx.args, weight)[0]  # noqa: E731
        return _twice.vjp(loss, (logits,), (grad,), ctx.needs_input_grad)[0], gt, None, None, None, gw
    if not ctx.needs_input_grad[0]:
        return None, gt, None, None, None, gw
    g = _twin("cross_entropy_backward")(grad.contiguous(), logits, target, *ctx.args, lse, weight)
    return g, gt, None, None, None, gw


def _ce_weight_grad(ctx, grad, logits, target, weight, lse):
    """The gradient of the class weights, where they need one (with
    probabilities, ``keel.cross_entropy`` sends such weights here where they
    have the target's dtype; with class indices, always), in float32 (float64
    for float64 logits); `lse` as :func:`_formula_lse` gives it. Probabilities: each row's ``g q_c
    (lse - x_c)`` summed over the rows, ``q = (1 - s) p + s / C``; class
    indices: :func:`_ce_class_weight_grad`."""
    if weight is None or grad is None or not ctx.needs_input_grad[5]:
        return None
    ignore_index, label_smoothing, reduction = ctx.args
    acc = acc_dtype(logits)
    rows, c = logits.shape
    lse = _formula_lse(logits, lse, acc)
    if not target.dtype.is_floating_point:
        args = (ignore_index, label_smoothing, reduction)
        # Logits in their own dtype: read a block of rows at a time, but for a graph of
        # the gradient (double backward), which takes them whole in acc.
        x = logits.to(acc) if torch.is_grad_enabled() else logits
        return _ce_class_weight_grad(grad.to(acc), x, target, weight.to(acc), lse, *args).to(weight.dtype)
    g = _row_grads(grad, reduction, rows, acc)
    # sum_i g_i q_ic d_ic with d = lse - x (each term >= 0: nothing cancels) is
    # s / C d^T g + (1 - s) (p d)^T g: one [N, C] buffer d and two passes over
    # it, not a product of three such buffers summed over the rows (the op's
    # fwd+bwd, [4096, 32000] bfloat16: 1188 -> 942 ms, docs/BENCHMARKS.md).
    d = lse[:, None] - logits  # in acc (type promotion)
    s = label_smoothing
    gw = _row_sums(d, g) * (s / c) if s != 0 else None
    d = d * target if torch.is_grad_enabled() else d.mul_(target)  # in place but for a graph of it
    gp = _row_sums(d, g) * (1.0 - s)
    return (gp if gw is None else gw + gp).to(weight.dtype)


def _formula_lse(logits, lse, acc):
    """Each row's lse in `acc` for the target's and weights' formulas: the op's
    (kept by its forward), or one made here where none is given or where a graph
    of the gradient is being built: the lse ``torch.ops.keel.cross_entropy``
    keeps is no output of the op, so no gradient would reach the logits through
    it (the class-index weights' gradgradcheck fails so)."""
    if lse is None or torch.is_grad_enabled():
        return torch.logsumexp(logits.to(acc), -1)
    return lse.to(acc)


def _row_grads(grad, reduction, rows, acc):
    """Each row's share of the loss's gradient `grad` against probabilities
    (``"mean"`` over all `rows`: none is ignored), in `acc`."""
    g = grad.to(acc) / (rows if reduction == "mean" else 1)
    return g if reduction == "none" else g.expand(rows)


def _row_sums(d, g, block=64):
    """``sum_i g_i d_i`` over the rows of a contiguous ``[N, C]`` `d`: a
    matrix-vector product of each block of `block` rows, those summed. One
    product over all rows adds N terms in a chain: 3.0e-6 relative in float32
    at N = 4096, against 1.9e-7 so (the sum over the rows of ``d * g``, 2.5e-7,
    took 10x the time); measured, session 80."""
    n = d.shape[0]
    k = n // block
    out = None
    if k:
        out = torch.bmm(g[: k * block].reshape(k, 1, block), d[: k * block].view(k, block, -1)).sum(0)[0]
    if k * block < n or out is None:
        rest = torch.mv(d[k * block :].t(), g[k * block :])
        out = rest if out is None else out + rest
    return out


def _ce_target_grad(ctx, grad, logits, target, weight, lse):
    """The gradient of probabilities `target`, where they need one (also
    through ``keel.cross_entropy``, ``_ce_forms.fused``): the loss is
    ``sum_c w_c q_c (lse - x_c)``
    with ``q = (1 - s) p + s / C``, so ``p_c`` takes ``g (1 - s) w_c (lse -
    x_c)`` (``w`` 1 where none), computed in float32 (float64 for float64
    logits), in the target's dtype; `lse` as :func:`_formula_lse` gives it."""
    if grad is None or not ctx.needs_input_grad[1] or not target.dtype.is_floating_point:
        return None
    _, label_smoothing, reduction = ctx.args
    acc = acc_dtype(logits)
    rows = logits.shape[0]
    graph = torch.is_grad_enabled()
    lse = _formula_lse(logits, lse, acc)
    g = _row_grads(grad, reduction, rows, acc)
    # One [N, C] buffer in acc (type promotion), scaled in place but for a graph of it.
    d = lse[:, None] - logits
    scale = (g * (1.0 - label_smoothing))[:, None]
    d = d * scale if graph else d.mul_(scale)
    if weight is not None:
        d = d * weight if graph else d.mul_(weight)
    return d.to(target.dtype)


def _ce_class_weight_grad(grad, x, target, w, lse, ignore_index, label_smoothing, reduction):
    """The gradient in `w` of the class-index loss: row loss ``(1 - s) w_t d +
    s / C sum_c w_c (lse - x_c)``, ``d = lse - x_t``, so ``(1 - s) d`` goes to
    the target's class and ``s / C (lse - x_c)`` to every class, times the row's
    gradient; ``"mean"`` (the sum over ``D = sum w_t``) also takes ``-M / D`` for
    each row from its target's class, ``M`` the loss. All in `lse`'s dtype (`x`
    in its own where the backward is plain: see :func:`_shifted_dot`)."""
    live = target != ignore_index
    t = torch.where(live, target, 0)
    d = torch.where(live, lse - x.gather(1, t[:, None]).squeeze(1).to(lse.dtype), 0.0)
    g = grad if reduction == "none" else grad.expand(x.shape[0])
    if reduction == "mean":
        w_t = torch.where(live, w[t], 0.0)
        g = mean_over(g, w_t.sum())
    g = torch.where(live, g, 0.0)
    c, s = x.shape[1], label_smoothing
    gw = _by_class(w, t, g * (1.0 - s) * d)
    # lse - x_c, each of the size of the loss's terms (W lse - x @ w would leak
    # the logits' offset into the smoothing term, 2^-24 of it in float32).
    if s != 0 and not torch.is_grad_enabled() and type(x) is torch.Tensor and not _twice._compiling():
        # A plain backward in eager mode (the blocks depend on which rows are live,
        # which a traced backward cannot ask): blocks of rows of lse - x in acc, no
        # [N, C] buffer (bfloat16 [2048, 32000], the op's fwd+bwd: 452 -> 119 ms).
        smooth, cols = _shifted_dot(x, lse, live, rows=w if reduction == "mean" else None, cols=g)
        gw = gw + (s / c) * cols
    elif s != 0:
        minus = lse[:, None] - x
        # Ignored rows (lse 0, any x) contribute nothing: masked, not multiplied by 0.
        gw = gw + (s / c) * torch.where(live[:, None], g[:, None] * minus, 0.0).sum(0)
        smooth = minus @ w if reduction == "mean" else None
    if reduction == "mean":
        mean = class_weighted(d, smooth if s != 0 else None, w, target, ignore_index, s, "mean")
        gw = gw - _by_class(w, t, torch.where(live, g * mean, 0.0))
    return gw


def _by_class(w, t, v):
    """``v`` (one value per row) added up by the rows' class ``t``, shaped like
    `w`. A ``scatter_add``, not ``index_add_``, which torch 2.10's DTensor has no
    sharding rule for."""
    return torch.zeros_like(w).scatter_add(0, t, v)


def _shifted_dot(x, lse, live, rows=None, cols=None):
    """Products of ``m = lse[:, None] - x`` (in lse's dtype), rows not `live` left
    out whatever their logits, taken a block of rows at a time, so that no ``[N, C]``
    buffer is made: ``(m @ rows, cols @ m)`` (one value per row, 0 where not live;
    one per class, the blocks' sums added pairwise, which keeps float32's error
    at that of short chains, as :func:`_row_sums`), each where asked. Blocks of about 4 MB of
    float32; ``lse - x`` is one pass over a block (torch promotes and subtracts
    at once)."""
    n, c = x.shape
    keep = None
    if not bool(live.all()):
        keep = live.nonzero().squeeze(1)
        x, lse = x.index_select(0, keep), lse.index_select(0, keep)
        cols = None if cols is None else cols.index_select(0, keep)
    block = min(max(2**20 // max(c, 1), 8), 1024)
    by_row, pending = [], []  # pending: (level, partial sum of 2^level blocks)
    for i in range(0, x.shape[0], block):
        m = lse[i : i + block, None] - x[i : i + block]
        if rows is not None:
            by_row.append(m @ rows)
        if cols is not None:
            level, part = 0, cols[i : i + block] @ m
            # Pairwise: the blocks' sums added as a binary tree, log2 of them deep.
            while pending and pending[-1][0] == level:
                part = pending.pop()[1] + part
                level += 1
            pending.append((level, part))
    by_col = None
    for _, part in reversed(pending):
        by_col = part if by_col is None else by_col + part
    if cols is not None and by_col is None:
        by_col = lse.new_zeros(c)
    if rows is None:
        return None, by_col
    by_row = torch.cat(by_row) if by_row else lse.new_zeros(0)
    if keep is not None:
        by_row = lse.new_zeros(n).index_copy_(0, keep, by_row)
    return by_row, by_col


def _cross_entropy_lse_setup(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, reduction, weight = inputs
    ctx.save_for_backward(logits, target, output[1], weight)
    ctx.args = (ignore_index, label_smoothing, reduction)
    ctx.set_materialize_grads(False)


def _cross_entropy_lse_backward(ctx, grad, grad_lse):
    logits, target, lse, weight = ctx.saved_tensors
    gw = _ce_weight_grad(ctx, grad, logits, target, weight, lse)
    gt = _ce_target_grad(ctx, grad, logits, target, weight, lse)
    if not ctx.needs_input_grad[0] or (grad is None and grad_lse is None):
        return None, gt, None, None, None, gw
    if _twice.wanted(grad, grad_lse, logits, target, weight):
        both = lambda t: _twice.cross_entropy(t, target, *ctx.args, weight)  # noqa: E731
        return _twice.vjp(both, (logits,), (grad, grad_lse), ctx.needs_input_grad)[0], gt, None, None, None, gw
    g = None
    if grad is not None:
        # The forward's lse: each row of logits is read once.
        g = _twin("cross_entropy_backward")(grad.contiguous(), logits, target, *ctx.args, lse, weight)
    if grad_lse is not None:
        # d lse / d x = softmax(x) (for a z-loss, say); an ignored row's lse is the constant 0.
        # (With probabilities as the target, no row is ignored.)
        live = 1.0 if target.dtype.is_floating_point else (target != ctx.args[0]).to(lse.dtype)
        # softmax, not exp(logits - lse): lse's rounding would be a relative error
        # of every probability, 2^-24 |lse| in float32.
        p = torch.softmax(logits.to(lse.dtype), -1) * (grad_lse.to(lse.dtype) * live)[:, None]
        g = p.to(logits.dtype) if g is None else (g.to(lse.dtype) + p).to(logits.dtype)
    return g, gt, None, None, None, gw


def _rotary_setup(ctx, inputs, output):
    x, cos, sin, interleaved = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.interleaved = interleaved


def _rotary_pairs(t, half, interleaved):
    """The two members of each rotated pair of `t[..., :2 half]`."""
    if interleaved:
        return t[..., 0 : 2 * half : 2], t[..., 1 : 2 * half : 2]
    return t[..., :half], t[..., half : 2 * half]


def _rotary_backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    if _twice.wanted(grad, x, cos, sin):
        return tuple(_twice.vjp(_twice.rotary, (x, cos, sin, ctx.interleaved), (grad,), ctx.needs_input_grad))
    grad = heads_contiguous(grad)
    gx = _twin("rotary_embedding_backward")(grad, cos, sin, ctx.interleaved) if ctx.needs_input_grad[0] else None
    gcos = gsin = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        # d(a cos - b sin, b cos + a sin): summed over batch and heads, in f32 (f64 for f64).
        half = cos.shape[-1]
        acc = acc_dtype(x)
        a, b = (t.to(acc) for t in _rotary_pairs(x, half, ctx.interleaved))
        ga, gb = (t.to(acc) for t in _rotary_pairs(grad, half, ctx.interleaved))
        gcos = (ga * a + gb * b).sum((0, 2)).to(cos.dtype) if ctx.needs_input_grad[1] else None
        gsin = (gb * a - ga * b).sum((0, 2)).to(sin.dtype) if ctx.needs_input_grad[2] else None
    return gx, gcos, gsin, None


FORMULAS = {
    "rms_norm": (_rms_norm_backward, _rms_norm_setup),
    "layer_norm": (_layer_norm_backward, _layer_norm_setup),
    "fused_add_rms_norm": (_fused_add_rms_norm_backward, _fused_add_rms_norm_setup),
    "silu_and_mul": (_silu_and_mul_backward, _silu_and_mul_setup),
    "gelu_and_mul": (_gelu_and_mul_backward, _gelu_and_mul_setup),
    "softmax": (_softmax_backward, _softmax_setup),
    "cross_entropy": (_cross_entropy_backward, _cross_entropy_setup),
    "cross_entropy_with_lse": (_cross_entropy_lse_backward, _cross_entropy_lse_setup),
    "rotary_embedding": (_rotary_backward, _rotary_setup),
}
"""Each differentiable op's (backward, setup_context)."""

WITH_TWIN = {**FORMULAS, **_backward_grad.FORMULAS}
"""Every op with an autograd kernel and a ``_nograd`` twin: the differentiable
ops and their backward ops (Rust's ``WITH_AUTOGRAD`` in ``ops/src/registry.rs``
lists the same)."""

KEEPS = {"cross_entropy": "cross_entropy_with_lse"}
"""Ops whose formula runs another op's twin, of the same arguments, and
returns the first of its results: ``torch.ops.keel.cross_entropy`` called
where a gradient is wanted keeps each row's lse as its ``_with_lse`` twin does
(``[N]`` float32), so the backward reads each row of logits once and the
target's and weights' formulas take it, as through ``keel.cross_entropy``
(docs/BENCHMARKS.md session 81)."""


_LIB = None

APPLY = {}
"""Each differentiable op's formula, ``apply`` of its autograd.Function (filled
by :func:`register`): called with the op's arguments (trailing ones equal to
their defaults may be left out, as the dispatcher does), it runs the op's
``_nograd`` twin and records the backward, as the op's autograd kernel does
where an argument requires a gradient. The typed API calls it directly in
eager grad mode (``functional._call``), without the dispatcher's trip through
the op's autograd kernel."""


def _autograd_kernel(name, backward, setup):
    """The ``Autograd`` kernel of op `name`: where an argument requires a gradient, the formula
    (an autograd.Function whose forward calls the ``_nograd`` twin, the same
    kernels); else the ``_nograd`` twin at once.

    What ``torch.library.register_autograd`` registers does the same, and
    ``_nograd`` is how this avoids its costs: it calls the op again below
    autograd with a context manager and a redispatch, after filling in the
    defaults through the schema (``fill_defaults`` reads ``schema.arguments``,
    a new list of new objects, once per argument: 15 us a call for
    cross_entropy's five), and passes a metadata object through ``apply``.
    [1, 64] in grad mode, no argument requiring a gradient (measured, session 31):
    6.02 -> 4.82 us a call.
    """
    public, twin = getattr(ops, name).default, getattr(ops, nograd(name)).default
    arguments = twin._schema.arguments
    # A Python kernel gets keyword-only arguments as keywords: none of Keel's ops has any.
    assert not any(a.kwarg_only for a in arguments), f"keel::{name}: keyword-only arguments"
    # The dispatcher leaves out trailing arguments equal to their defaults.
    defaults = schema_defaults(twin)
    count = len(arguments)
    any_requires_grad = torch._C._any_requires_grad
    fwad = _twice._fwad
    grad_enabled = torch.is_grad_enabled

    # The twin's C function (``OpOverload._op``, what its ``__call__`` calls):
    # the same call without that Python frame.
    call_twin = getattr(twin, "_op", twin)
    keeps = KEEPS.get(name)
    if keeps is not None:
        kept = getattr(ops, nograd(keeps)).default
        assert [a.name for a in kept._schema.arguments] == [a.name for a in arguments], keeps
        call_kept = getattr(kept, "_op", kept)

    def forward(ctx, *args):
        # The typed API leaves out trailing arguments equal to their defaults,
        # as the dispatcher does (`functional._call`).
        out = call_twin(*args) if keeps is None else call_kept(*args)
        if len(args) < count:
            args = args + defaults[len(args) :]
        setup(ctx, args, out)
        return out if keeps is None else out[0]

    formula = type(
        f"KeelBackward_{name}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    apply = APPLY[name] = formula.apply
    dual = _twice.KERNEL_DUALS.get(f"keel::{name}")
    if dual is not None:
        _twice.DUAL_FUNCTIONS[f"keel::{name}"] = _with_jvp(name, formula, forward, defaults, public, dual).apply

    def kernel(*args):
        if fwad._current_level >= 0 and _twice.has_tangent(args):
            # torch would drop the tangents: the op's torch-op version carries them.
            return _torch_version.run(public, twin, name, args + defaults[len(args) :])
        # What the dispatcher left out stays out: torch's parser costs 0.4-0.7 us
        # for each scalar passed (`functional._call`); `apply` fills them in.
        if grad_enabled() and any_requires_grad(*args):
            if _twice.functorch_on():
                # torch.func runs no autograd.Function without setup_context (the formula).
                return _torch_version.run(public, twin, name, args + defaults[len(args) :])
            return apply(*args)
        return call_twin(*args)

    return kernel


def _with_jvp(name, formula, forward, defaults, public, dual):
    """Op `name`'s `formula` (its forward `forward`) with a ``jvp``: the
    tangents of ``_twice.KERNEL_DUALS``' `dual` (how many leading arguments may
    carry one, the tangent function), recording a graph (``_twice.DUAL_FUNCTIONS``).
    Applied to dual arguments, torch runs the forward on the primals, saves the
    inputs with their tangents for the backward (so a gradient taken inside the
    level carries a tangent: ``_twice.wanted``) and calls the ``jvp`` at once:
    it takes the arguments and output the forward kept, then lets them go (a
    reference to the output on its own node would keep both alive). A tensor
    without a tangent gets None, not a materialised zero (a residual without
    one: a fresh tensor of its size a call). fused_add_rms_norm's sum, which a
    weight alone requiring a gradient leaves without one through the formula
    (as torch's ``input + residual``), requires one here: torch gives no
    tangent to an output marked non-differentiable."""
    leading, tangent = dual

    def dual_forward(ctx, *args):
        ctx.dual = True  # (for the setup: every output carries a tangent)
        out = forward(ctx, *args)
        ctx.set_materialize_grads(False)
        ctx.dual = (args + defaults[len(args) :], out)
        return out

    def jvp(ctx, *tangents):
        args, out = ctx.dual
        del ctx.dual
        return tangent(out, args[:leading], tangents[:leading], args, public, True)

    return type(
        f"KeelDual_{name}", (formula,), {"forward": staticmethod(dual_forward), "jvp": staticmethod(jvp)}
    )


def register() -> None:
    """Registers each op's formula as its ``Autograd`` kernel."""
    global _LIB
    _LIB = torch.library.Library("keel", "IMPL")
    for name, (backward, setup) in WITH_TWIN.items():
        _LIB.impl(name, _autograd_kernel(name, backward, setup), "Autograd")
    _func.register(FORMULAS, KEEPS)
