"""keel.fused_add_rms_norm against `s = x + r; F.rms_norm(s)`: values, both
outputs' gradients, opcheck, gradcheck, torch.compile, bad input."""
import pytest
import torch
import torch.nn.functional as F

import keel
from conftest import LEADING, OPCHECK_UTILS, assert_close, devices, dtypes_for, make


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("n", [1, 7, 129, 4096])
@pytest.mark.parametrize("with_weight", [True, False])
def test_forward_and_gradients_match_reference(device, lead, n, with_weight):
    for dtype in dtypes_for(device):
        shape = (*lead, n)
        x, r = make(shape, dtype, device, 0), make(shape, dtype, device, 1)
        w = make(n, dtype, device, 2) if with_weight else None
        dy, ds = make(shape, dtype, device, 3), make(shape, dtype, device, 4)
        xk, rk = x.clone().requires_grad_(), r.clone().requires_grad_()
        wk = w.clone().requires_grad_() if with_weight else None
        y, s = keel.fused_add_rms_norm(xk, rk, wk, 1e-6)
        # The sum is exactly torch's, and y is the rms_norm of that sum.
        torch.testing.assert_close(s, x + r, atol=0, rtol=0)
        sd = s.detach().double()
        want = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 if w is None else w.double())
        assert_close(y, want, dtype)
        assert_close(y, F.rms_norm(x + r, (n,), w, 1e-6), dtype, scale=2.0)
        torch.autograd.backward([y, s], [dy, ds])
        # f64 reference of the same two outputs.
        sr = sd.clone().requires_grad_()
        wr = w.double().requires_grad_() if with_weight else None
        yr = sr * torch.rsqrt(sr.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 if wr is None else wr)
        torch.autograd.backward([yr, sr], [dy.double(), ds.double()])
        assert_close(xk.grad, sr.grad, dtype, scale=4.0)
        assert_close(rk.grad, sr.grad, dtype, scale=4.0)
        if with_weight:
            rows = max(1, x.numel() // n)
            assert_close(wk.grad, wr.grad, dtype, scale=4.0 * rows**0.5)


def test_gradient_through_one_output_only():
    x, r = torch.randn(3, 9, requires_grad=True), torch.randn(3, 9, requires_grad=True)
    y, s = keel.fused_add_rms_norm(x, r)
    (gx,) = torch.autograd.grad(s.sum(), x, retain_graph=True)
    torch.testing.assert_close(gx, torch.ones(3, 9))
    (gx2,) = torch.autograd.grad(y.pow(2).sum(), x)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(F.rms_norm(xr + r.detach(), (9,), None, 1e-6).pow(2).sum(), xr)
    torch.testing.assert_close(gx2, want)
    assert x.grad is None


@pytest.mark.parametrize("needs", [(False, False, True), (True, False, True), (False, True, False), (True, True, None)])
@pytest.mark.parametrize("compiled", [False, True])
def test_outputs_need_gradients_as_torchs(needs, compiled):
    # Which outputs require a gradient is torch's `s = x + r; rms_norm(s, w)`'s:
    # with only the weight needing one, the sum needs none (it does not depend on w).
    x, r = (torch.randn(3, 8, requires_grad=n) for n in needs[:2])
    w = None if needs[2] is None else torch.randn(8, requires_grad=needs[2])
    calls = [keel.fused_add_rms_norm, torch.ops.keel.fused_add_rms_norm]
    if compiled:
        calls = [torch.compile(c, backend="aot_eager", fullgraph=True) for c in calls]
    want = (F.rms_norm(x + r, (8,), w, 1e-6).requires_grad, (x + r).requires_grad)
    for call in calls:
        y, s = call(x, r, w)
        assert (y.requires_grad, s.requires_grad) == want, call
        # The norm's gradient in w is still there, and the sum's is not asked for.
        if needs[2]:
            (gw,) = torch.autograd.grad(y.pow(2).sum(), w)
            wr = w.detach().clone().requires_grad_()
            (want_gw,) = torch.autograd.grad(F.rms_norm(x + r, (8,), wr, 1e-6).pow(2).sum(), wr)
            torch.testing.assert_close(gw, want_gw)


def _fused_add_grads(fn, mode):
    """Gradients of `fn(x, r, w)` (keel's or torch's `s = x + r; rms_norm(s)`) for
    leaves x, r (mode "leaf"), for non-leaves made from them ("nonleaf"), or for
    x passed as both input and residual ("same")."""
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    dy, ds = (torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    a, b = {"leaf": (x, r), "nonleaf": (x * 1.5, r * 0.5), "same": (x, x)}[mode]
    torch.autograd.backward(fn(a, b, w), (dy, ds))
    return x, r, w


@pytest.mark.parametrize("mode", ["leaf", "nonleaf", "same"])
@pytest.mark.parametrize("compiled", [False, True])
def test_input_and_residual_gradients_are_torchs(mode, compiled):
    # The backward hands input and residual one tensor, as torch's add does;
    # the engine must still give two leaves their own .grad.
    k = lambda a, b, c: keel.fused_add_rms_norm(a, b, c, 1e-6)  # noqa: E731
    ref = lambda a, b, c: (F.rms_norm(a + b, (8,), c, 1e-6), a + b)  # noqa: E731
    x, r, w = _fused_add_grads(torch.compile(k, backend="aot_eager") if compiled else k, mode)
    xr, rr, wr = _fused_add_grads(ref, mode)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    if mode != "same":
        torch.testing.assert_close(r.grad, rr.grad)
    if mode == "leaf":
        assert x.grad.data_ptr() != r.grad.data_ptr()
        before = r.grad.clone()
        x.grad.mul_(2)
        torch.testing.assert_close(r.grad, before, atol=0, rtol=0)


def test_gradcheck_f64():
    x, r = (torch.randn(4, 11, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: keel.fused_add_rms_norm(a, b, c, 1e-5), (x, r, w))
    assert torch.autograd.gradcheck(lambda a, b: keel.fused_add_rms_norm(a, b, None, 1e-5), (x, r))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("with_weight", [True, False])
def test_opcheck(device, with_weight):
    from torch.library import opcheck

    x, r = (torch.randn(3, 17, device=device, requires_grad=True) for _ in range(2))
    w = torch.randn(17, device=device, requires_grad=True) if with_weight else None
    opcheck(torch.ops.keel.fused_add_rms_norm.default, (x, r, w, 1e-6), test_utils=OPCHECK_UTILS)
    dy = torch.randn(3, 17, device=device)
    wd = None if w is None else w.detach()
    for gs in (dy.clone(), None):
        opcheck(torch.ops.keel.fused_add_rms_norm_backward.default, (dy, gs, x.detach(), wd, 1e-6),
                test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def block(x, r, w):
        y, s = keel.fused_add_rms_norm(x, r * 0.5, w, 1e-6)
        return y.sum() + s.pow(2).sum()

    compiled = torch.compile(block, fullgraph=True)
    x, r, w = (torch.randn(*s, device=device, requires_grad=True) for s in [(4, 64), (4, 64), (64,)])
    out = compiled(x, r, w)
    torch.testing.assert_close(out, block(x, r, w))
    out.backward()
    grads = [t.grad.clone() for t in (x, r, w)]
    for t in (x, r, w):
        t.grad = None
    block(x, r, w).backward()
    for g, t in zip(grads, (x, r, w)):
        torch.testing.assert_close(g, t.grad)


BAD = [
    ("residual shape", lambda: (torch.randn(2, 4), torch.randn(2, 5), None), r"argument 'residual' has shape \[2, 5\]"),
    ("residual dtype", lambda: (torch.randn(2, 4), torch.randn(2, 4).bfloat16(), None), r"argument 'residual' has dtype torch.bfloat16"),
    ("residual device", lambda: (torch.randn(2, 4), torch.randn(2, 4, device="meta"), None), r"argument 'residual' is on meta"),
    ("weight shape", lambda: (torch.randn(2, 4), torch.randn(2, 4), torch.randn(3)), r"argument 'weight' must have shape \[4\]"),
    ("integer input", lambda: (torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64), None), r"argument 'input' must be float32"),
]


@pytest.mark.parametrize("name,make_args,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, make_args, msg):
    with pytest.raises(RuntimeError, match=r"keel::fused_add_rms_norm: " + msg):
        torch.ops.keel.fused_add_rms_norm(*make_args(), 1e-6)


def test_backward_names_sum_argument():
    with pytest.raises(RuntimeError, match=r"keel::fused_add_rms_norm_backward: argument 'grad_sum' has shape \[2, 5\] but 'sum' has \[2, 4\]"):
        torch.ops.keel.fused_add_rms_norm_backward(torch.randn(2, 4), torch.randn(2, 5), torch.randn(2, 4), None, 1e-6)


def test_meta_and_empty():
    y, s = torch.ops.keel.fused_add_rms_norm(torch.empty(2, 8, device="meta"), torch.empty(2, 8, device="meta"), None, 1e-6)
    assert y.shape == s.shape == (2, 8) and y.device.type == "meta"
    y, s = keel.fused_add_rms_norm(torch.empty(0, 3), torch.empty(0, 3))
    assert y.shape == s.shape == (0, 3)
