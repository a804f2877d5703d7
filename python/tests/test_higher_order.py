"""Beyond first-order reverse mode: double backward (create_graph=True; gradgradcheck
in float64 for every op, and the fused Keel backward kernels still serve a plain
backward), and forward-mode AD (jvp and forward-over-reverse Hessian-vector
products against finite differences)."""
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import TorchDispatchMode

import keel
from conftest import devices


def _t(*shape, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def _target(n, v, seed, ignore=()):
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    t[list(ignore)] = -100
    return t


def _cases():
    x, w, b = _t(3, 6, seed=1), _t(6, seed=2), _t(6, seed=3)
    r = _t(3, 6, seed=4)
    logits, target = _t(4, 5, seed=5), _target(4, 5, seed=6, ignore=(2,))
    rx, cs, sn = _t(2, 3, 2, 8, seed=7), _t(3, 3, seed=8), _t(3, 3, seed=9)
    return {
        "rms_norm": (lambda x, w: keel.rms_norm(x, w, 1e-5), (x, w)),
        "rms_norm no weight": (lambda x: keel.rms_norm(x), (x,)),
        "layer_norm": (lambda x, w, b: keel.layer_norm(x, w, b), (x, w, b)),
        "layer_norm weight only": (lambda x, w: keel.layer_norm(x, w, None), (x, w)),
        # torch's own F.layer_norm raises in this double backward (torch 2.10 to 2.15).
        "layer_norm bias only": (lambda x, b: keel.layer_norm(x, None, b), (x, b)),
        "fused_add_rms_norm": (lambda x, r, w: keel.fused_add_rms_norm(x, r, w, 1e-5), (x, r, w)),
        "fused_add_rms_norm sum only": (lambda x, r: keel.fused_add_rms_norm(x, r)[1] * 2, (x, r)),
        "silu_and_mul": (keel.silu_and_mul, (x,)),
        "gelu_and_mul": (lambda x: keel.gelu_and_mul(x), (x,)),
        "gelu_and_mul tanh": (lambda x: keel.gelu_and_mul(x, "tanh"), (x,)),
        "softmax": (lambda x: keel.softmax(x, 0.7), (x,)),
        "cross_entropy mean": (lambda z: keel.cross_entropy(z, target, label_smoothing=0.2), (logits,)),
        "cross_entropy sum": (lambda z: keel.cross_entropy(z, target, reduction="sum"), (logits,)),
        "cross_entropy none": (lambda z: keel.cross_entropy(z, target, reduction="none"), (logits,)),
        "cross_entropy_with_lse": (lambda z: keel.cross_entropy_with_lse(z, target, label_smoothing=0.1), (logits,)),
        "rotary": (lambda x, c, s: keel.rotary_embedding(x, c, s), (rx, cs, sn)),
        "rotary interleaved": (lambda x, c, s: keel.rotary_embedding(x, c, s, interleaved=True), (rx, cs, sn)),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_gradgradcheck_f64(name):
    fn, inputs = CASES[name]
    with warnings.catch_warnings():
        # torch's fallback for an op without autograd warns, then gives zeros.
        warnings.filterwarnings("error", message=".*autograd kernel was not registered.*")
        assert torch.autograd.gradgradcheck(fn, inputs)


class _Ops(TorchDispatchMode):
    """Records the ops that run."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def test_plain_backward_keeps_the_fused_kernels():
    x, w = _t(4, 8, seed=1), _t(8, seed=2)
    loss = keel.softmax(keel.rms_norm(x, w)).square().sum()
    with _Ops() as plain:
        torch.autograd.grad(loss, (x, w), retain_graph=True)
    # The backward ops' _nograd twins: their kernels, no autograd kernel.
    assert {"keel._rms_norm_backward_nograd.default", "keel._softmax_backward_nograd.default"} <= plain.seen
    with _Ops() as twice:
        torch.autograd.grad(loss, (x, w), create_graph=True)
    assert not any(op.startswith("keel.") for op in twice.seen), twice.seen


@pytest.mark.parametrize("device", devices())
def test_second_derivative_matches_torch_in_float32(device):
    """A gradient penalty (the norm of d loss / d x, differentiated again) against
    the same expression in torch's ops."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(5, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)

    def penalty(norm, act):
        (gx,) = torch.autograd.grad(act(norm(x, w)).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), (x, w))

    got = penalty(lambda x, w: keel.rms_norm(x, w), keel.silu_and_mul)
    want = penalty(
        lambda x, w: F.rms_norm(x, (16,), w, 1e-6),
        lambda h: F.silu(h[..., :8]) * h[..., 8:],
    )
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def _outputs(y):
    return y if isinstance(y, tuple) else (y,)


def _shifted(inputs, tangents, h):
    return [x.detach() + h * t for x, t in zip(inputs, tangents)]


@pytest.mark.parametrize("name", list(CASES))
def test_forward_ad_jvp_matches_finite_differences(name):
    """The tangent of each output under forward-mode AD (torch drops a custom op's
    tangents; the typed API adds them) against a central difference in float64."""
    fn, inputs = CASES[name]
    g = torch.Generator().manual_seed(11)
    tangents = [torch.randn(x.shape, generator=g, dtype=x.dtype) for x in inputs]
    with fwAD.dual_level():
        outs = _outputs(fn(*[fwAD.make_dual(x.detach(), t) for x, t in zip(inputs, tangents)]))
        got = [fwAD.unpack_dual(o).tangent for o in outs]
    h = 1e-6
    plus, minus = _outputs(fn(*_shifted(inputs, tangents, h))), _outputs(fn(*_shifted(inputs, tangents, -h)))
    for t, p, m in zip(got, plus, minus):
        assert t is not None, name
        torch.testing.assert_close(t, (p - m) / (2 * h), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "fused_add_rms_norm", "gelu_and_mul tanh",
                                  "softmax", "cross_entropy mean", "rotary"])
def test_forward_over_reverse_hvp_matches_finite_differences(name):
    """A Hessian-vector product: forward-mode AD through the backward (the backward
    sees dual gradients) against a central difference of gradients."""
    fn, inputs = CASES[name]
    x, rest = inputs[0], inputs[1:]
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(12), dtype=x.dtype)

    def grad_at(z):
        z = z.detach().requires_grad_()
        out = _outputs(fn(z, *rest))
        return torch.autograd.grad(sum(o.square().sum() for o in out), z)[0]

    with fwAD.dual_level():
        z = x.detach().requires_grad_()
        out = _outputs(fn(fwAD.make_dual(z, v), *rest))
        (gz,) = torch.autograd.grad(sum(o.square().sum() for o in out), z)
        hvp = fwAD.unpack_dual(gz).tangent
    h = 1e-6
    assert hvp is not None
    torch.testing.assert_close(hvp, (grad_at(x + h * v) - grad_at(x - h * v)) / (2 * h), atol=1e-5, rtol=1e-4)


def test_keel_backward_meeting_dual_gradients_keeps_their_tangents():
    """torch.ops.keel.softmax (no typed API in between) on a plain input, its
    output times a dual tensor: the gradient reaching Keel's backward is dual, and
    the backward keeps its tangent (d/du of J^T u is J^T du)."""
    x = _t(3, 6, seed=1)
    u, du = _t(3, 6, seed=2, grad=False), _t(3, 6, seed=3, grad=False)
    with fwAD.dual_level():
        y = torch.ops.keel.softmax(x, 0.5)
        (gx,) = torch.autograd.grad((y * fwAD.make_dual(u, du)).sum(), x)
        tangent = fwAD.unpack_dual(gx).tangent
    (want,) = torch.autograd.grad((torch.softmax(x * 0.5, -1) * du).sum(), x)
    assert tangent is not None
    torch.testing.assert_close(tangent, want)


def _single(fn, n):
    """`fn` with its outputs summed into one tensor (for jacrev's one output)."""

    def f(*a):
        return sum(o.sum() * (i + 1) for i, o in enumerate(_outputs(fn(*a))))

    return f


@pytest.mark.parametrize("name", list(CASES))
def test_torch_func_grad_and_jacrev_match_autograd(name):
    """torch.func.grad and jacrev (reverse mode inside a transform) against
    torch.autograd on the same function, in float64."""
    fn, inputs = CASES[name]
    f = _single(fn, len(inputs))
    argnums = tuple(range(len(inputs)))
    got = torch.func.grad(f, argnums=argnums)(*[x.detach() for x in inputs])
    want = torch.autograd.grad(f(*inputs), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    jac = torch.func.jacrev(lambda *a: _outputs(fn(*a))[0], argnums=0)(*[x.detach() for x in inputs])
    ref = torch.autograd.functional.jacobian(lambda x: _outputs(fn(x, *inputs[1:]))[0], inputs[0].detach())
    torch.testing.assert_close(jac, ref)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "silu_and_mul", "softmax", "cross_entropy mean", "rotary"])
def test_torch_func_jvp_and_hessian(name):
    fn, inputs = CASES[name]
    x, rest = inputs[0].detach(), [a.detach() for a in inputs[1:]]
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(13), dtype=x.dtype)
    first = lambda z: _outputs(fn(z, *rest))[0]  # noqa: E731
    _, tangent = torch.func.jvp(first, (x,), (v,))
    h = 1e-6
    torch.testing.assert_close(tangent, (first(x + h * v) - first(x - h * v)) / (2 * h), atol=1e-6, rtol=1e-5)
    if x.numel() <= 36:
        loss = lambda z: first(z).square().sum()  # noqa: E731
        hess = torch.func.hessian(loss)(x)
        ref = torch.autograd.functional.hessian(loss, x)
        torch.testing.assert_close(hess, ref)


def test_vmap_batches_without_torchs_fallback():
    """Inside torch.vmap the typed API calls the op, whose batching rule
    (``keel._vmap``) serves it, a batched weight too: no fallback warning, the
    loop's results."""
    x, w = torch.randn(3, 4, 8), torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        got = torch.vmap(keel.rms_norm)(x, w)
        got_sm = torch.vmap(keel.softmax, in_dims=1)(x)
        got_ce = torch.vmap(lambda z, t: keel.cross_entropy(z, t))(x, torch.randint(0, 8, (3, 4)))
    torch.testing.assert_close(got, torch.stack([keel.rms_norm(a, b) for a, b in zip(x, w)]))
    torch.testing.assert_close(got_sm, torch.stack([keel.softmax(x[:, i]) for i in range(4)]))
    assert got_ce.shape == (3,)


def test_bad_argument_inside_torch_func_names_op_and_argument():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: argument 'weight' must have shape \[8\]"):
        torch.func.grad(lambda a: keel.rms_norm(a, torch.randn(7)).sum())(x)
    with pytest.raises(RuntimeError, match=r"keel::gelu_and_mul: argument 'approximate'"):
        torch.vmap(lambda a: keel.gelu_and_mul(a, "fast"))(x)
    with pytest.raises(RuntimeError, match=r"keel::softmax: argument 'input' must be float32"):
        torch.vmap(keel.softmax)(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: argument 'weight' is on meta but 'input' is on cpu"):
        torch.func.grad(lambda a: keel.rms_norm(a, torch.empty(8, device="meta")).sum())(x)


def test_typed_api_without_gradients_skips_only_the_autograd_kernel():
    """Where no gradient can be needed, the typed API calls the op's ``_nograd``
    twin (its kernels, no autograd kernel, which would decide the same): same
    values, no graph, and dispatch modes below autograd see the twin."""
    x, w = _t(3, 6, seed=1, grad=False), _t(6, seed=2, grad=False)
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        with _Ops() as seen:
            y = keel.rms_norm(xg, w)
        assert "keel._rms_norm_nograd.default" in seen.seen, seen.seen
        assert not y.requires_grad
        torch.testing.assert_close(y, torch.ops.keel.rms_norm(x, w, 1e-6), atol=0, rtol=0)
    with _Ops() as seen:
        y = keel.softmax(x)  # grad mode, nothing requiring a gradient
    assert seen.seen == {"keel._softmax_nograd.default"}, seen.seen
    assert y.grad_fn is None and not y.requires_grad
    y = keel.softmax(xg)
    assert y.grad_fn is not None
    (g,) = torch.autograd.grad(y.square().sum(), xg)
    (want,) = torch.autograd.grad(torch.softmax(xg, -1).square().sum(), xg)
    torch.testing.assert_close(g, want)
