"""keel.rms_norm(..., round_before_weight=True): Hugging Face LlamaRMSNorm's
rounding (x / rms rounded to the dtype before the weight) against that
module's formula in torch, the reference that rounds there, the default
rounding, gradients, opcheck, torch.compile, strided inputs and keel.nn."""
import pytest
import torch

import keel
from conftest import OPCHECK_UTILS, assert_close, devices

HALF = [torch.bfloat16, torch.float16]


def llama(x, w, eps):
    """Hugging Face's LlamaRMSNorm.forward, as transformers writes it."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def reference(x, w, eps):
    """f64 with x / rms rounded to x's dtype before the weight."""
    xd = x.double()
    y = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    return y * w.double()


def assert_close_but_a_tie(actual, expected, dtype):
    """assert_close with one more unit in the last place of `dtype` (relative):
    where x / rms lies near a tie between two `dtype` values, a float32 sum of
    squares in another order rounds it to the other neighbour, one unit of
    x / rms apart, which the weight scales."""
    assert_close(actual, expected, dtype, extra_rtol=torch.finfo(dtype).eps)


def inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) * 3).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(3, 33), (64, 128), (256, 4096), (2, 5, 1000)])
def test_matches_hugging_face_llama_where_the_default_does_not(device, dtype, shape):
    x, w = inputs(shape, dtype, device)
    y = keel.rms_norm(x, w, 1e-6, round_before_weight=True)
    assert_close_but_a_tie(y, reference(x, w, 1e-6), dtype)
    hf = llama(x, w, 1e-6)
    # Only where the two f32 sums of squares (torch's order, Keel's) round x / rms
    # to different sides of a tie: a few in 100,000 (measured 1e-5 to 2e-5).
    differ = (y != hf).double().mean().item()
    assert differ < 1e-3, differ
    assert_close_but_a_tie(y, hf, dtype)
    # Rounded once (torch's F.rms_norm), about a quarter of the values differ from HF's.
    once = (keel.rms_norm(x, w, 1e-6) != hf).double().mean().item()
    assert once > 0.05 and once > 20 * differ, (once, differ)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_no_change_for_wide_dtypes_or_without_a_weight(device, dtype):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU only")
    x, w = inputs((7, 300), dtype, device)
    without = keel.rms_norm(x, None, 1e-6, round_before_weight=True)
    assert torch.equal(without, keel.rms_norm(x, None, 1e-6))
    if dtype != torch.bfloat16:
        assert torch.equal(keel.rms_norm(x, w, 1e-6, round_before_weight=True), keel.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF)
def test_raw_op_and_module_agree_with_the_typed_api(device, dtype):
    x, w = inputs((5, 64), dtype, device)
    want = keel.rms_norm(x, w, 1e-5, round_before_weight=True)
    assert torch.equal(torch.ops.keel.rms_norm(x, w, 1e-5, True), want)
    assert torch.equal(torch.ops.keel.rms_norm(x, w, eps=1e-5, round_before_weight=True), want)
    m = keel.nn.RMSNorm(64, eps=1e-5, device=device, dtype=dtype, round_before_weight=True)
    with torch.no_grad():
        m.weight.copy_(w)
    assert torch.equal(m(x), want)
    assert "round_before_weight=True" in repr(m)
    assert set(m.state_dict()) == {"weight"}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF)
def test_gradients_match_autograd_of_the_llama_formula(device, dtype):
    x, w = inputs((6, 257), dtype, device, seed=1)
    dy = torch.randn(6, 257, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    keel.rms_norm(xk, wk, 1e-6, round_before_weight=True).backward(dy)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    reference(xr, wr, 1e-6).backward(dy.double())
    assert_close(xk.grad, xr.grad, dtype, scale=4.0)
    assert_close(wk.grad, wr.grad, dtype, scale=4.0 * 6**0.5)


def test_double_backward_takes_the_rounding():
    x = torch.randn(4, 33, dtype=torch.float64, requires_grad=True)
    w = torch.randn(33, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: keel.rms_norm(a, b, 1e-5, round_before_weight=True), (x, w))
    # bfloat16 through the twin (create_graph): the rounding it applies.
    xb, wb = inputs((3, 40), torch.bfloat16, "cpu", seed=3)
    xb.requires_grad_()
    wb.requires_grad_()
    y = keel.rms_norm(xb, wb, 1e-6, round_before_weight=True)
    (gx,) = torch.autograd.grad(y.float().square().sum(), xb, create_graph=True)
    gx.float().sum().backward()
    assert wb.grad is not None and torch.isfinite(wb.grad.float()).all()


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    from torch.library import opcheck

    x = torch.randn(3, 17, device=device).to(torch.bfloat16).requires_grad_()
    w = torch.randn(17, device=device).to(torch.bfloat16).requires_grad_()
    opcheck(torch.ops.keel.rms_norm.default, (x, w, 1e-6, True), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: keel.rms_norm(x, w, 1e-6, round_before_weight=True) * 2, fullgraph=True)
    x, w = inputs((8, 128), torch.bfloat16, device)
    assert torch.equal(f(x, w), keel.rms_norm(x, w, 1e-6, round_before_weight=True) * 2)


@pytest.mark.parametrize("device", devices())
def test_strided_input_gives_the_contiguous_result(device):
    tokens, heads, d = 9, 4, 64
    qkv, _ = inputs((tokens, 3 * heads * d), torch.bfloat16, device)
    _, w = inputs((1, d), torch.bfloat16, device, seed=5)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    assert not q.is_contiguous()
    got = keel.rms_norm(q, w, 1e-6, round_before_weight=True)
    assert torch.equal(got, keel.rms_norm(q.contiguous(), w, 1e-6, round_before_weight=True))


def test_a_flag_that_is_not_a_bool_is_refused_naming_it():
    x, w = inputs((2, 8), torch.bfloat16, "cpu")
    with pytest.raises(RuntimeError, match="round_before_weight"):
        torch.ops.keel.rms_norm(x, w, 1e-6, "yes")


def vllm_fused_add(x, residual, w, eps):
    """vLLM's fused_add_rms_norm: residual <- x + residual (rounded to the dtype),
    x <- T(T(s / rms) * w), all in float32 between."""
    s = x + residual
    return llama(s, w, eps), s


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF)
def test_fused_add_matches_vllm_out_of_place_and_in_place(device, dtype):
    x, w = inputs((128, 1024), dtype, device, seed=7)
    r, _ = inputs((128, 1024), dtype, device, seed=8)
    want_y, want_s = vllm_fused_add(x, r, w, 1e-6)
    y, s = keel.fused_add_rms_norm(x, r, w, 1e-6, round_before_weight=True)
    assert torch.equal(s, want_s)
    assert (y != want_y).double().mean().item() < 1e-3
    assert torch.equal(y, keel.rms_norm(s, w, 1e-6, round_before_weight=True))
    assert (keel.fused_add_rms_norm(x, r, w, 1e-6)[0] != want_y).double().mean().item() > 0.05
    xi, ri = x.clone(), r.clone()
    keel.fused_add_rms_norm_(xi, ri, w, 1e-6, round_before_weight=True)
    assert torch.equal(xi, y) and torch.equal(ri, s)
    xi, ri = x.clone(), r.clone()
    torch.ops.keel.fused_add_rms_norm_(xi, ri, w, 1e-6, True)
    assert torch.equal(xi, y) and torch.equal(ri, s)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.keel.fused_add_rms_norm(x, r, w, 1e-6, True), (y, s)))


@pytest.mark.parametrize("device", devices())
def test_fused_add_gradients_opcheck_and_compile(device):
    dtype = torch.bfloat16
    x, w = inputs((6, 96), dtype, device, seed=9)
    r, _ = inputs((6, 96), dtype, device, seed=10)
    dy = torch.randn(6, 96, generator=torch.Generator().manual_seed(11)).to(dtype).to(device)
    xk, rk, wk = (t.clone().requires_grad_() for t in (x, r, w))
    y, s = keel.fused_add_rms_norm(xk, rk, wk, 1e-6, round_before_weight=True)
    (y.float() * dy.float()).sum().backward()
    xr, rr, wr = (t.double().requires_grad_() for t in (x, r, w))
    sr = (xr + rr).to(dtype).double()
    (reference(sr, wr, 1e-6) * dy.double()).sum().backward()
    assert_close(xk.grad, xr.grad, dtype, scale=4.0)
    assert torch.equal(xk.grad, rk.grad)
    assert_close(wk.grad, wr.grad, dtype, scale=4.0 * 6**0.5)

    from torch.library import opcheck

    args = (x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_(), 1e-6, True)
    opcheck(torch.ops.keel.fused_add_rms_norm.default, args, test_utils=OPCHECK_UTILS)
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c: keel.fused_add_rms_norm(a, b, c, 1e-6, round_before_weight=True), fullgraph=True)
    got = f(x, r, w)
    want = keel.fused_add_rms_norm(x, r, w, 1e-6, round_before_weight=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_add_double_backward_takes_the_rounding():
    x = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, dtype=torch.float64, requires_grad=True)
    f = lambda a, b, c: keel.fused_add_rms_norm(a, b, c, 1e-5, round_before_weight=True)[0]  # noqa: E731
    assert torch.autograd.gradgradcheck(f, (x, r, w))
