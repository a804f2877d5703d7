"""keel.layer_norm against torch: values, gradients, opcheck, gradcheck,
torch.compile, bad input, and keel.nn.LayerNorm."""
import re

import pytest
import torch
import torch.nn.functional as F

import keel
from conftest import LEADING, OPCHECK_UTILS, assert_close, devices, dtypes_for, make


def reference(x, w, b, eps):
    xd = x.double()
    y = F.layer_norm(xd, (x.shape[-1],), None if w is None else w.double(), None if b is None else b.double(), eps)
    return y


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("n", [1, 7, 33, 4096, 1031])
@pytest.mark.parametrize("affine", ["none", "weight", "both", "bias"])
def test_forward_and_gradients_match_reference(device, lead, n, affine):
    for dtype in dtypes_for(device):
        shape = (*lead, n)
        x = make(shape, dtype, device, 0, 3.0) + 1.0
        w = make(n, dtype, device, 1) if affine in ("weight", "both") else None
        b = make(n, dtype, device, 2) if affine in ("bias", "both") else None
        dy = make(shape, dtype, device, 3)
        params = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
        y = keel.layer_norm(*params, eps=1e-5)
        assert y.shape == x.shape and y.dtype == dtype
        y.backward(dy)
        ref_params = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
        want = reference(*ref_params, 1e-5)
        assert_close(y, want, dtype, scale=2.0)
        assert_close(y, F.layer_norm(x, (n,), w, b, 1e-5), dtype, scale=4.0)
        want.backward(dy.double())
        rows = max(1, x.numel() // max(n, 1))
        assert_close(params[0].grad, ref_params[0].grad, dtype, scale=8.0)
        for p, r in zip(params[1:], ref_params[1:]):
            if p is not None:
                assert_close(p.grad, r.grad, dtype, scale=8.0 * rows**0.5)


def test_gradcheck_f64():
    x = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: keel.layer_norm(*a, eps=1e-5), (x, w, b))
    assert torch.autograd.gradcheck(lambda a: keel.layer_norm(a, None, None, 1e-5), (x,))
    assert torch.autograd.gradcheck(lambda a, c: keel.layer_norm(a, None, c, 1e-5), (x, b))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    from torch.library import opcheck

    x = torch.randn(3, 17, device=device, requires_grad=True)
    w = torch.randn(17, device=device, requires_grad=True)
    b = torch.randn(17, device=device, requires_grad=True)
    for args in [(x, w, b, 1e-5), (x, None, b, 1e-5), (x, None, None, 1e-5)]:
        opcheck(torch.ops.keel.layer_norm.default, args, test_utils=OPCHECK_UTILS)
    dy = torch.randn(3, 17, device=device)
    opcheck(torch.ops.keel.layer_norm_backward.default, (dy, x.detach(), w.detach(), b.detach(), 1e-5),
            test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def block(x, w, b):
        return keel.layer_norm(x * 2.0, w, b, 1e-5).relu()

    compiled = torch.compile(block, fullgraph=True)
    x, w, b = (torch.randn(*s, device=device, requires_grad=True) for s in [(4, 64), (64,), (64,)])
    out = compiled(x, w, b)
    torch.testing.assert_close(out, block(x, w, b))
    out.sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    block(x, w, b).sum().backward()
    for g, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(g, t.grad)


BAD = [
    ("integer input", lambda: (torch.ones(2, 4, dtype=torch.int32), None, None), r"argument 'input' must be float32"),
    ("weight shape", lambda: (torch.randn(2, 4), torch.randn(5), None), r"argument 'weight' must have shape \[4\]"),
    ("bias shape", lambda: (torch.randn(2, 4), None, torch.randn(2, 4)), r"argument 'bias' must have shape \[4\]"),
    ("bias dtype", lambda: (torch.randn(2, 4), None, torch.randn(4).half()), r"argument 'bias' has dtype torch.float16"),
    ("devices differ", lambda: (torch.randn(2, 4), None, torch.randn(4, device="meta")), r"argument 'bias' is on meta"),
    ("0-dim", lambda: (torch.tensor(1.0), None, None), r"argument 'input' must have at least 1 dimension"),
]


@pytest.mark.parametrize("name,make_args,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, make_args, msg):
    with pytest.raises(RuntimeError, match=r"keel::layer_norm: " + msg):
        torch.ops.keel.layer_norm(*make_args(), 1e-5)


def test_bad_eps_and_backward_input():
    with pytest.raises(RuntimeError, match=r"keel::layer_norm: argument 'eps' must be finite and >= 0"):
        keel.layer_norm(torch.randn(2, 4), eps=float("nan"))
    with pytest.raises(RuntimeError, match=r"keel::layer_norm_backward: argument 'grad_out' has shape \[2, 5\]"):
        torch.ops.keel.layer_norm_backward(torch.randn(2, 5), torch.randn(2, 4), None, None, 1e-5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_whose_variance_overflows_are_nan(device, dtype):
    """A row spread by about 1e20 has a variance past f32's range: its
    outputs and gradients are NaN, not the zeros of 1 / sqrt(inf); the other
    rows are untouched. (torch 2.15's CPU layer_norm gives NaN for such rows
    at some widths and zeros at others, e.g. 300.)"""
    x = torch.randn(3, 300, dtype=torch.float64)
    x[1] = 1e20 * (1.5 + torch.rand(300, dtype=torch.float64))
    x = x.to(device, dtype).requires_grad_()
    w = torch.randn(300, device=device, dtype=dtype, requires_grad=True)
    y = keel.layer_norm(x, w, None, 1e-5)
    y.backward(torch.ones_like(y))
    assert torch.isnan(y[1]).all() and torch.isnan(x.grad[1]).all() and torch.isnan(w.grad).all()
    want = reference(x.detach()[[0, 2]], w.detach(), None, 1e-5)
    assert_close(y[[0, 2]], want, dtype)
    assert torch.isfinite(x.grad[[0, 2]]).all()


def test_meta_and_empty():
    y = torch.ops.keel.layer_norm(torch.empty(2, 3, 8, device="meta"), None, torch.empty(8, device="meta"), 1e-5)
    assert y.shape == (2, 3, 8) and y.device.type == "meta"
    assert keel.layer_norm(torch.empty(0, 5)).shape == (0, 5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape,bias", [(7, True), ((3, 5), True), (64, False)])
def test_nn_layernorm_is_a_drop_in_for_torch(device, shape, bias):
    torch.manual_seed(0)
    ours = keel.nn.LayerNorm(shape, bias=bias, device=device)
    theirs = torch.nn.LayerNorm(shape, bias=bias, device=device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    dims = (shape,) if isinstance(shape, int) else shape
    x = torch.randn(2, 3, *dims, device=device, requires_grad=True)
    torch.testing.assert_close(ours(x), theirs(x))
    ours(x).pow(2).sum().backward()
    g_ours = [x.grad.clone()] + [p.grad.clone() for p in ours.parameters()]
    x.grad = None
    theirs(x).pow(2).sum().backward()
    for a, b in zip(g_ours, [x.grad] + [p.grad for p in theirs.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arg", ["weight", "bias"])
@pytest.mark.parametrize(
    "shape,bad",
    [((4, 8), (8, 4)), ((4, 8), (32,)), ((4, 8), (4, 7)), ((8,), (2, 4)), ((8,), (1, 8))],
    ids=["transposed", "flattened", "wrong-size", "one-dim-as-two", "one-dim-unsqueezed"],
)
def test_nn_layernorm_refuses_a_parameter_not_of_normalized_shape(arg, shape, bad):
    # torch.nn.LayerNorm refuses these too; a (8, 4) weight on (4, 8), or (2, 4) on (8,), has as
    # many elements and would otherwise be taken, silently, in the wrong order.
    m = keel.nn.LayerNorm(shape)
    setattr(m, arg, torch.nn.Parameter(torch.ones(bad)))
    want = re.escape(f"keel.nn.LayerNorm: argument '{arg}' must have shape {shape} (normalized_shape), got {bad}")
    with pytest.raises(RuntimeError, match=want):
        m(torch.randn(2, *shape))
    params = {"weight": torch.ones(shape), "bias": torch.zeros(shape), arg: torch.ones(bad)}
    with pytest.raises(RuntimeError):
        torch.nn.functional.layer_norm(torch.randn(2, *shape), shape, **params)
