"""Keel's backward operators called directly (``torch.ops.keel.*_backward``) on
inputs that need a gradient (``keel._backward_grad``): before, torch's fallback
warned and gave those inputs no gradient. Checked in float64 against finite
differences of the ops' own kernels (gradcheck), to second order (gradgradcheck),
through ``torch.library.opcheck``, and under ``torch.compile``."""
import warnings

import pytest
import torch

import keel  # noqa: F401  (registers the ops)
from keel import _twice
from conftest import OPCHECK_UTILS, devices

ops = torch.ops.keel


def _t(*shape, seed, grad=True, positive=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    return (t.abs() + 0.5 if positive else t).requires_grad_(grad)


def _cases():
    """name: (op, arguments): every backward op, with and without its optional tensors."""
    g, x, w, b = _t(3, 6, seed=1), _t(3, 6, seed=2), _t(6, seed=3), _t(6, seed=4)
    gh, xg = _t(3, 3, seed=5), _t(3, 6, seed=6)
    y = torch.softmax(_t(3, 6, seed=7, grad=False), -1).requires_grad_()
    gl, logits = _t(4, seed=8), _t(4, 5, seed=9)
    classes = torch.tensor([1, 4, -100, 0])
    probs = torch.softmax(_t(4, 5, seed=10, grad=False), -1).requires_grad_()
    cw = _t(5, seed=11, positive=True)
    gr, cs, sn = _t(2, 3, 2, 8, seed=12), _t(3, 3, seed=13), _t(3, 3, seed=14)
    return {
        "rms_norm": (ops.rms_norm_backward, (g, x, w, 1e-5)),
        "rms_norm no weight": (ops.rms_norm_backward, (g, x, None, 1e-5)),
        "layer_norm": (ops.layer_norm_backward, (g, x, w, b, 1e-5)),
        "layer_norm bias only": (ops.layer_norm_backward, (g, x, None, b, 1e-5)),
        "fused_add_rms_norm": (ops.fused_add_rms_norm_backward, (g, _t(3, 6, seed=15), x, w, 1e-5)),
        "fused_add_rms_norm no grad_sum": (ops.fused_add_rms_norm_backward, (g, None, x, None, 1e-5)),
        "silu_and_mul": (ops.silu_and_mul_backward, (gh, xg)),
        "gelu_and_mul": (ops.gelu_and_mul_backward, (gh, xg, "none")),
        "gelu_and_mul tanh": (ops.gelu_and_mul_backward, (gh, xg, "tanh")),
        "softmax": (ops.softmax_backward, (g, y, 0.5)),
        "cross_entropy": (ops.cross_entropy_backward, (gl.sum(), logits, classes, -100, 0.1, "mean")),
        "cross_entropy weight none": (ops.cross_entropy_backward, (gl, logits, classes, -100, 0.2, "none", None, cw)),
        "cross_entropy probs": (ops.cross_entropy_backward, (gl.sum(), logits, probs, -100, 0.1, "sum", None, cw)),
        "cross_entropy weight mean": (ops.cross_entropy_backward, (gl.sum(), logits, classes, -100, 0.3, "mean", None, cw)),
        "cross_entropy probs mean": (ops.cross_entropy_backward, (gl.sum(), logits, probs, -100, 0.0, "mean")),
        "cross_entropy probs none": (ops.cross_entropy_backward, (gl, logits, probs, -100, 0.2, "none", None, cw)),
        "rotary_embedding": (ops.rotary_embedding_backward, (gr, cs, sn, False)),
        "rotary_embedding interleaved": (ops.rotary_embedding_backward, (gr, cs, sn, True)),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_of_a_direct_call_are_those_of_its_kernels(name):
    """gradcheck: the analytic gradient (``_backward_grad``'s formula) against
    finite differences of the op's own kernels, in every tensor argument."""
    op, args = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "autograd kernel was not registered" warning was the old answer
        assert torch.autograd.gradcheck(lambda *a: op(*a), args, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "name", ["rms_norm", "layer_norm", "fused_add_rms_norm", "gelu_and_mul tanh", "softmax", "cross_entropy probs"]
)
def test_second_order(name):
    op, args = CASES[name]
    assert torch.autograd.gradgradcheck(lambda *a: op(*a), args, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_values_do_not_depend_on_grad_mode(name):
    """The outputs are the kernels' whether or not a gradient is wanted."""
    op, args = CASES[name]
    with torch.no_grad():
        plain = op(*args)
    got = op(*args)
    plain, got = (t if isinstance(t, tuple) else (t,) for t in (plain, got))
    assert any(t.grad_fn is not None for t in got), name
    for a, b in zip(got, plain):
        assert torch.equal(a.detach(), b), name
        # A missing weight's empty stand-in gets no gradient.
        assert a.requires_grad == (a.numel() > 0), name


def test_the_lse_is_a_cache_of_the_logits():
    """Given the forward's lse (no gradient of its own), cross_entropy_backward's
    gradients are those of the call without it: the lse counts as the logits'
    log-sum-exp."""
    _, (grad, logits, target, *rest) = CASES["cross_entropy"]
    lse = torch.logsumexp(logits.detach(), -1).requires_grad_()
    without = ops.cross_entropy_backward(grad, logits, target, *rest, None, None)
    given = ops.cross_entropy_backward(grad, logits, target, *rest, lse, None)
    torch.testing.assert_close(given, without, atol=1e-14, rtol=1e-12)
    v = torch.randn_like(given)
    want = torch.autograd.grad((without * v).sum(), (grad, logits))
    got = torch.autograd.grad((given * v).sum(), (grad, logits, lse), allow_unused=True)
    torch.testing.assert_close(got[:2], want, atol=1e-14, rtol=1e-12)
    assert got[2] is None


def test_only_inputs_that_need_a_gradient_get_one():
    x = _t(3, 6, seed=1)
    g, w = _t(3, 6, seed=2, grad=False), _t(6, seed=3, grad=False)
    gx, gw = ops.rms_norm_backward(g, x, w, 1e-6)
    (hx,) = torch.autograd.grad(gx.square().sum() + gw.sum(), x)
    assert gx.requires_grad and gw.requires_grad
    wl = w.clone().requires_grad_()
    want_gx, want_gw = torch.autograd.grad(_twice.rms_norm(x, wl, 1e-6), (x, wl), g, create_graph=True)
    (want,) = torch.autograd.grad(want_gx.square().sum() + want_gw.sum(), x)
    torch.testing.assert_close(hx, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "cross_entropy", "rotary_embedding"])
def test_opcheck_with_gradients(name):
    """torch.library.opcheck with arguments that require a gradient: its autograd
    registration test fails for an op that has no autograd kernel."""
    op, args = CASES[name]
    torch.library.opcheck(op.default, args, test_utils=OPCHECK_UTILS)


def test_compiled_call_gets_the_same_gradients():
    op, args = CASES["layer_norm"]
    (g, x, w, b, eps) = args

    def loss(g, x, w, b):
        gx, gw, gb = op(g, x, w, b, eps)
        return gx.square().sum() + (gw * gb).sum()

    # (No gradient reaches the bias: none of the three depends on it.)
    want = torch.autograd.grad(loss(g, x, w, b), (g, x, w))
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(g, x, w, b), (g, x, w))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def _on(args, device, dtype):
    """`args` on `device`, floating tensors in `dtype` (each a leaf needing a
    gradient where the original needs one)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            b = a.detach().to(device, dtype if a.is_floating_point() else a.dtype)
            a = b.requires_grad_(a.requires_grad)
        out.append(a)
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_on_each_device_match_float64(device, name):
    """The same gradients in float32 (the kernels' and the formulas') on each
    device as in float64 on the CPU, where gradcheck checks them."""
    op, args = CASES[name]
    dtype = torch.float32
    want_args, got_args = _on(args, "cpu", torch.float64), _on(args, device, dtype)
    results = []
    for a in (want_args, got_args):
        outs = op(*a)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum() for o in outs if o.numel())
        leaves = [t for t in a if isinstance(t, torch.Tensor) and t.requires_grad]
        results.append([t.cpu().double() for t in torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)])
    torch.testing.assert_close(results[1], results[0], atol=2e-4, rtol=2e-3, msg=lambda m: f"{name} on {device}: {m}")
