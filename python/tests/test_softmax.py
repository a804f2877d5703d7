"""keel.softmax against torch.softmax(x * scale): values, gradients, opcheck,
gradcheck, torch.compile, -inf rows, bad input."""
import pytest
import torch

import keel
from conftest import LEADING, OPCHECK_UTILS, TOL, devices, dtypes_for, make


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("n", [1, 7, 64, 4099])
@pytest.mark.parametrize("scale", [1.0, 0.125, -1.5])
def test_forward_and_gradient_match_torch(device, lead, n, scale):
    for dtype in dtypes_for(device):
        x = make((*lead, n), dtype, device, 0, 3.0)
        dy = make((*lead, n), dtype, device, 1)
        xk = x.clone().requires_grad_()
        y = keel.softmax(xk, scale)
        assert y.shape == x.shape and y.dtype == dtype
        xr = x.double().requires_grad_()
        want = torch.softmax(xr * scale, -1)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(y.double(), want, atol=atol, rtol=2 * rtol)
        # torch in the same dtype, for comparison with what users get today.
        torch.testing.assert_close(y, torch.softmax(x * scale, -1), atol=2 * atol, rtol=4 * rtol)
        y.backward(dy)
        want.backward(dy.double())
        torch.testing.assert_close(xk.grad.double(), xr.grad, atol=4 * atol, rtol=4 * rtol)


def test_gradcheck_f64():
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: keel.softmax(t, 0.7), (x,))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    from torch.library import opcheck

    x = torch.randn(3, 17, device=device, requires_grad=True)
    opcheck(torch.ops.keel.softmax.default, (x, 0.5), test_utils=OPCHECK_UTILS)
    y = torch.softmax(x.detach(), -1)
    opcheck(torch.ops.keel.softmax_backward.default, (torch.randn_like(y), y, 0.5), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def attn(q, k):
        return keel.softmax(q @ k.transpose(-1, -2), q.shape[-1] ** -0.5).pow(2).sum()

    compiled = torch.compile(attn, fullgraph=True)
    q = torch.randn(2, 8, 16, device=device, requires_grad=True)
    k = torch.randn(2, 8, 16, device=device)
    out = compiled(q, k)
    torch.testing.assert_close(out, attn(q, k))
    out.backward()
    g = q.grad.clone()
    q.grad = None
    attn(q, k).backward()
    torch.testing.assert_close(g, q.grad)


def test_masked_and_special_rows_match_torch():
    inf = float("inf")
    x = torch.tensor([[-inf, -inf, -inf], [0.0, -inf, 1.0], [float("nan"), 1.0, 2.0], [1e30, 1e30, 0.0]])
    y, want = keel.softmax(x), torch.softmax(x, -1)
    torch.testing.assert_close(y, want, equal_nan=True)
    assert y[1, 1] == 0.0 and torch.isnan(y[0]).all()
    assert keel.softmax(torch.empty(0, 5)).shape == (0, 5)
    assert torch.ops.keel.softmax(torch.empty(2, 9, device="meta"), 2.0).device.type == "meta"


BAD = [
    ("integer", lambda: torch.ops.keel.softmax(torch.ones(2, 3, dtype=torch.int64), 1.0), r"keel::softmax: argument 'input' must be float32"),
    ("0-dim", lambda: torch.ops.keel.softmax(torch.tensor(1.0), 1.0), r"keel::softmax: argument 'input' must have at least 1 dimension"),
    ("inf scale", lambda: torch.ops.keel.softmax(torch.randn(2, 3), float("inf")), r"keel::softmax: argument 'scale' must be finite, got inf"),
    ("grad shape", lambda: torch.ops.keel.softmax_backward(torch.randn(2, 4), torch.randn(2, 3), 1.0), r"keel::softmax_backward: argument 'grad_out' has shape \[2, 4\] but 'output' has \[2, 3\]"),
    ("grad dtype", lambda: torch.ops.keel.softmax_backward(torch.randn(2, 3).double(), torch.randn(2, 3), 1.0), r"keel::softmax_backward: argument 'grad_out' has dtype torch.float64"),
]


@pytest.mark.parametrize("name,call,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, call, msg):
    with pytest.raises(RuntimeError, match=msg):
        call()
