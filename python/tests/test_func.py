"""``torch.func``'s reverse-mode transforms through Keel's kernels (``keel._func``):
``grad``, ``vjp``, ``jacrev`` and ``vmap`` of the typed API run the ops' kernels
forward and backward, with the bits of plain autograd; a gradient of a gradient
still goes through the torch-op version, with its values, and forward mode alone
through torch's own op where the op has one."""
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch.func import grad, hessian, jacrev, vjp, vmap

import keel
from conftest import devices, torchs_op_calls
from keel import _func, _twice, _vmap

REFS = (
    "rms_norm",
    "layer_norm",
    "gated",
    "softmax",
    "cross_entropy",
    "cross_entropy_loss",
    "rotary",
    "fused_add_rms_norm",
)
RMS_NORM = torch.ops.keel.rms_norm.default
"""The torch-op versions (``keel._twice``) that the typed API took inside a transform."""


def _cases(device, dtype):
    """name: (function of the float tensors, those tensors)."""
    gen = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)

    x, r, w, b = t(3, 5, 16), t(3, 5, 16), t(16), t(16)
    logits, probs = t(6, 11), torch.softmax(t(6, 11), -1)
    classes = torch.tensor([1, 4, -100, 0, 10, 3], device=device)
    cw = t(11).abs() + 0.5
    q, cs, sn = t(2, 5, 3, 16), t(5, 6), t(5, 6)
    return {
        "rms_norm": (lambda x, w: keel.rms_norm(x, w), (x, w)),
        "rms_norm rounded before the weight": (lambda x, w: keel.rms_norm(x, w, 1e-5, True), (x, w)),
        "layer_norm": (keel.layer_norm, (x, w, b)),
        "fused_add_rms_norm": (lambda x, r, w: keel.fused_add_rms_norm(x, r, w), (x, r, w)),
        "silu_and_mul": (keel.silu_and_mul, (x,)),
        "gelu_and_mul tanh": (lambda x: keel.gelu_and_mul(x, "tanh"), (x,)),
        "softmax": (lambda x: keel.softmax(x, 0.7), (x,)),
        "cross_entropy": (lambda lg: keel.cross_entropy(lg, classes, label_smoothing=0.1), (logits,)),
        "cross_entropy none": (lambda lg: keel.cross_entropy(lg, classes, reduction="none"), (logits,)),
        "cross_entropy weights": (lambda lg, cw: keel.cross_entropy(lg, classes, weight=cw), (logits, cw)),
        "cross_entropy probabilities": (lambda lg, p: keel.cross_entropy(lg, p), (logits, probs)),
        "cross_entropy_with_lse": (lambda lg: keel.cross_entropy_with_lse(lg, classes, reduction="none"), (logits,)),
        "rotary_embedding": (keel.rotary_embedding, (q, cs, sn)),
    }


NAMES = list(_cases("cpu", torch.float32))


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.fixture(autouse=True)
def functions_at_every_size(monkeypatch):
    """The Functions serve these small tensors too (``_func.MIN_ELEMENTS``),
    rather than torch's own ops (``_func.NATIVE``)."""
    monkeypatch.setattr(_func, "MIN_ELEMENTS", {})
    monkeypatch.setattr(_func, "NATIVE", {})
    monkeypatch.setattr(_func, "CUDA_MIN_ELEMENTS", 0)


@pytest.fixture
def no_torch_op_version(monkeypatch):
    """Fails a test whose transform takes the torch-op version of an op, or
    records a graph in a backward (``_twice.vjp``)."""
    for name in (*REFS, "vjp"):
        monkeypatch.setattr(_twice, name, _refuse)


def _refuse(*_, **__):
    """Stands in for the torch-op version where a test refuses it."""
    raise AssertionError("the torch-op version ran")


def _within_one_rounding(a, b):
    """`a` against `b` (zeros where None) within one rounding of `a`'s dtype
    (f32: 1e-5; bf16: 2^-7), of the largest of `b` or 1."""
    b = torch.zeros_like(a) if b is None else b
    tol = 1e-5 if a.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * max(b.float().abs().max().item(), 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", NAMES)
def test_vjp_gives_autograds_bits(name, device, dtype, no_torch_op_version):
    """``torch.func.vjp`` of each op: the outputs and gradients of plain autograd
    through the same op, bit for bit (Keel's forward and backward kernels;
    the torch-op version is refused)."""
    fn, args = _cases(device, dtype)[name]
    leaves = [a.detach().requires_grad_() for a in args]
    want_out = _tuple(fn(*leaves))
    cots = [torch.randn_like(o, dtype=torch.float64).to(o.dtype) for o in want_out]
    want = torch.autograd.grad(want_out, leaves, cots, allow_unused=True)
    out, pull = vjp(fn, *args)
    got = pull(tuple(cots) if isinstance(out, tuple) else cots[0])
    for g, w in zip(_tuple(out), want_out):
        assert torch.equal(g, w.detach())
    for g, w in zip(got, want):
        assert torch.equal(g, torch.zeros_like(g) if w is None else w), name


@pytest.mark.parametrize("device", devices())
def test_grad_and_jacrev_run_keels_kernels(device, no_torch_op_version):
    fn, (x, w) = _cases(device, torch.float32)["rms_norm"]
    gx, gw = grad(lambda x, w: fn(x, w).square().sum(), (0, 1))(x, w)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(fn(xl, wl).square().sum(), (xl, wl))
    assert torch.equal(gx, want[0]) and torch.equal(gw, want[1])
    jac = jacrev(lambda x: fn(x, w))(x[0, :2])
    rows = [torch.autograd.grad(fn(xl[0, :2], w).flatten()[i], xl)[0][0, :2] for i in range(2 * 16)]
    assert torch.equal(jac.flatten(0, 1), torch.stack(rows))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm", "fused_add_rms_norm"])
def test_per_example_gradients_in_one_call(norm, device, no_torch_op_version, monkeypatch):
    """``vmap(grad(loss))`` over examples with shared parameters: each example's
    input and weight gradients, from one call of the forward and of the backward
    kernels (no per-example loop, no performance-drop warning). The input's
    are plain autograd's bits on each example; the weight's are its own sums,
    to 1e-5 (f32, summed in another order)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 32, generator=gen).to(device)
    w, b = torch.randn(32, generator=gen).to(device), torch.randn(32, generator=gen).to(device)
    target = torch.randn(6, 32, generator=gen).to(device)
    fns = {
        "rms_norm": lambda x, w: keel.rms_norm(x, w),
        "layer_norm": lambda x, w: keel.layer_norm(x, w, b),
        "fused_add_rms_norm": lambda x, w: keel.fused_add_rms_norm(x, x * 0.5, w)[0],
    }
    fn = fns[norm]

    def loss(x, w):
        return (fn(x, w) * target).sum()

    monkeypatch.setattr(_vmap, "_loop", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        gx, gw = vmap(grad(loss, (0, 1)), in_dims=(0, None))(x, w)
    for k in range(x.shape[0]):
        xl, wl = x[k].clone().requires_grad_(), w.clone().requires_grad_()
        want_x, want_w = torch.autograd.grad(loss(xl, wl), (xl, wl))
        assert torch.equal(gx[k], want_x)
        torch.testing.assert_close(gw[k], want_w, rtol=1e-5, atol=1e-5)


def _with_and_without_functions(monkeypatch, run):
    """`run()` through ``_func``'s Functions, then through the torch-op version
    alone (``_func.FUNCTIONS`` emptied: what the typed API did before)."""
    got = run()
    monkeypatch.setattr(_func, "FUNCTIONS", {})
    return got, run()


TRANSFORMS = [
    "grad of grad",
    "jacrev of jacrev",
    "hessian",
    "grad of a captured weight",
    "autograd of grad",
    "grad of a pullback",
    "jacrev of a pullback",
    "autograd of a pullback",
]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize(
    "name", ["rms_norm", "layer_norm", "fused_add_rms_norm", "softmax", "cross_entropy weights", "gelu_and_mul tanh"]
)
def test_higher_orders_agree_with_the_torch_op_version(name, transform, monkeypatch):
    """Second derivatives (float64): where the op's gradient is itself
    differentiated (an outer ``grad`` level, a captured tensor's level, autograd
    outside the transforms: the torch-op version serves the op, ``_func.route``)
    or a ``vjp``'s pullback, called later, is (its backward records a graph,
    ``_func.needs_graph``), the results are those of the torch-op version
    alone, to 1e-10."""
    fn, args = _cases("cpu", torch.float64)[name]
    x, rest = args[0], args[1:]
    v = torch.randn_like(x)
    outs = _tuple(fn(*args))
    weights = [torch.randn_like(o) for o in outs]

    def s(x, *rest):
        return sum((o * c).sum() for o, c in zip(_tuple(fn(x, *rest)), weights))

    def run():
        if transform == "grad of grad":
            return grad(lambda x: (grad(s)(x, *rest) * v).sum())(x)
        if transform == "jacrev of jacrev":
            return jacrev(jacrev(lambda x: s(x, *rest)))(x)
        if transform == "hessian":
            return hessian(lambda x: s(x, *rest))(x)
        if transform == "grad of a captured weight":
            if not rest:
                pytest.skip("one tensor argument")
            return grad(lambda r0: (grad(s)(x, r0, *rest[1:]) * v).sum())(rest[0])
        if transform == "autograd of grad":
            xl = x.clone().requires_grad_()
            return torch.autograd.grad((grad(s)(xl, *rest) * v).sum(), xl)[0]
        out, pull = vjp(fn, *args)
        cot = [torch.randn_like(o) for o in _tuple(out)]

        def pulled(c0):  # the gradients against the first cotangent, the others fixed
            c = (c0, *cot[1:])
            return sum((g * v_).sum() for g, v_ in zip(pull(c if isinstance(out, tuple) else c0), args))

        if transform == "grad of a pullback":
            return grad(pulled)(cot[0])
        if transform == "jacrev of a pullback":
            return jacrev(lambda c0: pull((c0, *cot[1:]) if isinstance(out, tuple) else c0)[0])(cot[0])
        cl = cot[0].clone().requires_grad_()
        return torch.autograd.grad(pulled(cl), cl)[0]

    got, want = _with_and_without_functions(monkeypatch, run)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert got.abs().max() > 0


def test_a_plain_gradient_records_no_graph(monkeypatch):
    """``grad`` runs the backward with grad mode on; nothing differentiates it,
    so it runs on Keel's backward kernel, under no_grad."""
    calls = []
    vjp_ = _twice.vjp
    monkeypatch.setattr(_twice, "vjp", lambda *a: calls.append(1) or vjp_(*a))
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    grad(lambda x: keel.rms_norm(x, w).sin().sum())(x)
    vmap(grad(lambda x: keel.rms_norm(x, w).sin().sum()))(x)
    jacrev(lambda x: keel.rms_norm(x, w))(x)
    assert not calls
    _, pull = vjp(lambda x: keel.rms_norm(x, w), x)
    grad(lambda v: pull(v)[0].sin().sum())(torch.randn_like(x))
    assert calls  # the pullback's backward, differentiated by the grad around it


def test_forward_mode_and_second_derivatives_keep_the_torch_op_version(monkeypatch):
    """A second grad level or autograd outside may differentiate the
    gradient: the torch-op version serves them, as before. jvp (and jacfwd)
    would need a Function's own jvp: there rms_norm with a tangent on ``x``
    alone is Keel's kernels instead (``_twice.kernel_parts``), no Function nor
    torch-op version, with the torch-op version's tangent."""
    x, w, t = (torch.randn(3, 8, dtype=torch.float64) for _ in range(3))
    seen = []
    ref = _twice.rms_norm
    monkeypatch.setattr(_twice, "rms_norm", lambda *a: seen.append(_func.route(RMS_NORM, a[:1])[0] is not None) or ref(*a))
    grad(lambda x: grad(lambda x: keel.rms_norm(x, w[0]).sin().sum())(x).sum())(x)
    grad(lambda x: keel.rms_norm(x, w[0]).sin().sum())(x.clone().requires_grad_())
    assert seen == [False, False]
    seen.clear()
    out, tangent = torch.func.jvp(lambda x: keel.rms_norm(x, w[0]), (x,), (t,))
    assert seen == []
    xd = x.clone().requires_grad_()
    want = torch.autograd.functional.jvp(lambda x: ref(x, w[0], 1e-6), (xd,), (t,))[1]
    torch.testing.assert_close(tangent, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, function", [(4, False), (255, False), (256, True)])
def test_the_function_serves_from_its_size_on(rows, function, dtype, monkeypatch):
    """Below ``MIN_ELEMENTS`` (rms_norm: 2^17 elements, all the examples'
    under vmap) torch.func's overhead outweighs the kernels: torch's own
    ``F.rms_norm`` serves there (``_func.NATIVE``), and the torch-op version
    Keel writes out for float64."""
    monkeypatch.undo()
    assert _func.MIN_ELEMENTS["rms_norm"] == _func.NATIVE["rms_norm"][1] == 256 * 512
    native = torchs_op_calls(monkeypatch, "rms_norm")
    written, ref = [], _twice.rms_norm
    monkeypatch.setattr(_twice, "rms_norm", lambda *a: written.append(1) or ref(*a))
    w = torch.randn(512, dtype=dtype)
    grad(lambda x: keel.rms_norm(x, w).sum())(torch.randn(rows, 512, dtype=dtype))
    vmap(grad(lambda x: keel.rms_norm(x, w).sum()))(torch.randn(rows, 1, 512, dtype=dtype))
    small = 0 if function else 2
    assert (len(written), len(native)) == (small if dtype == torch.float64 else 0, small if dtype == torch.float32 else 0)


_NATIVE_CASES = {
    "rms_norm": lambda x, r, w, b: keel.rms_norm(x, w),
    "layer_norm": lambda x, r, w, b: keel.layer_norm(x, w, b),
    "layer_norm without weight": lambda x, r, w, b: keel.layer_norm(x, None, b),
    "fused_add_rms_norm": lambda x, r, w, b: keel.fused_add_rms_norm(x, r, w),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(_NATIVE_CASES))
def test_small_norms_under_transforms_run_torchs_own_op(name, device, dtype, monkeypatch):
    """Below the Function's size, the norms under ``vjp`` and ``vmap(grad)`` run
    torch's own op (``F.rms_norm``, ``F.layer_norm``; the Keel-written torch-op
    version is refused): outputs and gradients those of plain autograd through
    Keel's kernels, within one rounding (f32: 1e-5; bf16: 2^-7, of the largest)."""
    monkeypatch.undo()
    for ref in ("rms_norm", "layer_norm", "fused_add_rms_norm", "vjp"):
        monkeypatch.setattr(_twice, ref, _refuse)
    monkeypatch.setattr(_func, "FUNCTIONS", {})  # nor the Functions
    gen = torch.Generator().manual_seed(3)
    x, r, t = (torch.randn(4, 6, 32, generator=gen).to(device, dtype) for _ in range(3))
    w, b = (torch.randn(32, generator=gen).to(device, dtype) for _ in range(2))
    fn = _NATIVE_CASES[name]

    def loss(x, w, b, r, t):
        return sum((o.float() * t.float()).sum() for o in _tuple(fn(x, r, w, b)))

    leaves = [a.detach().requires_grad_() for a in (x, w, b)]
    want_out = _tuple(fn(leaves[0], r, *leaves[1:]))
    want = torch.autograd.grad(loss(*leaves, r, t), leaves, allow_unused=True)
    out, pull = vjp(lambda x, w, b: fn(x, r, w, b), x, w, b)
    got = pull(tuple(torch.ones_like(o) for o in out) if isinstance(out, tuple) else torch.ones_like(out))
    for a, b_ in zip(_tuple(out), want_out):
        _within_one_rounding(a, b_)
    ones = torch.autograd.grad(list(want_out), leaves, [torch.ones_like(o) for o in want_out], allow_unused=True)
    for a, b_ in zip(got, ones):
        _within_one_rounding(a, b_)
    per_example = vmap(grad(loss, (0, 1, 2)), in_dims=(0, None, None, 0, 0))(x, w, b, r, t)
    _within_one_rounding(per_example[0], want[0])
    for a, b_ in zip(per_example[1:], want[1:]):
        _within_one_rounding(a.sum(0), b_)


_TARGET = torch.tensor([3, -100, 0, 31, 7, -100])
_PROBS = torch.softmax(torch.randn(6, 32, generator=torch.Generator().manual_seed(4)), -1)
_NATIVE_OTHERS = {
    "softmax": (torch.bfloat16, lambda x: keel.softmax(x)),
    "softmax scaled": (torch.float32, lambda x: keel.softmax(x, 0.25)),
    "cross_entropy": (torch.float32, lambda x: keel.cross_entropy(x, _TARGET)),
    "cross_entropy none, smoothed": (torch.float32, lambda x: keel.cross_entropy(x, _TARGET, -100, 0.1, "none")),
    "cross_entropy sum, other ignore_index": (
        torch.float32,
        lambda x: keel.cross_entropy(x, _TARGET.clamp(7), 7, 0.0, "sum"),
    ),
    "bare softmax": (torch.float32, lambda x: torch.ops.keel.softmax(x)),
    "bare cross_entropy": (torch.float32, lambda x: torch.ops.keel.cross_entropy(x, _TARGET, -100, 0.1, "sum")),
    "bare cross_entropy probabilities": (torch.float32, lambda x: torch.ops.keel.cross_entropy(x, _PROBS, -100, 0.2)),
}


@pytest.mark.parametrize("name", list(_NATIVE_OTHERS))
def test_small_softmax_and_cross_entropy_under_transforms_run_torchs_own_op(name, monkeypatch):
    """Below their Functions' sizes, softmax (scale 1 in any dtype, any scale in
    float32) and cross-entropy (float32 logits, no class weights) under ``vjp``
    and ``vmap(grad)`` run torch's own op (the torch-op version Keel writes out
    is refused), the bare ops too: outputs and gradients those of plain autograd
    through Keel's kernels within one rounding (f32: 1e-5; bf16: 2^-7, of the
    largest)."""
    monkeypatch.undo()
    for ref in ("softmax", "cross_entropy", "cross_entropy_loss", "vjp"):
        monkeypatch.setattr(_twice, ref, _refuse)
    from keel import _torch_version

    for ref in ("softmax", "cross_entropy", "cross_entropy_with_lse"):
        monkeypatch.setitem(_torch_version.REFS, ref, _refuse)
    monkeypatch.setattr(_func, "FUNCTIONS", {})  # nor the Functions
    dtype, fn = _NATIVE_OTHERS[name]
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 32, generator=gen) * 3).to(dtype)
    leaf = x.detach().requires_grad_()
    want_out = fn(leaf)
    cot = torch.randn(want_out.shape, generator=gen).to(dtype)
    (want,) = torch.autograd.grad(want_out, leaf, cot)
    out, pull = vjp(fn, x)
    _within_one_rounding(out, want_out)
    _within_one_rounding(pull(cot)[0], want)
    if want_out.dim() == 2:  # softmax: per-example gradients of each row
        per_row = vmap(grad(lambda r, c: (fn(r[None]) * c).sum().float()))(x, cot)
        _within_one_rounding(per_row, want)


def test_torchs_own_op_serves_neither_float64_nor_second_derivatives_nor_round_before_weight(monkeypatch):
    """float64 (``F.layer_norm`` loses digits on rows far from 0), a second
    derivative (its double backward raises for a bias without weight) and
    rms_norm's ``round_before_weight`` (torch's op has none) keep the torch-op
    version Keel writes out."""
    monkeypatch.undo()
    seen = []
    for name in ("rms_norm", "layer_norm", "fused_add_rms_norm"):
        ref = getattr(_twice, name)
        monkeypatch.setattr(_twice, name, lambda *a, ref=ref, name=name: seen.append(name) or ref(*a))
    x32, w32 = torch.randn(3, 8), torch.randn(8)
    grad(lambda x: keel.layer_norm(x.double(), None, w32.double()).sum())(x32)
    grad(lambda x: grad(lambda x: keel.layer_norm(x, None, w32).sin().sum())(x).sum())(x32)
    grad(lambda x: keel.rms_norm(x, w32, 1e-6, True).sum())(x32)
    grad(lambda x: keel.fused_add_rms_norm(x, x32, w32, 1e-6, True)[0].sum())(x32)
    # _twice.fused_add_rms_norm calls _twice.rms_norm: both are seen.
    assert seen == ["layer_norm", "layer_norm", "rms_norm", "fused_add_rms_norm", "rms_norm"]
    seen.clear()
    grad(lambda x: keel.layer_norm(x, None, w32).sum())(x32)
    grad(lambda x: keel.rms_norm(x, w32, 1e-6, False).sum())(x32)
    grad(lambda x: keel.fused_add_rms_norm(x, x32, w32, 1e-6, False)[0].sum())(x32)
    assert seen == []


@pytest.mark.parametrize("name, cols, args", [("softmax", 1024, (1.0,)), ("cross_entropy", 4096, ())])
def test_softmax_and_cross_entropy_take_their_function_from_natives_size_on(name, cols, args, monkeypatch):
    """``_func.route`` under ``grad``: torch's own op below ``NATIVE``'s size
    (softmax 2^21 elements, cross-entropy 2^20: measured crossovers), the op's
    Function from there on."""
    monkeypatch.undo()
    op = getattr(torch.ops.keel, name).default
    native, least = _func.NATIVE[name]
    assert least == {"softmax": 1 << 21, "cross_entropy": 1 << 20}[name]
    seen = []

    def probe(x):
        rest = args if name == "softmax" else (torch.zeros(x.shape[0], dtype=torch.long),)
        seen.append(_func.route(op, (x, *rest)))
        return x.sum()

    for rows in (least // cols - 1, least // cols):
        grad(probe)(torch.zeros(rows, cols))
    assert seen[0] == (None, native)
    assert seen[1][0] is _func.FUNCTIONS[name] and seen[1][1] is None


def test_torchs_own_softmax_and_cross_entropy_serve_only_where_they_give_keels_result(monkeypatch):
    """A softmax scale other than 1 in bf16 (``x * scale`` would round first),
    cross-entropy on bf16 logits (torch's log_softmax rounds to bf16) or with
    class weights that a transform differentiates (torch's nll_loss is not
    differentiable in them), and float64 keep the torch-op version Keel writes
    out, typed and bare; constant class weights take torch's op
    (test_func_class_weights)."""
    monkeypatch.undo()
    seen = []
    from keel import _torch_version

    for name in ("softmax", "cross_entropy", "cross_entropy_loss"):
        ref = getattr(_twice, name)
        monkeypatch.setattr(_twice, name, lambda *a, ref=ref, name=name: seen.append(name) or ref(*a))
    ref = _torch_version.REFS["cross_entropy"]
    monkeypatch.setitem(_torch_version.REFS, "cross_entropy", lambda *a: seen.append("bare") or ref(*a))
    x, w = torch.randn(6, 32), torch.rand(32)
    bf = x.to(torch.bfloat16)
    grad(lambda x: keel.softmax(x, 0.5).float().sum())(bf)
    grad(lambda x: keel.softmax(x).sum())(x.double())
    grad(lambda x: keel.cross_entropy(x, _TARGET).float())(bf)
    grad(lambda x, w: keel.cross_entropy(x, _TARGET, weight=w), (0, 1))(x, w)
    grad(lambda x, w: torch.ops.keel.cross_entropy(x, _TARGET, -100, 0.0, "mean", w), (0, 1))(x, w)
    assert seen == ["softmax", "softmax", "cross_entropy_loss", "cross_entropy_loss", "bare"]
    seen.clear()
    grad(lambda x: keel.softmax(x).float().sum())(bf)
    grad(lambda x: keel.softmax(x, 0.5).sum())(x)
    grad(lambda x: keel.cross_entropy(x, _TARGET))(x)
    grad(lambda x: torch.ops.keel.cross_entropy(x, _TARGET))(x)
    assert seen == []


_FORWARD_CASES = {
    "rms_norm": (torch.float32, lambda x, w: keel.rms_norm(x, w)),
    "fused_add_rms_norm": (torch.float32, lambda x, w: keel.fused_add_rms_norm(x, x.flip(0), w)[0]),
    "softmax": (torch.bfloat16, lambda x, w: keel.softmax(x)),
    "cross_entropy": (torch.float32, lambda x, w: keel.cross_entropy(x, _TARGET, -100, 0.1, "none")),
    "bare softmax": (torch.float32, lambda x, w: torch.ops.keel.softmax(x)),
    "bare rms_norm": (torch.float32, lambda x, w: torch.ops.keel.rms_norm(x, w)),
    "bare cross_entropy": (torch.float32, lambda x, w: torch.ops.keel.cross_entropy(x, _TARGET)),
}


def _forward_refs(monkeypatch):
    """Refuses the torch-op versions, typed and bare, and Keel's kernel on the
    primals; returns the torch-op versions as they were."""
    from keel import _torch_version

    was = {name: getattr(_twice, name) for name in REFS}
    for name in REFS:
        monkeypatch.setattr(_twice, name, _refuse)
    for name in list(_torch_version.REFS):
        monkeypatch.setitem(_torch_version.REFS, name, _refuse)
    return was


@pytest.mark.parametrize("how", ["jvp", "jacfwd", "forward_ad"])
@pytest.mark.parametrize("name", list(_FORWARD_CASES))
def test_forward_mode_alone_runs_torchs_own_op(name, how, monkeypatch):
    """In forward mode alone (``jvp``, ``jacfwd``, ``torch.autograd.forward_ad``),
    rms_norm, fused_add_rms_norm, softmax and cross-entropy run torch's own op at every size
    (``_func.route``; the torch-op version Keel writes out is refused): values
    and tangents those of that version within one rounding (f32: 1e-5; bf16:
    2^-7, of the largest)."""
    monkeypatch.undo()
    dtype, fn = _FORWARD_CASES[name]
    gen = torch.Generator().manual_seed(6)
    x, t = ((torch.randn(6, 32, generator=gen) * 2).to(dtype) for _ in range(2))
    w = torch.randn(32, generator=gen).to(dtype)
    want, want_t = torch.func.jvp(lambda x: fn(x, w), (x,), (t,))  # the torch-op version
    _forward_refs(monkeypatch)
    if how == "jvp":
        out, tangent = torch.func.jvp(lambda x: fn(x, w), (x,), (t,))
    elif how == "jacfwd":
        out, jac = fn(x, w), torch.func.jacfwd(lambda x: fn(x, w))(x)
        tangent = torch.tensordot(jac.float(), t.float(), dims=t.dim())
    else:
        with torch.autograd.forward_ad.dual_level():
            out, tangent = torch.autograd.forward_ad.unpack_dual(fn(torch.autograd.forward_ad.make_dual(x, t), w))
    _within_one_rounding(out, want)
    _within_one_rounding(tangent.to(want_t.dtype), want_t)


def test_second_derivatives_and_forward_over_reverse_keep_the_torch_op_version(monkeypatch):
    """A second derivative other than on float32 (``hessian`` in float64)
    keeps the torch-op version Keel writes out (test_func_second_order: float32
    second derivatives). softmax (float64 too) and layer_norm in forward mode
    alone with a tangent on ``x`` take neither it nor torch's jvp (layer_norm's
    overflowed in float16, and was no faster in float32): Keel's kernels serve
    (test_forward_mode_kernels), under plain ``forward_ad`` also where ``x``
    requires a gradient (test_forward_mode_graph)."""
    monkeypatch.undo()
    seen = []
    for name in ("layer_norm", "softmax"):
        ref = getattr(_twice, name)
        monkeypatch.setattr(_twice, name, lambda *a, ref=ref, name=name: seen.append(name) or ref(*a))
    x, w = torch.randn(3, 8), torch.randn(8)
    hessian(lambda x: keel.layer_norm(x, w.double(), w.double()).sin().sum())(x.double())
    assert seen.count("layer_norm") >= 1 and seen.count("softmax") == 0, seen
    seen.clear()
    with torch.autograd.forward_ad.dual_level():
        leaf = x.clone().requires_grad_()
        keel.softmax(torch.autograd.forward_ad.make_dual(leaf, x)).sum().backward()
    assert seen == []
    seen.clear()
    torch.func.jvp(lambda x: keel.softmax(x), (x.double(),), (x.double(),))
    half = x.to(torch.float16)
    torch.func.jvp(lambda x: keel.layer_norm(x, None, None), (half,), (half,))
    torch.func.jvp(lambda x: keel.layer_norm(x, w, w), (x,), (x,))
    torch.func.jvp(lambda x: keel.softmax(x), (x,), (x,))
    assert seen == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_layer_norm_keeps_keels_digits_on_rows_far_from_zero(dtype, monkeypatch):
    """Rows of -1000 + 0.01 * randn: ``F.layer_norm`` alone lost digits there
    (float32: 3.8e-3 of the result), so torch's op serves layer_norm on float32
    rows centred first (``_func._native_layer_norm``): under ``vjp`` the output
    and gradient are Keel's eager ones within one rounding (16-bit rows go to
    torch's op as they are: within a rounding already)."""
    monkeypatch.undo()
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(16, 64, generator=gen, dtype=torch.float64) * 0.01 - 1000).to(dtype)
    w, b, cot = (torch.randn(*s, generator=gen).to(dtype) for s in ((64,), (64,), (16, 64)))
    leaf = x.detach().requires_grad_()
    want = keel.layer_norm(leaf, w, b)
    (want_grad,) = torch.autograd.grad(want, leaf, cot)
    out, pull = vjp(lambda x: keel.layer_norm(x, w, b), x)
    _within_one_rounding(out, want.detach())
    _within_one_rounding(pull(cot)[0], want_grad)


def test_errors_inside_a_transform_name_the_op_and_argument():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: argument 'weight' must have shape \[8\]"):
        grad(lambda x: keel.rms_norm(x, torch.randn(7)).sum())(x)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm\(\) Expected a value of type 'bool' for argument 'round_before_weight'"):
        grad(lambda x: keel.rms_norm(x, torch.randn(8), 1e-6, torch.ones(3)).sum())(x)
    with pytest.raises(RuntimeError, match=r"keel::softmax: argument 'input' must be"):
        vjp(lambda x: keel.softmax(x.long().float().to(torch.float16).to(torch.int32)), x)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("functions", [True, False], ids=["functions", "thresholds"])
def test_a_class_target_out_of_range_inside_a_transform_gets_keels_error(device, functions, monkeypatch):
    """Inside a transform, cross-entropy below its Function's size runs torch's
    op or the written-out version, not Keel's kernels: a class target out of
    range gets Keel's error there too (``_twice.check_class_targets``), naming
    the op, the argument, the value and its row, not torch's IndexError (on
    CUDA, a device-side assert); through the Functions (every size here, or
    the real thresholds: torch's op at these sizes), the kernels' error names
    the op called (``cross_entropy``, not the ``cross_entropy_with_lse`` whose
    Function serves it). Targets equal to ignore_index pass."""
    if not functions:
        monkeypatch.undo()
    x = torch.randn(8, 16, device=device)
    good = torch.tensor([1, 15, -100, 0, 3, 4, 5, 6], device=device)
    bad = good.clone()
    bad[3] = 21
    w = torch.rand(16, device=device) + 0.5
    x3, t3 = torch.randn(4, 16, 5, device=device), torch.zeros(4, 5, dtype=torch.long, device=device)
    t3[1, 2] = -7  # row 7 of the [20, 16] rows
    one = torch.randn(16, device=device)
    losses = [
        ("cross_entropy", lambda t: lambda x: keel.cross_entropy(x, t, label_smoothing=0.1)),
        ("cross_entropy", lambda t: lambda x: keel.cross_entropy(x, t, weight=w)),
        ("cross_entropy_with_lse", lambda t: lambda x: keel.cross_entropy_with_lse(x, t)[0]),
        ("cross_entropy", lambda t: lambda x: torch.ops.keel.cross_entropy(x, t)),
        ("cross_entropy_with_lse", lambda t: lambda x: torch.ops.keel.cross_entropy_with_lse(x, t)[0]),
        (
            "cross_entropy_backward",
            lambda t: lambda x: torch.ops.keel.cross_entropy_backward(torch.ones((), device=device), x, t, -100, 0.0, "mean").sum(),
        ),
    ]
    transforms = [
        lambda f, x: grad(f)(x),
        lambda f, x: vjp(f, x)[1](torch.ones((), device=device)),
        lambda f, x: torch.func.jvp(f, (x,), (x,)),
        lambda f, x: vmap(grad(f))(torch.stack([x, x])),
    ]
    for op, loss in losses:
        for transform in transforms:
            transform(loss(good), x)
            with pytest.raises(RuntimeError, match=rf"^keel::{op}: argument 'target' holds 21 at row 3, out of range for 16 classes"):
                transform(loss(bad), x)
    with pytest.raises(RuntimeError, match=r"^keel::cross_entropy: argument 'target' holds -7 at row 7, out of range"):
        grad(lambda x: keel.cross_entropy(x, t3))(x3)
    with pytest.raises(RuntimeError, match=r"^keel::cross_entropy: argument 'target' holds 16 at row 0, out of range"):
        grad(lambda x: keel.cross_entropy(x, torch.tensor(16, device=device)))(one)
    grad(lambda x: keel.cross_entropy(x, bad.clamp(min=0), ignore_index=21))(x)
    # A target batched under vmap: the value, and the row where the kernels
    # run each example (the Function), else none (one check of every example's).
    targets = torch.stack([good, bad])
    row = " at row 3" if functions else ""
    with pytest.raises(RuntimeError, match=rf"^keel::cross_entropy: argument 'target' holds 21{row}, out of range for 16 classes"):
        vmap(grad(lambda x, t: keel.cross_entropy(x, t)))(torch.stack([x, x]), targets)


def test_checks_inside_a_transform_run_once_a_signature(monkeypatch):
    """Keel's checks under torch.func (``_twice._check_on_meta``) read only the
    tensors' sizes, strides, dtypes and devices and the other arguments'
    values: a call matching one that passed skips them, a difference in any of
    those runs them again, and a failing call raises every time (never kept)."""
    monkeypatch.undo()
    runs = []
    meta = _twice.meta_outputs
    monkeypatch.setattr(_twice, "meta_outputs", lambda *a: runs.append(1) or meta(*a))
    monkeypatch.setattr(_twice, "_PASSED", {})
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)

    def run(x, w=w, b=b, eps=1e-5):
        return grad(lambda x: keel.layer_norm(x, w, b, eps).sum())(x)

    want = run(x)
    torch.testing.assert_close(run(x.clone()), want, rtol=0, atol=0)
    assert len(runs) == 1
    run(torch.randn(4, 8))  # sizes
    run(torch.randn(8, 3).t().contiguous())  # the same sizes and strides as x
    run(torch.randn(8, 3).t())  # strides
    run(x, eps=1e-3)  # a value
    run(x, b=None)  # None for a tensor
    assert len(runs) == 5
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"keel::layer_norm: argument 'weight'"):
            run(x, w=torch.randn(8, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"keel::layer_norm: argument 'weight' must have shape \[8\]"):
            run(x, w=torch.randn(7))
    assert len(runs) == 9
    monkeypatch.setattr(_twice, "PASSED_MAX", 2)
    for rows in (5, 6, 7):
        run(torch.randn(rows, 8))
    assert len(_twice._PASSED) <= 2


def test_modules_through_functional_call(no_torch_op_version):
    """``torch.func.functional_call`` + ``grad`` over a ``keel.nn`` module's
    parameters: plain autograd's bits."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), keel.nn.RMSNorm(16))
    x = torch.randn(4, 16)
    params = {k: v.detach() for k, v in m.named_parameters()}
    got = grad(lambda p: torch.func.functional_call(m, p, (x,)).square().sum())(params)
    m.zero_grad()
    m(x).square().sum().backward()
    for k, p in m.named_parameters():
        assert torch.equal(got[k], p.grad), k


def test_the_timing_example_runs():
    """``examples/func_transforms.py`` (the figures in the README) on small shapes."""
    script = pathlib.Path(__file__).parents[2] / "examples" / "func_transforms.py"
    out = subprocess.run(
        [sys.executable, str(script), "--rows", "64", "--hidden", "32", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert out.count("x\n") == 12, out
