"""keel.silu_and_mul and keel.gelu_and_mul against torch: values, gradients,
opcheck, gradcheck, torch.compile, bad input, and keel.nn.SwiGLU."""
import pytest
import torch
import torch.nn.functional as F

import keel
from conftest import LEADING, OPCHECK_UTILS, TOL, devices, dtypes_for, make

# (name, keel function, f64 torch reference of act(a) * b)
ACTS = [
    ("silu", lambda x: keel.silu_and_mul(x), lambda a, b: F.silu(a) * b),
    ("gelu", lambda x: keel.gelu_and_mul(x), lambda a, b: F.gelu(a) * b),
    ("gelu_tanh", lambda x: keel.gelu_and_mul(x, "tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b),
]


def halves(x):
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def check_close(got, want, dtype, factor):
    """dtype tolerance, plus the f32 activation's error (5e-7 abs) times the other factor."""
    atol, rtol = TOL[dtype]
    err = (got.double() - want).abs()
    bound = 2 * (atol + rtol * want.abs()) + 2e-6 * factor.abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("d", [1, 7, 64, 4099])
@pytest.mark.parametrize("name,fn,ref", ACTS, ids=[a[0] for a in ACTS])
def test_forward_and_gradient_match_reference(device, lead, d, name, fn, ref):
    for dtype in dtypes_for(device):
        x = make((*lead, 2 * d), dtype, device, 0, 3.0)
        dy = make((*lead, d), dtype, device, 1)
        xk = x.clone().requires_grad_()
        y = fn(xk)
        assert y.shape == (*lead, d) and y.dtype == dtype
        xr = x.double().requires_grad_()
        want = ref(*halves(xr))
        a, b = halves(x.double())
        check_close(y, want, dtype, b * (1 + a.abs()))
        # torch in the same dtype rounds act(a) first: allow that rounding too.
        torch_y = ref(*halves(x))
        check_close(y, torch_y.double(), dtype, 2 * b * (1 + a.abs()))
        y.backward(dy)
        want.backward(dy.double())
        ga, gb = halves(xr.grad)
        da, db = halves(xk.grad)
        check_close(da, ga, dtype, dy.double() * b * (1 + a.abs()))
        check_close(db, gb, dtype, dy.double() * (1 + a.abs()))


def test_gradcheck_f64():
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(keel.silu_and_mul, (x,))
    assert torch.autograd.gradcheck(keel.gelu_and_mul, (x,))
    assert torch.autograd.gradcheck(lambda t: keel.gelu_and_mul(t, "tanh"), (x,))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    from torch.library import opcheck

    x = torch.randn(3, 18, device=device, requires_grad=True)
    dy = torch.randn(3, 9, device=device)
    opcheck(torch.ops.keel.silu_and_mul.default, (x,), test_utils=OPCHECK_UTILS)
    opcheck(torch.ops.keel.silu_and_mul_backward.default, (dy, x.detach()), test_utils=OPCHECK_UTILS)
    for approximate in ("none", "tanh"):
        opcheck(torch.ops.keel.gelu_and_mul.default, (x, approximate), test_utils=OPCHECK_UTILS)
        opcheck(torch.ops.keel.gelu_and_mul_backward.default, (dy, x.detach(), approximate), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def block(x):
        return keel.silu_and_mul(x * 2.0).sum() + keel.gelu_and_mul(x, "tanh").pow(2).sum()

    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(4, 64, device=device, requires_grad=True)
    out = compiled(x)
    torch.testing.assert_close(out, block(x))
    out.backward()
    g = x.grad.clone()
    x.grad = None
    block(x).backward()
    torch.testing.assert_close(g, x.grad)


BAD = [
    ("odd last dim", lambda: torch.ops.keel.silu_and_mul(torch.randn(2, 5)), r"keel::silu_and_mul: argument 'input' must have an even last dimension \(2d\), got 5"),
    ("odd last dim gelu", lambda: torch.ops.keel.gelu_and_mul(torch.randn(2, 3), "none"), r"keel::gelu_and_mul: argument 'input' must have an even last dimension"),
    ("unknown approximate", lambda: torch.ops.keel.gelu_and_mul(torch.randn(2, 4), "fast"), r"keel::gelu_and_mul: argument 'approximate' must be \"none\" or \"tanh\", got \"fast\""),
    ("integer input", lambda: torch.ops.keel.silu_and_mul(torch.ones(2, 4, dtype=torch.int32)), r"keel::silu_and_mul: argument 'input' must be float32"),
    ("0-dim", lambda: torch.ops.keel.silu_and_mul(torch.tensor(1.0)), r"keel::silu_and_mul: argument 'input' must have at least 1 dimension"),
    ("grad_out shape", lambda: torch.ops.keel.silu_and_mul_backward(torch.randn(2, 4), torch.randn(2, 4)), r"keel::silu_and_mul_backward: argument 'grad_out' must have shape \[2, 2\]"),
    ("grad_out dtype", lambda: torch.ops.keel.gelu_and_mul_backward(torch.randn(2, 2).half(), torch.randn(2, 4), "none"), r"keel::gelu_and_mul_backward: argument 'grad_out' has dtype torch.float16"),
]


@pytest.mark.parametrize("name,call,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, call, msg):
    with pytest.raises(RuntimeError, match=msg):
        call()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinities_match_torch(device, dtype):
    """±inf and NaN in either half, through the vector loop and its tail:
    silu(-inf) is NaN as in torch (-inf / (1 + e^inf)), not -inf. Exact gelu
    is left out: torch gives NaN for gelu(+inf), where Keel gives +inf."""
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([-inf, inf, nan, -100.0, 100.0, -1.5, 0.0, 3.0]).repeat(5)
    a = torch.cat([special, torch.full((40,), 0.5)])
    b = torch.cat([torch.full((40,), 2.0), special])
    x = torch.stack([a[:40], a[40:]], 0)
    x = torch.cat([x, torch.stack([b[:40], b[40:]], 0)], -1).to(device, dtype)
    for f, ref in (
        (keel.silu_and_mul, lambda a, b: F.silu(a) * b),
        (lambda t: keel.gelu_and_mul(t, "tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b),
    ):
        got, want = f(x).double().cpu(), ref(*halves(x.double())).cpu()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
        fin = torch.isfinite(want)
        assert torch.equal(got[~fin & ~torch.isnan(want)], want[~fin & ~torch.isnan(want)])
        torch.testing.assert_close(got[fin], want[fin], atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("device", devices())
def test_gelu_tanh_gradient_of_huge_values_is_one_or_zero(device):
    """From |x| of about 1.8e19, x^2 overflows f32; gelu_tanh's derivative is
    still 1 (x > 0) or 0 (x < 0), as torch computes it in f64, where torch's
    f32 CPU backward gives NaN."""
    a = torch.tensor([3e19, -3e19, 1e20, -1e20, 1e30, 5.0, -4.0], dtype=torch.float64)
    ad = a.clone().requires_grad_()
    (F.gelu(ad, approximate="tanh") * 2.0).sum().backward()
    x = torch.cat([a, torch.full_like(a, 2.0)]).reshape(1, -1).float().to(device).requires_grad_()
    keel.gelu_and_mul(x, "tanh").sum().backward()
    torch.testing.assert_close(x.grad[0, :7].cpu().double(), ad.grad, atol=1e-6, rtol=1e-5)


def test_meta_empty_and_nan():
    y = torch.ops.keel.gelu_and_mul(torch.empty(2, 3, 8, device="meta"), "tanh")
    assert y.shape == (2, 3, 4) and y.device.type == "meta"
    assert keel.silu_and_mul(torch.empty(0, 6)).shape == (0, 3)
    assert keel.silu_and_mul(torch.empty(4, 0)).shape == (4, 0)
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0], [-1e4, 1e4, 1.0, 1.0]])
    for f in (keel.silu_and_mul, keel.gelu_and_mul):
        y = f(x)
        assert torch.isnan(y[0, 0]) and y[0, 1] == f(x[0:1, :].nan_to_num())[0, 1]
        torch.testing.assert_close(y[1], torch.tensor([0.0, 1e4]))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("bias", [False, True])
def test_nn_swiglu_matches_a_llama_mlp(device, bias):
    torch.manual_seed(0)
    gate, up = torch.nn.Linear(32, 48, bias=bias, device=device), torch.nn.Linear(32, 48, bias=bias, device=device)
    down = torch.nn.Linear(48, 32, bias=bias, device=device)
    ours = keel.nn.SwiGLU.from_linears(gate, up, down)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    want = down(F.silu(gate(x)) * up(x))
    got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx, wx, atol=1e-5, rtol=1e-5)
    assert keel.nn.SwiGLU(32, 64)(torch.randn(3, 32)).shape == (3, 32)
