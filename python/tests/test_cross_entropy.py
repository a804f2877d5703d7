"""keel.cross_entropy against F.cross_entropy: every reduction, ignore_index,
label smoothing, gradients (through the forward's saved log-sum-exp, and
through the op that recomputes it), keel.cross_entropy_with_lse against
torch.logsumexp, opcheck, gradcheck, torch.compile, bad targets, and the peak
extra memory of forward + backward."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import keel
from conftest import OPCHECK_UTILS, TOL, devices, dtypes_for, make

REDUCTIONS = ["mean", "sum", "none"]


def targets(n, v, device, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.25] = ignore_index
    return t.to(device)


def class_weights(v, device, dtype=torch.float32, seed=7):
    """Weights in [0.25, 2.25): far enough from 1 that a loss without them differs."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(v, generator=g, dtype=torch.float64) * 2 + 0.25).to(dtype).to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,v", [(1, 1), (5, 7), (64, 1000), (3, 32000)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_and_gradient_match_torch(device, n, v, reduction, label_smoothing, weighted):
    """With class weights (``weight=``, test_cross_entropy_forms.py) too."""
    for dtype in dtypes_for(device):
        x = make((n, v), dtype, device, 0, 4.0)
        t = targets(n, v, device)
        if n == 1:
            t[0] = 0
        # The weights in the logits' dtype, as torch takes them: the reference sees the same values.
        kw = dict(weight=class_weights(v, device, dtype)) if weighted else {}
        xr = x.double().clone().requires_grad_()
        ref_kw = {k: w.double() for k, w in kw.items()}
        want = F.cross_entropy(xr, t, label_smoothing=label_smoothing, reduction=reduction, **ref_kw)
        g = make(want.shape, dtype, device, 2) if reduction == "none" else torch.tensor(1.5, dtype=dtype, device=device)
        want.backward(g.double())
        atol, rtol = TOL[dtype]
        # keel.cross_entropy keeps the lse for the backward; the op itself recomputes it.
        for op in (keel.cross_entropy, torch.ops.keel.cross_entropy):
            xk = x.clone().requires_grad_()
            loss = op(xk, t, -100, label_smoothing, reduction, **kw)
            assert loss.shape == want.shape and loss.dtype == dtype
            # Each loss is lse - x_t: cancellation of terms of size |x|, so atol scales with it.
            torch.testing.assert_close(loss.double(), want, atol=atol * 10, rtol=rtol * 2)
            loss.backward(g)
            torch.testing.assert_close(xk.grad.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,v", [(1, 1), (5, 7), (64, 1000)])
def test_with_lse_matches_logsumexp_and_its_gradient(device, n, v):
    for dtype in dtypes_for(device):
        x = make((n, v), dtype, device, 0, 4.0)
        t = targets(n, v, device)
        xk = x.clone().requires_grad_()
        loss, lse = keel.cross_entropy_with_lse(xk, t, label_smoothing=0.1)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        assert lse.shape == (n,) and lse.dtype == acc
        xr = x.double().clone().requires_grad_()
        live = t != -100
        want_lse = torch.logsumexp(xr, -1) * live
        want = F.cross_entropy(xr, t, label_smoothing=0.1)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5 * 4, rtol=1e-5)
        assert (lse[~live] == 0).all()
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(loss.double(), want, atol=atol * 10, rtol=rtol * 2, equal_nan=True)
        # A z-loss: the gradient also flows through the lse.
        (loss + 0.3 * lse.square().sum()).backward()
        (want + 0.3 * want_lse.square().sum()).backward()
        torch.testing.assert_close(xk.grad.double(), xr.grad, atol=atol * 4, rtol=rtol * 4, equal_nan=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_lse_of_a_row_of_neg_inf_is_neg_inf_as_logsumexps(device, label_smoothing):
    """A row of -inf only (every class masked): its lse is -inf, as
    torch.logsumexp's, not NaN; its loss NaN, as torch's; class indices, with and
    without class weights, and probabilities."""
    for dtype in dtypes_for(device):
        x = make((3, 6), dtype, device, 0, 2.0)
        x[1] = float("-inf")
        t = torch.tensor([0, 2, 5], device=device)
        w = torch.rand(6, device=device).to(dtype) + 0.5
        probs = torch.softmax(make((3, 6), torch.float32, device, 1, 1.0), -1).to(dtype)
        for target, weight in ((t, None), (t, w), (probs, None)):
            loss, lse = keel.cross_entropy_with_lse(x, target, label_smoothing=label_smoothing, reduction="none", weight=weight)
            torch.testing.assert_close(lse, torch.logsumexp(x.to(lse.dtype), -1), atol=1e-5, rtol=1e-5)
            wt = None if weight is None else weight.double()
            want_target = target.double() if target.dtype.is_floating_point else target
            want = F.cross_entropy(x.double(), want_target, label_smoothing=label_smoothing, reduction="none", weight=wt)
            assert loss[1].isnan() and want[1].isnan()
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(loss[[0, 2]].double(), want[[0, 2]], atol=atol * 10, rtol=rtol * 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_of_large_logits_stay_exact(device, dtype):
    """Rows with large logits: the backward does not take exp(x - lse) from the
    forward's rounded lse (a relative error of 2^-24 |lse| on every
    probability), and the z-loss gradient through the lse is a softmax. Two
    logits tied at 1e20 get 0.5 each, not 1; logits offset by 1000 keep float32
    accuracy."""
    torch.manual_seed(0)
    x = torch.randn(3, 300, dtype=torch.float64) * 2
    x[0] += 1000.0
    x[1] = 0.0
    x[1, [7, 250]] = 1e20
    target = torch.tensor([3, 5, 9], device=device)
    x = x.to(dtype)
    xk = x.to(device).clone().requires_grad_()
    loss, lse = keel.cross_entropy_with_lse(xk, target, reduction="sum", label_smoothing=0.1)
    (loss + 1e-3 * lse[[0, 2]].square().sum()).backward()
    xd = x.double().requires_grad_()
    zloss = 1e-3 * torch.logsumexp(xd[[0, 2]], -1).square().sum()
    (F.cross_entropy(xd, target.cpu(), reduction="sum", label_smoothing=0.1) + zloss).backward()
    atol = 4e-7 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(xk.grad.double().cpu(), xd.grad, atol=atol, rtol=0)
    assert abs(xk.grad[1, 7].item() - 0.5) < 0.01 and abs(xk.grad[1, 250].item() - 0.5) < 0.01


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_with_nan_or_infinite_logits_give_torchs_gradient(device, dtype):
    """A row holding NaN or +inf gets a NaN gradient in every entry, as torch
    gives (bf16 rows on AVX2 round their gradient without a NaN fix-up only
    where the row's sum is finite); a -inf logit gets only the smoothing's
    `-eps / v` and leaves the rest of its row finite. Checked beside finite rows, with and without the saved
    log-sum-exp, and with tiny gradients (subnormal in f32) in the last row."""
    v = 300
    x = torch.randn(5, v, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    x[0, 17] = float("nan")
    x[1, 40] = float("inf")
    x[2, [5, 99]] = float("-inf")
    x[4] *= 20  # most probabilities far below f32's normal range
    target = torch.tensor([1, 2, 3, 4, 0], device=device)
    x = x.to(dtype)
    xd = x.double().requires_grad_()
    F.cross_entropy(xd, target.cpu(), reduction="sum", label_smoothing=0.1).backward()
    want = xd.grad
    atol, rtol = TOL[dtype]
    for with_lse in (False, True):
        xk = x.to(device).clone().requires_grad_()
        if with_lse:
            loss, _ = keel.cross_entropy_with_lse(xk, target, reduction="sum", label_smoothing=0.1)
        else:
            loss = keel.cross_entropy(xk, target, reduction="sum", label_smoothing=0.1)
        loss.backward()
        got = xk.grad.double().cpu()
        assert got[:2].isnan().all(), (with_lse, got[:2])
        assert want[:2].isnan().all()
        assert got[2:].isfinite().all(), with_lse
        assert got[2, [5, 99]].eq(torch.tensor(-0.1 / v, dtype=dtype).double()).all(), got[2, [5, 99]]
        torch.testing.assert_close(got[2:], want[2:], atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", devices())
def test_ignore_index_and_all_ignored(device):
    x = torch.randn(4, 6, device=device, requires_grad=True)
    t = torch.tensor([1, 7, 7, 2], device=device)
    loss = keel.cross_entropy(x, t, ignore_index=7)
    torch.testing.assert_close(loss, F.cross_entropy(x, t, ignore_index=7))
    loss.backward()
    assert (x.grad[1:3] == 0).all()
    everything = torch.full((4,), -100, device=device)
    assert torch.isnan(keel.cross_entropy(x, everything)) and torch.isnan(F.cross_entropy(x, everything))
    assert keel.cross_entropy(x, everything, reduction="sum") == 0


def test_gradcheck_f64():
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, -100, 4, 2])
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(lambda z: keel.cross_entropy(z, t, label_smoothing=0.2, reduction=reduction), (x,))
        assert torch.autograd.gradcheck(
            lambda z: torch.ops.keel.cross_entropy(z, t, -100, 0.2, reduction), (x,)
        )
        # Loss and lse, each alone and together.
        assert torch.autograd.gradcheck(lambda z: keel.cross_entropy_with_lse(z, t, reduction=reduction), (x,))
        assert torch.autograd.gradcheck(lambda z: keel.cross_entropy_with_lse(z, t, reduction=reduction)[1], (x,))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    from torch.library import opcheck

    x = torch.randn(6, 11, device=device, requires_grad=True)
    t = targets(6, 11, device)
    # Without class weights, and with them (read by the kernels).
    for reduction, w in [(r, w) for r in REDUCTIONS for w in (None, class_weights(11, device))]:
        opcheck(torch.ops.keel.cross_entropy.default, (x, t, -100, 0.1, reduction, w), test_utils=OPCHECK_UTILS)
        g = torch.randn(6, device=device) if reduction == "none" else torch.tensor(0.5, device=device)
        opcheck(torch.ops.keel.cross_entropy_with_lse.default, (x, t, -100, 0.1, reduction, w), test_utils=OPCHECK_UTILS)
        opcheck(torch.ops.keel.cross_entropy_backward.default, (g, x.detach(), t, -100, 0.1, reduction, None, w), test_utils=OPCHECK_UTILS)
        lse = torch.logsumexp(x.detach(), -1)
        opcheck(torch.ops.keel.cross_entropy_backward.default, (g, x.detach(), t, -100, 0.1, reduction, lse, w), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def head(h, w, t):
        return keel.cross_entropy(h @ w, t, label_smoothing=0.05)

    # With a z-loss on the lse: gradients through both outputs of cross_entropy_with_lse.
    def z_head(h, w, t):
        loss, lse = keel.cross_entropy_with_lse(h @ w, t, label_smoothing=0.05)
        return loss + 1e-2 * lse.square().mean()

    w = torch.randn(16, 50, device=device)
    t = targets(8, 50, device)
    for f in (head, z_head):
        h = torch.randn(8, 16, device=device, requires_grad=True)
        _assert_compiled_matches_eager(torch.compile(f, fullgraph=True), f, h, w, t)


def _assert_compiled_matches_eager(compiled, f, h, w, t):
    """`compiled(h, w, t)` gives f's loss and f's gradient in `h`."""
    out = compiled(h, w, t)
    torch.testing.assert_close(out, f(h, w, t))
    out.backward()
    g = h.grad.clone()
    h.grad = None
    f(h, w, t).backward()
    torch.testing.assert_close(g, h.grad)


BAD = [
    ("target too big", lambda: keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, 5, 1])), r"keel::cross_entropy: argument 'target' holds 5 at row 1, out of range for 5 classes \(and not ignore_index = -100\)"),
    ("negative target", lambda: keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, -1, 1])), r"keel::cross_entropy: argument 'target' holds -1 at row 1, out of range"),
    ("int32 target", lambda: keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 1], dtype=torch.int32)), r"keel::cross_entropy: argument 'target' must have dtype torch.int64"),
    ("target shape", lambda: keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1])), r"keel::cross_entropy: argument 'target' must have shape \[3\]"),
    ("3-d logits, the op", lambda: torch.ops.keel.cross_entropy(torch.randn(2, 3, 5), torch.tensor([0, 1])), r"keel::cross_entropy: argument 'logits' must have 2 dims \[N, V\]"),
    ("0-d logits", lambda: keel.cross_entropy(torch.tensor(1.0), torch.tensor(0)), r"keel::cross_entropy: argument 'logits' must have at least 1 dimension, got a 0-dim tensor"),
    ("3-d logits, target shape", lambda: keel.cross_entropy(torch.randn(2, 3, 5), torch.tensor([0, 1])), r"keel::cross_entropy: argument 'target' must have shape \[2, 5\] for logits \[N, V, d1, \.\.\.\] \(classes in dim 1\) of shape \[2, 3, 5\], got shape \[2\]"),
    ("1-d logits, target shape", lambda: keel.cross_entropy(torch.randn(5), torch.tensor([1])), r"keel::cross_entropy: argument 'target' must have shape \[\] for logits \[V\] of shape \[5\], got shape \[1\]"),
    ("3-d logits, bad target", lambda: keel.cross_entropy(torch.randn(2, 3, 5), torch.full((2, 5), 3)), r"keel::cross_entropy: argument 'target' holds 3 at row 0, out of range for 3 classes"),
    ("no classes", lambda: keel.cross_entropy(torch.randn(3, 0), torch.tensor([0, 1, 1])), r"keel::cross_entropy: argument 'logits' must have at least one class"),
    ("reduction", lambda: keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 1]), reduction="avg"), r"keel::cross_entropy: argument 'reduction' must be \"mean\", \"sum\" or \"none\", got \"avg\""),
    ("label_smoothing", lambda: keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 1]), label_smoothing=-0.1), r"keel::cross_entropy: argument 'label_smoothing' must be in \[0, 1\]"),
    ("integer logits", lambda: keel.cross_entropy(torch.ones(3, 5, dtype=torch.int64), torch.tensor([0, 1, 1])), r"keel::cross_entropy: argument 'logits' must be float32"),
    ("grad shape", lambda: torch.ops.keel.cross_entropy_backward(torch.randn(3), torch.randn(3, 5), torch.tensor([0, 1, 1]), -100, 0.0, "mean"), r"keel::cross_entropy_backward: argument 'grad' must have shape \[\]"),
    ("lse dtype", lambda: torch.ops.keel.cross_entropy_backward(torch.tensor(1.0, dtype=torch.bfloat16), torch.randn(3, 5, dtype=torch.bfloat16), torch.tensor([0, 1, 1]), -100, 0.0, "mean", torch.zeros(3, dtype=torch.bfloat16)), r"keel::cross_entropy_backward: argument 'lse' must have dtype torch.float32 \(cross_entropy_with_lse's lse for torch.bfloat16 logits\), got torch.bfloat16"),
    ("lse shape", lambda: torch.ops.keel.cross_entropy_backward(torch.tensor(1.0), torch.randn(3, 5), torch.tensor([0, 1, 1]), -100, 0.0, "mean", torch.zeros(4)), r"keel::cross_entropy_backward: argument 'lse' must have shape \[3\] \(one per row\), got \[4\]"),
    ("lse device", lambda: torch.ops.keel.cross_entropy_backward(torch.tensor(1.0), torch.randn(3, 5), torch.tensor([0, 1, 1]), -100, 0.0, "mean", torch.zeros(3, device="meta")), r"keel::cross_entropy_backward: argument 'lse'"),
    ("with_lse target", lambda: keel.cross_entropy_with_lse(torch.randn(3, 5), torch.tensor([0, 5, 1])), r"keel::cross_entropy_with_lse: argument 'target' holds 5 at row 1, out of range for 5 classes"),
    ("with_lse negative target", lambda: torch.ops.keel.cross_entropy_with_lse(torch.randn(3, 5), torch.tensor([0, -7, 1])), r"keel::cross_entropy_with_lse: argument 'target' holds -7 at row 1"),
]


# torch's layouts besides [N, V]: one row [V] with a 0-dim target, and classes in dim 1.
OTHER_LAYOUTS = [((7,), ()), ((3, 7, 5), (3, 5)), ((2, 7, 3, 4), (2, 3, 4))]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape,target_shape", OTHER_LAYOUTS, ids=["V", "N,V,d1", "N,V,d1,d2"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_other_layouts_match_torch(device, shape, target_shape, reduction):
    v = shape[0] if len(shape) == 1 else shape[1]
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, v, target_shape, generator=g)
    if t.dim():
        t.view(-1)[::4] = 3 if reduction == "sum" else -100  # ignored rows; a custom ignore_index for "sum"
    t = t.to(device)
    ignore_index = 3 if reduction == "sum" else -100
    for dtype in dtypes_for(device):
        x = make(shape, dtype, device, 0, 4.0)
        xr = x.double().clone().requires_grad_()
        want = F.cross_entropy(xr, t, ignore_index=ignore_index, label_smoothing=0.1, reduction=reduction)
        grad = make(want.shape, dtype, device, 2)
        want.backward(grad.double())
        atol, rtol = TOL[dtype]
        module = keel.nn.CrossEntropyLoss(ignore_index=ignore_index, reduction=reduction, label_smoothing=0.1)
        for call in (lambda x: keel.cross_entropy(x, t, ignore_index, 0.1, reduction), lambda x: module(x, t)):
            xk = x.clone().requires_grad_()
            loss = call(xk)
            assert loss.shape == want.shape and loss.dtype == dtype
            torch.testing.assert_close(loss.double(), want, atol=atol * 10, rtol=rtol * 2)
            loss.backward(grad)
            torch.testing.assert_close(xk.grad.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)


@pytest.mark.parametrize("shape,target_shape", [((0, 0, 2), (0, 2)), ((3, 0, 0), (3, 0)), ((2, 0, 3), (2, 3))])
def test_other_layouts_with_no_classes_get_the_ops_error(shape, target_shape):
    # Rows as [-1, 0] are ambiguous: reshape raised its own error (session 60's fuzz),
    # where [N, 0] logits get the op's.
    want = r"keel::cross_entropy: argument 'logits' must have at least one class \(v > 0\)"
    with pytest.raises(RuntimeError, match=want):
        keel.cross_entropy(torch.randn(shape), torch.zeros(target_shape, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=want):
        keel.nn.CrossEntropyLoss()(torch.randn(shape), torch.zeros(target_shape, dtype=torch.int64))


def test_classes_in_dim_1_of_a_transposed_tensor_need_no_copy():
    # F.cross_entropy(logits.transpose(1, 2), t), the usual way to pass [B, S, V]
    # logits to torch: moving the classes back to the last dim is a view of the
    # contiguous logits, so Keel copies nothing.
    from conftest import DispatchedOps

    x, t = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    with DispatchedOps() as calls:
        loss = keel.cross_entropy(x.transpose(1, 2), t, reduction="none")
    assert not any("clone" in op or "copy" in op for op in calls.ops), calls.ops
    torch.testing.assert_close(loss, F.cross_entropy(x.transpose(1, 2), t, reduction="none"))


@pytest.mark.parametrize("device", devices())
def test_torch_compile_of_classes_in_dim_1(device):
    torch._dynamo.reset()

    def f(h, w, t):  # [B, S, H] @ [H, V] -> [B, V, S], as a torch user writes it
        return keel.cross_entropy((h @ w).transpose(1, 2), t, label_smoothing=0.05)

    w = torch.randn(16, 50, device=device)
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for s in (5, 9):
        h = torch.randn(3, s, 16, device=device, requires_grad=True)
        t = torch.randint(0, 50, (3, s), device=device)
        _assert_compiled_matches_eager(compiled, f, h, w, t)


@pytest.mark.parametrize("name,call,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, call, msg):
    with pytest.raises(RuntimeError, match=msg):
        call()


@pytest.mark.parametrize("device", devices())
def test_nn_module_matches_torch(device):
    x = torch.randn(9, 13, device=device)
    t = targets(9, 13, device, ignore_index=3)
    for kw in (dict(), dict(ignore_index=3, reduction="sum", label_smoothing=0.2), dict(reduction="none")):
        xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss, want = keel.nn.CrossEntropyLoss(**kw)(xk, t), torch.nn.CrossEntropyLoss(**kw)(xr, t)
        torch.testing.assert_close(loss, want)
        loss.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(xk.grad, xr.grad)
    with pytest.raises(ValueError, match="argument 'reduction'"):
        keel.nn.CrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="'size_average' and 'reduce'"):
        keel.nn.CrossEntropyLoss(None, True)
    # torch's positional order
    torch.testing.assert_close(keel.nn.CrossEntropyLoss(None, None, 3)(x, t), torch.nn.CrossEntropyLoss(None, None, 3)(x, t))
    # Probabilities as targets, as torch takes them (test_cross_entropy_forms.py).
    p = torch.softmax(torch.randn_like(x), -1)
    torch.testing.assert_close(keel.nn.CrossEntropyLoss()(x, p), torch.nn.CrossEntropyLoss()(x, p))
    with pytest.raises(RuntimeError, match="keel::cross_entropy: argument 'target' must have dtype torch.int64"):
        keel.nn.CrossEntropyLoss()(x, t.int())


@pytest.mark.parametrize("device", devices()[1:])
def test_cuda_graph_capture_and_replay(device):
    """Forward + backward captured in a CUDA graph (nothing may synchronise there, so the
    target check cannot read back) replay as eager does; a bad target then makes the loss
    and its row's gradient NaN instead of raising."""
    n, v = 64, 1000
    x, t = torch.randn(n, v, device=device), targets(n, v, device)
    xs = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(2):
            xs.grad = None
            keel.cross_entropy(xs, t).backward()
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = keel.cross_entropy(xs, t)
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t)
    want.backward()
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(loss, want.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(xs.grad, xr.grad, atol=atol, rtol=rtol)
    t[3] = v  # out of range, seen only by the replay
    graph.replay()
    torch.cuda.synchronize()
    assert loss.isnan().item()
    assert xs.grad[3].isnan().all().item()


@pytest.fixture
def target_checks_off():
    """keel.set_cuda_target_checks(False) for one test, then as it was."""
    was = keel.set_cuda_target_checks(False)
    yield
    keel.set_cuda_target_checks(was)


def test_set_cuda_target_checks_returns_what_it_was():
    """(On at the start of a process: the environment test below.)"""
    was = keel.cuda_target_checks()
    try:
        assert keel.set_cuda_target_checks(True) is was
        assert keel.set_cuda_target_checks(False) is True
        assert keel.cuda_target_checks() is False
        assert keel.set_cuda_target_checks(False) is False
        with pytest.raises(TypeError, match="keel.set_cuda_target_checks: enabled must be a bool, got int"):
            keel.set_cuda_target_checks(1)
        assert keel.cuda_target_checks() is False
        assert keel.set_cuda_target_checks(True) is False
        assert keel.cuda_target_checks() is True
    finally:
        keel.set_cuda_target_checks(was)


@pytest.mark.parametrize(
    "value,on,warns", [("0", False, False), ("1", True, False), ("", True, False), ("off", True, True)]
)
def test_the_environment_sets_the_checks_starting_state(value, on, warns):
    code = "import keel; print(keel.cuda_target_checks(), keel.set_cuda_target_checks(True), keel.cuda_target_checks())"
    env = dict(os.environ, KEEL_CUDA_TARGET_CHECKS=value)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert r.stdout.split() == [str(on), str(on), "True"]
    warning = "keel: KEEL_CUDA_TARGET_CHECKS=off is neither 0 nor 1; ignored (targets are checked)"
    assert (warning in r.stderr) == warns, r.stderr


def test_cpu_checks_targets_with_the_cuda_check_off(target_checks_off):
    """The switch is CUDA's: the CPU kernels check as they read (no wait to save)."""
    with pytest.raises(RuntimeError, match="keel::cross_entropy: argument 'target' holds 5 at row 1"):
        keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, 5, 1]))


@pytest.mark.parametrize("device", devices()[1:])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_bad_target_with_the_check_off_gives_nan(device, reduction, target_checks_off):
    """With the check off nothing is read back: a bad target's row has a NaN loss and
    gradient, as during graph capture, and the other rows are torch's."""
    n, v = 64, 1000
    x, t = torch.randn(n, v, device=device), targets(n, v, device)
    t[3] = v
    xs = x.clone().requires_grad_()
    loss = keel.cross_entropy(xs, t, reduction=reduction)
    loss.sum().backward()
    if reduction == "none":
        assert loss[3].isnan().item()
    else:
        assert loss.isnan().item()
    assert xs.grad[3].isnan().all().item()
    ok = torch.arange(n, device=device) != 3
    xr = x[ok].clone().requires_grad_()
    want = F.cross_entropy(xr, t[ok], reduction=reduction)
    want.sum().backward()
    atol, rtol = TOL[torch.float32]
    if reduction == "none":
        torch.testing.assert_close(loss[ok].detach(), want.detach(), atol=atol, rtol=rtol)
    if reduction != "mean":  # "mean" divides the good rows by one more row
        torch.testing.assert_close(xs.grad[ok], xr.grad, atol=atol, rtol=rtol)
    keel.set_cuda_target_checks(True)
    with pytest.raises(RuntimeError, match="keel::cross_entropy: argument 'target'"):
        keel.cross_entropy(x, t, reduction=reduction)


def test_meta_and_empty():
    x = torch.empty(5, 7, device="meta")
    t = torch.empty(5, dtype=torch.int64, device="meta")
    assert torch.ops.keel.cross_entropy(x, t, -100, 0.0, "none").shape == (5,)
    assert torch.ops.keel.cross_entropy(x, t, -100, 0.0, "mean").shape == ()
    loss, lse = torch.ops.keel.cross_entropy_with_lse(x, t, -100, 0.0, "mean")
    assert loss.shape == () and lse.shape == (5,) and lse.dtype == torch.float32 and lse.device.type == "meta"
    empty = keel.cross_entropy(torch.empty(0, 4), torch.empty(0, dtype=torch.int64))
    assert torch.isnan(empty) and torch.isnan(F.cross_entropy(torch.empty(0, 4), torch.empty(0, dtype=torch.int64)))


WEIGHT_GRAD_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "cross_entropy_weight_grad.py")


def test_weight_grad_example_runs():
    """examples/cross_entropy_weight_grad.py (docs/BENCHMARKS.md session 88), small: every row timed."""
    out = subprocess.run(
        [sys.executable, WEIGHT_GRAD_SCRIPT, "--n", "16", "--v", "40", "--reps", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    rows = [line for line in out.splitlines() if "torch/this" in line]
    # Two dtypes, two smoothings, three rows each; torch's own row at 1.00x.
    assert len(rows) == 12, out
    assert sum("torch, weights without gradient" in r and "1.00x" in r for r in rows) == 4, out


MEMORY_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "cross_entropy_memory.py")


def test_peak_extra_memory_is_one_logits_buffer_and_below_torch():
    """Forward + backward on CPU, each in a fresh process: peak RSS over the inputs."""
    out = subprocess.run(
        [sys.executable, MEMORY_SCRIPT, "--n", "1024", "--v", "32000", "--json"], capture_output=True, text=True, check=True
    )
    import json

    r = json.loads(out.stdout)
    logits = r["logits_bytes"]
    for dtype in ("float32", "bfloat16"):
        keel_extra, torch_extra = r[dtype]["keel"], r[dtype]["torch"]
        # One logits-sized gradient, plus slack for allocator and page rounding.
        assert keel_extra <= 1.1 * logits[dtype] + 8 * 2**20, (dtype, keel_extra, logits[dtype])
        assert keel_extra < torch_extra, (dtype, keel_extra, torch_extra)
