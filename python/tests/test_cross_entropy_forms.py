"""keel.cross_entropy in torch's forms that the fused op does not take itself,
against F.cross_entropy: class weights (``weight=``; every reduction, dtype, label
smoothing and ignored rows in test_cross_entropy.py; here torch's other layouts,
keel.cross_entropy_with_lse, keel.nn's module with the weight a buffer, autocast,
torch.compile, gradcheck, bad weights) and probability targets (with and without
weights and label smoothing, gradients in logits and target, layouts, bad ones)."""
import pytest
import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode

import keel
from conftest import TOL, devices, dtypes_for, make, widest
from test_cross_entropy import REDUCTIONS, class_weights, targets


@pytest.mark.parametrize("device", devices())
def test_weight_of_another_float_dtype_is_rounded_to_the_logits_dtype(device):
    """torch refuses it with class indices; Keel rounds it to the logits' dtype,
    which the kernels read (the loss is rounded to that dtype anyway)."""
    x = make((16, 50), torch.bfloat16, device, 0, 3.0)
    t = targets(16, 50, device)
    w = class_weights(50, device, torch.float64)
    want = F.cross_entropy(x.double(), t, weight=w, label_smoothing=0.1)
    got = keel.cross_entropy(x, t, label_smoothing=0.1, weight=w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.1, rtol=0.032)


@pytest.mark.parametrize("device", devices())
def test_weights_change_the_loss(device):
    """Not a loss that ignores them: doubling one class's weight moves "sum" by that class's rows."""
    x, t = make((8, 5), widest(device), device, 0), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], device=device)
    w = torch.ones(5, dtype=x.dtype, device=device)
    plain = keel.cross_entropy(x, t, reduction="none")
    w[2] = 3.0
    weighted = keel.cross_entropy(x, t, reduction="none", weight=w)
    torch.testing.assert_close(weighted, plain * torch.where(t == 2, 3.0, 1.0))
    # "mean" divides by the weights' sum over the rows: (sum of w_t l_t) / (6 + 2 * 3).
    torch.testing.assert_close(keel.cross_entropy(x, t, weight=w), weighted.sum() / 12)


@pytest.mark.parametrize("device", devices())
def test_mean_divides_by_the_weights_of_rows_not_ignored(device):
    x = make((6, 4), widest(device), device, 0)
    t = torch.tensor([1, -100, 2, 1, -100, 3], device=device)
    w = torch.tensor([5.0, 0.5, 2.0, 0.0], dtype=x.dtype, device=device)
    for ls in (0.0, 0.3):
        want = F.cross_entropy(x, t, weight=w, label_smoothing=ls)
        torch.testing.assert_close(keel.cross_entropy(x, t, label_smoothing=ls, weight=w), want)
    # Every row ignored, or every weight of the targets 0: 0 / 0, NaN as torch.
    for tt, ww in ((torch.full_like(t, -100), w), (torch.full_like(t, 3), w)):
        got, want = keel.cross_entropy(x, tt, weight=ww), F.cross_entropy(x, tt, weight=ww)
        assert want.isnan() and got.isnan()


@pytest.mark.parametrize("device", devices())
def test_other_layouts_take_the_weight_of_dim_1(device):
    w = class_weights(7, device)
    x = make((2, 7, 3), torch.float32, device, 0, 2.0)  # [N, V, d1]
    t = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(1)).to(device)
    t[0, 1] = -100
    for reduction in REDUCTIONS:
        for ls in (0.0, 0.2):
            xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            got = keel.cross_entropy(xk, t, label_smoothing=ls, reduction=reduction, weight=w)
            want = F.cross_entropy(xr, t, weight=w, label_smoothing=ls, reduction=reduction)
            torch.testing.assert_close(got, want)
            got.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(xk.grad, xr.grad)
    one = make((7,), torch.float32, device, 3)  # [V] with a 0-dim target
    target = torch.tensor(4, device=device)
    torch.testing.assert_close(keel.cross_entropy(one, target, weight=w), F.cross_entropy(one, target, weight=w))


@pytest.mark.parametrize("device", devices())
def test_with_lse_takes_the_weight(device):
    x = make((9, 40), torch.float32, device, 0, 3.0)
    t = targets(9, 40, device)
    w = class_weights(40, device)
    xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, lse = keel.cross_entropy_with_lse(xk, t, label_smoothing=0.1, weight=w)
    live = t != -100
    want = F.cross_entropy(xr, t, weight=w, label_smoothing=0.1)
    want_lse = torch.logsumexp(xr, -1) * live
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(lse, want_lse)
    (loss + 0.3 * lse.square().sum()).backward()
    (want + 0.3 * want_lse.square().sum()).backward()
    torch.testing.assert_close(xk.grad, xr.grad)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("weight_grad", [False, True])  # the fused kernel reads them; the composite
def test_with_lse_takes_probabilities_and_the_weight(device, weight_grad):
    x = make((9, 40), torch.float32, device, 0, 3.0)
    p = probabilities((9, 40), device)
    wk = class_weights(40, device).requires_grad_(weight_grad)
    wr = wk.detach().clone().requires_grad_(weight_grad)
    xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    for reduction in REDUCTIONS:
        loss, lse = keel.cross_entropy_with_lse(xk, p, label_smoothing=0.1, reduction=reduction, weight=wk)
        want = F.cross_entropy(xr, p, weight=wr, label_smoothing=0.1, reduction=reduction)
        want_lse = torch.logsumexp(xr, -1)
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(lse, want_lse)
        (loss.sum() + 0.3 * lse.square().sum()).backward()
        (want.sum() + 0.3 * want_lse.square().sum()).backward()
        torch.testing.assert_close(xk.grad, xr.grad)
        if weight_grad:
            torch.testing.assert_close(wk.grad, wr.grad)


def test_gradcheck_f64():
    """float64, which Keel takes on CPU only (the CUDA gradients: test_cross_entropy.py's)."""
    device = "cpu"
    x = make((4, 6), torch.float64, device, 0).requires_grad_()
    t = torch.tensor([0, 5, -100, 2], device=device)
    w = class_weights(6, device, torch.float64)
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(
            lambda x: keel.cross_entropy(x, t, label_smoothing=0.2, reduction=reduction, weight=w), (x,)
        )


@pytest.mark.parametrize("device", devices())
def test_nn_module_keeps_the_weight_as_a_buffer(device):
    w = class_weights(13, "cpu")
    x = torch.randn(9, 13, device=device)
    t = targets(9, 13, device, ignore_index=3)
    ours = keel.nn.CrossEntropyLoss(w, ignore_index=3, label_smoothing=0.1).to(device)
    theirs = torch.nn.CrossEntropyLoss(w, ignore_index=3, label_smoothing=0.1).to(device)
    assert ours.weight.device == x.device and list(ours.state_dict()) == ["weight"]
    xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, want = ours(xk, t), theirs(xr, t)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    torch.testing.assert_close(xk.grad, xr.grad)
    # A state_dict from torch's module loads into Keel's.
    fresh = keel.nn.CrossEntropyLoss(torch.ones(13), ignore_index=3, label_smoothing=0.1).to(device)
    fresh.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(fresh(x, t), theirs(x, t))
    with pytest.raises(TypeError, match="keel.nn.CrossEntropyLoss: argument 'weight' must be a Tensor or None"):
        keel.nn.CrossEntropyLoss([1.0, 2.0])


def test_autocast_loss_is_float32_as_torch():
    x = make((12, 30), torch.float32, "cpu", 0, 3.0)
    t = targets(12, 30, "cpu")
    w = class_weights(30, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ torch.eye(30)  # bfloat16 under autocast
        got = keel.cross_entropy(h, t, label_smoothing=0.1, weight=w)
        want = F.cross_entropy(h, t, weight=w, label_smoothing=0.1)
        p = torch.softmax(x.flip(0), -1)
        got_p, want_p = keel.cross_entropy(h, p, weight=w), F.cross_entropy(h, p, weight=w)
        # bfloat16 probabilities: the op's fused kernel, through the typed API and
        # through torch.ops (whose autocast kernel gives the float32 loss, with float32
        # weights as given: the kernel gets them in bfloat16, the value does not).
        pb = p.bfloat16()
        bf16_targets = [
            keel.cross_entropy(h, pb, label_smoothing=0.1),
            torch.ops.keel.cross_entropy(h, pb, -100, 0.1, "sum"),
            keel.cross_entropy(h, pb, label_smoothing=0.1, weight=w),
            torch.ops.keel.cross_entropy(h, pb, -100, 0.1, "none", w),
        ]
        want_bf16 = [
            F.cross_entropy(h, pb, label_smoothing=0.1),
            F.cross_entropy(h, pb, label_smoothing=0.1, reduction="sum"),
            F.cross_entropy(h, pb, label_smoothing=0.1, weight=w),
            F.cross_entropy(h, pb, label_smoothing=0.1, weight=w, reduction="none"),
        ]
        # Class indices with float32 weights through torch.ops: the float32 value
        # takes them as given (the kernels read them in bfloat16).
        by_op = [torch.ops.keel.cross_entropy(h, t, -100, ls, r, w) for ls in (0.0, 0.1) for r in REDUCTIONS]
        want_op = [F.cross_entropy(h, t, weight=w, label_smoothing=ls, reduction=r) for ls in (0.0, 0.1) for r in REDUCTIONS]
    assert h.dtype == torch.bfloat16 and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for got_f, want_f in zip(by_op, want_op):
        assert got_f.dtype == want_f.dtype == torch.float32
        torch.testing.assert_close(got_f, want_f, atol=1e-4, rtol=1e-4)
    assert got_p.dtype == want_p.dtype == torch.float32
    torch.testing.assert_close(got_p, want_p, atol=1e-4, rtol=1e-4)
    for got_f, want_f in zip(bf16_targets, want_bf16):
        assert got_f.dtype == want_f.dtype == torch.float32
        torch.testing.assert_close(got_f, want_f, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", devices())
def test_compile_matches_eager(device):
    torch._dynamo.reset()

    def f(h, w, t, cw):
        return keel.cross_entropy(h @ w, t, label_smoothing=0.05, weight=cw)

    w, cw = torch.randn(16, 50, device=device), class_weights(50, device)
    h = torch.randn(8, 16, device=device, requires_grad=True)
    t = targets(8, 50, device)
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(h, w, t, cw)
    torch.testing.assert_close(out, f(h, w, t, cw))
    out.backward()
    g = h.grad.clone()
    h.grad = None
    f(h, w, t, cw).backward()
    torch.testing.assert_close(g, h.grad)


BAD_WEIGHT = [
    ("weight shape", dict(weight=torch.ones(4)), r"keel::cross_entropy: argument 'weight' must have shape \[5\] \(one weight per class\), got shape \[4\]"),
    ("weight 2-D", dict(weight=torch.ones(1, 5)), r"keel::cross_entropy: argument 'weight' must have shape \[5\]"),
    ("weight int", dict(weight=torch.ones(5, dtype=torch.int64)), r"keel::cross_entropy: argument 'weight' must be a floating-point tensor, got torch.int64"),
    ("weight device", dict(weight=torch.ones(5, device="meta")), r"keel::cross_entropy: argument 'weight' must be on the device of 'logits' \(cpu\), got meta"),
    ("weight list", dict(weight=[1.0] * 5), r"keel::cross_entropy: argument 'weight' must be a Tensor or None, got list"),
    ("weight sparse", dict(weight=torch.ones(5).to_sparse()), r"keel::cross_entropy: argument 'weight' must be a dense \(strided\) tensor"),
    ("reduction", dict(weight=torch.ones(5), reduction="avg"), r"keel::cross_entropy: argument 'reduction' must be \"mean\", \"sum\" or \"none\", got \"avg\""),
    ("label_smoothing", dict(weight=torch.ones(5), label_smoothing=1.5), r"keel::cross_entropy: argument 'label_smoothing' must be in \[0, 1\], got 1.5"),
    ("label_smoothing NaN", dict(weight=torch.ones(5), label_smoothing=float("nan")), r"keel::cross_entropy: argument 'label_smoothing' must be in \[0, 1\], got NaN"),
    ("label_smoothing str", dict(weight=torch.ones(5), label_smoothing="0.1"), r"keel::cross_entropy: argument 'label_smoothing' must be a float, got str"),
]


@pytest.mark.parametrize("kw,msg", [b[1:] for b in BAD_WEIGHT], ids=[b[0] for b in BAD_WEIGHT])
def test_bad_weight_raises_runtime_error_naming_op_and_argument(kw, msg):
    x, t = torch.randn(3, 5), torch.tensor([0, 4, 1])
    with pytest.raises(RuntimeError, match=msg):
        keel.cross_entropy(x, t, **kw)
    with pytest.raises(RuntimeError, match=msg.replace("cross_entropy", "cross_entropy_with_lse", 1)):
        keel.cross_entropy_with_lse(x, t, **kw)


def test_bad_logits_or_target_with_a_weight_name_the_op_called():
    w = torch.ones(5)
    with pytest.raises(RuntimeError, match=r"keel::cross_entropy: argument 'target' holds 5 at row 1, out of range"):
        keel.cross_entropy(torch.randn(3, 5), torch.tensor([0, 5, 1]), weight=w)
    with pytest.raises(RuntimeError, match=r"keel::cross_entropy: argument 'logits' must be float32, float16, bfloat16 or float64, got torch.int64"):
        keel.cross_entropy(torch.ones(3, 5, dtype=torch.int64), torch.tensor([0, 4, 1]), weight=w)
    with pytest.raises(RuntimeError, match=r"keel::cross_entropy_with_lse: argument 'target' holds 5 at row 1"):
        keel.cross_entropy_with_lse(torch.randn(3, 5), torch.tensor([0, 5, 1]), weight=w)


def probabilities(shape, device, dtype=torch.float32, seed=5):
    """Rows of probabilities over dim 1 (the classes, as torch), some of them one-hot."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(shape, generator=g, dtype=torch.float64) * 2, 1 if len(shape) > 1 else 0)
    if len(shape) == 2 and shape[0] > 1:
        p[0] = 0
        p[0, shape[1] - 1] = 1
    return p.to(dtype).to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,v", [(1, 1), (5, 7), (64, 1000), (3, 32000)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("target_grad", [True, False])
def test_probability_targets_match_torch(device, n, v, reduction, label_smoothing, weighted, target_grad):
    """Against torch in float64; where the target needs no gradient, the op's fused
    kernel takes it (``_ce_forms.fused``), with the weights where given."""
    for dtype in dtypes_for(device):
        x = make((n, v), dtype, device, 0, 4.0)
        p = probabilities((n, v), device, dtype)
        w = class_weights(v, device, dtype) if weighted else None
        xr, pr = x.double().clone().requires_grad_(), p.double().clone().requires_grad_()
        wr = None if w is None else w.double()
        want = F.cross_entropy(xr, pr, weight=wr, label_smoothing=label_smoothing, reduction=reduction)
        g = make(want.shape, dtype, device, 2) if reduction == "none" else torch.tensor(1.5, dtype=dtype, device=device)
        want.backward(g.double())
        atol, rtol = TOL[dtype]
        xk, pk = x.clone().requires_grad_(), p.clone().requires_grad_(target_grad)
        loss = keel.cross_entropy(xk, pk, label_smoothing=label_smoothing, reduction=reduction, weight=w)
        assert loss.shape == want.shape and loss.dtype == dtype
        torch.testing.assert_close(loss.double(), want, atol=atol * 10, rtol=rtol * 2)
        loss.backward(g)
        torch.testing.assert_close(xk.grad.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)
        if not target_grad:
            continue
        # The target's gradient, g w (lse - x_c), is a difference of terms up to
        # m = |g| |w| (|lse| + |x|): two roundings of size m in the dtype (torch's own
        # float16 and bfloat16 results miss the float64 one by more than Keel's).
        m = g.abs().max().double() * (1 if w is None else w.abs().max().double())
        m = m * (xr.detach().abs().max() + torch.logsumexp(xr.detach(), -1).abs().max())
        unit = torch.finfo(dtype).eps / 2
        torch.testing.assert_close(pk.grad.double(), pr.grad, atol=max(atol, 2 * unit * m.item()), rtol=rtol * 2)


MIXED = [  # logits, target, weight (None: no weight)
    (torch.bfloat16, torch.float32, None),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float16, torch.float32, None),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float64),
    (torch.float16, torch.bfloat16, None),
    (torch.bfloat16, torch.float16, torch.float16),
    (torch.float32, torch.bfloat16, None),
    (torch.float32, torch.float16, torch.float16),
    (torch.float32, torch.float64, None),
    (torch.float32, torch.float32, torch.float64),
    (torch.float64, torch.bfloat16, None),
    (torch.float64, torch.float32, torch.float32),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("xd,pd,wd", MIXED, ids=[" ".join(str(d)[6:] for d in m if d) for m in MIXED])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("target_grad", [True, False])
def test_probability_targets_of_other_dtypes_promote_as_torch(device, xd, pd, wd, reduction, target_grad):
    """The loss has torch's dtype, the promotion of the logits', the target's and
    the weights' (bfloat16 logits and a float32 target: a float32 loss), and its
    value is torch's in float64 within the tolerance of the narrowest dtype; each
    gradient has its input's dtype. A float32 target for 16-bit logits with no
    gradient goes to the fused kernel as it is (``_ce_forms.fused``), and targets of
    other dtypes widened to one it reads (test below)."""
    if xd not in dtypes_for(device):
        pytest.skip(f"{xd} logits are not taken on {device}")
    x = make((5, 300), xd, device, 0, 3.0)
    p = probabilities((5, 300), device, pd)
    w = None if wd is None else class_weights(300, device, wd)
    want_dtype = F.cross_entropy(x, p, weight=w, reduction=reduction).dtype
    xk, pk = x.clone().requires_grad_(), p.clone().requires_grad_(target_grad)
    got = keel.cross_entropy(xk, pk, weight=w, label_smoothing=0.1, reduction=reduction)
    assert got.dtype == want_dtype
    xr, pr = x.double().requires_grad_(), p.double().requires_grad_()
    want = F.cross_entropy(xr, pr, weight=None if w is None else w.double(), label_smoothing=0.1, reduction=reduction)
    atol, rtol = max(TOL[xd], TOL[pd])
    torch.testing.assert_close(got.double(), want, atol=atol * 10, rtol=rtol * 2)
    if pd != xd:
        # The target's dtype is not the logits': the loss's value in the wider
        # dtype, from the op's float32 loss (a float32 target of 16-bit logits)
        # or built on its float32 lse, not from a loss rounded to the logits' dtype.
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-6, rtol=2e-6)
    got.sum().backward()
    want.sum().backward()
    assert xk.grad.dtype == xd and (not target_grad or pk.grad.dtype == pd)
    torch.testing.assert_close(xk.grad.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)


class _Calls(TorchDispatchMode):
    """Records each op called beneath autograd: its overload and arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))

    def names(self):
        return [func.__name__ for func, _ in self.calls]


# logits, target, weight needing a gradient (or None), the target's dtype in the op's
# fused kernel (int64: the composite, which calls the op with class-0 targets).
WIDENED = [
    (torch.float32, torch.bfloat16, None, torch.bfloat16),  # read as it is
    (torch.float32, torch.float16, torch.float16, torch.float16),
    (torch.float16, torch.bfloat16, None, torch.bfloat16),
    (torch.bfloat16, torch.float16, torch.float16, torch.float16),
    (torch.float32, torch.bfloat16, torch.float32, torch.float32),  # weights a bfloat16 target does not hold
    (torch.float16, torch.bfloat16, torch.float16, torch.float32),
    (torch.float64, torch.float32, torch.float32, torch.float64),
    (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32),  # for the weights
    (torch.float16, torch.float16, torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16, torch.float64, torch.int64),  # weights wider than the op's
    (torch.float32, torch.float64, None, torch.int64),  # a float64 loss
]


@pytest.mark.parametrize("xd,pd,wd,read", WIDENED, ids=[" ".join(str(d)[6:] for d in m if d) for m in WIDENED])
@pytest.mark.parametrize("with_lse", [False, True])
def test_probability_targets_of_other_dtypes_are_widened_for_the_fused_kernel(xd, pd, wd, read, with_lse):
    """A target of a dtype the op reads beside the logits goes to it as it is
    (two of float32, float16 and bfloat16); one it does not read is widened to
    one it reads where that holds its values (``_ce_forms.target_dtype``), and
    the values of the weights (the op reads them in the target's dtype): the
    fused kernel, not the composite, through cross_entropy and
    cross_entropy_with_lse (which refused these pairs before), with the target
    and weights needing gradients; the values are torch's in float64."""
    x = make((6, 70), xd, "cpu", 0, 3.0).requires_grad_()
    p = probabilities((6, 70), "cpu", pd).requires_grad_()
    w = None if wd is None else class_weights(70, "cpu", wd).requires_grad_()
    calls = _Calls()
    with calls:
        if with_lse:
            got, lse = keel.cross_entropy_with_lse(x, p, label_smoothing=0.1, weight=w)
            torch.testing.assert_close(lse.double(), torch.logsumexp(x.detach().double(), -1), atol=1e-5, rtol=1e-6)
        else:
            got = keel.cross_entropy(x, p, label_smoothing=0.1, weight=w)
    forwards = [(f.__name__, a[1].dtype) for f, a in calls.calls if f.namespace == "keel" and "backward" not in f.__name__]
    assert forwards == [("_cross_entropy_with_lse_nograd.default", read)]  # the autograd formula's twin
    args = [t.detach().double().requires_grad_() for t in (x, p) + (() if w is None else (w,))]
    want = F.cross_entropy(args[0], args[1], weight=args[2] if w is not None else None, label_smoothing=0.1)
    assert got.dtype == want.dtype if xd == torch.float64 else got.dtype == torch.promote_types(torch.promote_types(xd, pd), wd or xd)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=2e-6)
    got.backward()
    want.backward()
    for mine, ref in zip((x, p) + (() if w is None else (w,)), args):
        atol, rtol = TOL[mine.dtype]
        assert mine.grad.dtype == mine.dtype
        torch.testing.assert_close(mine.grad.double(), ref.grad, atol=atol * 2, rtol=rtol * 2)


@pytest.mark.parametrize("device", devices())
def test_probability_targets_in_other_layouts(device):
    x = make((2, 7, 3, 2), torch.float32, device, 0, 2.0)  # [N, V, d1, d2]
    p = torch.softmax(make((2, 7, 3, 2), torch.float32, device, 1), 1)
    w = class_weights(7, device)
    for reduction in REDUCTIONS:
        for kw in (dict(), dict(label_smoothing=0.2, weight=w)):
            xk, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            got = keel.cross_entropy(xk, p, reduction=reduction, **kw)
            want = F.cross_entropy(xr, p, reduction=reduction, **kw)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)
            got.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(xk.grad, xr.grad)
    one, q = make((7,), torch.float32, device, 3), torch.softmax(make((7,), torch.float32, device, 4), 0)  # [V]
    torch.testing.assert_close(keel.cross_entropy(one, q, weight=w), F.cross_entropy(one, q, weight=w))
    # The module takes them too.
    m, ref = keel.nn.CrossEntropyLoss(w, label_smoothing=0.1), torch.nn.CrossEntropyLoss(w, label_smoothing=0.1)
    torch.testing.assert_close(m(x, p), ref(x, p))


@pytest.mark.parametrize("device", devices())
def test_probability_targets_of_no_rows_mean_nan_as_torch(device):
    x, p = torch.randn(0, 5, device=device), torch.rand(0, 5, device=device)
    assert keel.cross_entropy(x, p).isnan() and F.cross_entropy(x, p).isnan()
    assert keel.cross_entropy(x, p, reduction="sum") == 0
    assert keel.cross_entropy(x, p, reduction="none").shape == (0,)


def test_probability_targets_gradcheck():
    x = make((4, 6), torch.float64, "cpu", 0).requires_grad_()
    p = probabilities((4, 6), "cpu", torch.float64).requires_grad_()
    w = class_weights(6, "cpu", torch.float64)
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(
            lambda x, p: keel.cross_entropy(x, p, label_smoothing=0.2, reduction=reduction, weight=w), (x, p)
        )
        # The fused kernel (a target with no gradient, with and without weights),
        # and its second derivative.
        for weight in (None, w):
            fused = lambda x: keel.cross_entropy(x, p.detach(), label_smoothing=0.2, reduction=reduction, weight=weight)  # noqa: E731
            assert torch.autograd.gradcheck(fused, (x,)) and torch.autograd.gradgradcheck(fused, (x,))


@pytest.mark.parametrize("device", devices())
def test_probability_targets_weight_gradient(device):
    """Weights that need a gradient: of the target's dtype they go to the fused
    op, whose formula gives their gradient (also with the target needing one);
    float32 weights of bfloat16 logits and target too, with the target widened
    to float32 (``_ce_forms.target_dtype``). Either way the gradients are
    torch's."""
    cases = [(d, d, d) for d in dtypes_for(device)]
    cases += [(d, torch.float32, torch.float32) for d in dtypes_for(device) if d in (torch.float16, torch.bfloat16)]
    cases += [(d, d, torch.float32) for d in dtypes_for(device) if d in (torch.float16, torch.bfloat16)]
    for xd, pd, wd in cases:
        x = make((6, 40), xd, device, 0, 3.0)
        for label_smoothing in (0.0, 0.1):
            for target_grad in (False, True):
                pk = probabilities((6, 40), device, pd).requires_grad_(target_grad)
                wk = class_weights(40, device, wd).requires_grad_()
                wr = wk.detach().double().requires_grad_()
                pr = pk.detach().double().requires_grad_(target_grad)
                got = keel.cross_entropy(x, pk, weight=wk, label_smoothing=label_smoothing, reduction="sum")
                want = F.cross_entropy(x.double(), pr, weight=wr, label_smoothing=label_smoothing, reduction="sum")
                assert got.dtype == torch.promote_types(torch.promote_types(xd, pd), wd)
                atol, rtol = TOL[xd]
                torch.testing.assert_close(got.double(), want, atol=atol * 10, rtol=rtol * 2)
                got.backward()
                want.backward()
                # The weights' gradient, sum_i q_i (lse_i - x_i) over 6 rows, in its dtype.
                atol, rtol = TOL[wd] if wd != torch.float32 else TOL[xd]
                torch.testing.assert_close(wk.grad.double(), wr.grad, atol=atol * 10, rtol=rtol * 2)
                if target_grad:
                    torch.testing.assert_close(pk.grad.double(), pr.grad, atol=atol * 10, rtol=rtol * 2)


def test_probability_targets_compile():
    torch._dynamo.reset()

    def f(h, w, p, cw):
        return keel.cross_entropy(h @ w, p, label_smoothing=0.05, weight=cw)

    w, p = torch.randn(16, 50), probabilities((8, 50), "cpu")
    for cw in (None, class_weights(50, "cpu")):  # the op with its weight argument too
        h = torch.randn(8, 16, requires_grad=True)
        hr = h.detach().clone().requires_grad_()
        out = torch.compile(f, fullgraph=True)(h, w, p, cw)
        want = F.cross_entropy(hr @ w, p, label_smoothing=0.05, weight=cw)
        torch.testing.assert_close(out, want)
        out.backward()
        want.backward()
        torch.testing.assert_close(h.grad, hr.grad)


BAD_PROBABILITIES = [
    ("shape", lambda: keel.cross_entropy(torch.randn(3, 5), torch.rand(3, 4)), r"keel::cross_entropy: argument 'target' of probabilities \(a float tensor\) must have the shape of 'logits' \[3, 5\], got shape \[3, 4\]"),
    ("device", lambda: keel.cross_entropy(torch.randn(3, 5), torch.rand(3, 5, device="meta")), r"keel::cross_entropy: argument 'target' must be on the device of 'logits' \(cpu\), got meta"),
    ("sparse", lambda: keel.cross_entropy(torch.randn(3, 5), torch.rand(3, 5).to_sparse()), r"keel::cross_entropy: argument 'target' must be a dense \(strided\) tensor"),
    ("sparse logits", lambda: keel.cross_entropy(torch.randn(3, 5).to_sparse(), torch.rand(3, 5)), r"keel::cross_entropy: argument 'logits' is a torch.sparse_coo tensor"),
    ("no classes", lambda: keel.cross_entropy(torch.randn(3, 0), torch.rand(3, 0)), r"keel::cross_entropy: argument 'logits' must have at least one class for probability targets, got shape \[3, 0\]"),
    ("int logits", lambda: keel.cross_entropy(torch.ones(3, 5, dtype=torch.int64), torch.rand(3, 5)), r"keel::cross_entropy: argument 'logits' must be float32, float16, bfloat16 or float64, got torch.int64"),
    ("weight shape", lambda: keel.cross_entropy(torch.randn(3, 5), torch.rand(3, 5), weight=torch.ones(3)), r"keel::cross_entropy: argument 'weight' must have shape \[5\]"),
    ("ignore_index", lambda: keel.nn.CrossEntropyLoss(ignore_index=0)(torch.randn(3, 5), torch.rand(3, 5)), r"keel::cross_entropy: argument 'ignore_index' applies to class indices only, not to probabilities \(a float target\), got 0"),
    ("ignore_index 1, with_lse", lambda: keel.cross_entropy_with_lse(torch.randn(3, 5), torch.rand(3, 5), 1), r"keel::cross_entropy_with_lse: argument 'ignore_index' applies to class indices only, not to probabilities \(a float target\), got 1"),
    ("ignore_index not an int", lambda: keel.cross_entropy(torch.randn(3, 5), torch.rand(3, 5), "-1"), r"keel::cross_entropy: argument 'ignore_index' must be an int, got str"),
    ("reduction", lambda: keel.cross_entropy(torch.randn(3, 5), torch.rand(3, 5), reduction="avg"), r"keel::cross_entropy: argument 'reduction' must be"),
    ("label_smoothing", lambda: keel.cross_entropy(torch.randn(3, 5), torch.rand(3, 5), label_smoothing=-0.1), r"keel::cross_entropy: argument 'label_smoothing' must be in \[0, 1\], got -0.1"),
]


@pytest.mark.parametrize("call,msg", [b[1:] for b in BAD_PROBABILITIES], ids=[b[0] for b in BAD_PROBABILITIES])
def test_bad_probability_targets_raise_naming_op_and_argument(call, msg):
    with pytest.raises(RuntimeError, match=msg):
        call()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("ignore_index", [-1, -100, -7])
def test_probability_targets_take_a_negative_ignore_index_as_torch(device, ignore_index):
    """torch refuses an ignore_index of 0 or more with probabilities and takes a
    negative one, which no class has and which changes nothing (``nn.CrossEntropyLoss
    (ignore_index=-1)`` given soft labels, say); so do the typed API, the module and
    the op called directly, forward and backward."""
    x, p = make((4, 9), torch.float32, device, 0, 3.0), probabilities((4, 9), device)
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, p, ignore_index=ignore_index, label_smoothing=0.1)
    want.backward()
    for call in (
        lambda x: keel.cross_entropy(x, p, ignore_index, 0.1),
        lambda x: keel.cross_entropy_with_lse(x, p, ignore_index, 0.1)[0],
        lambda x: keel.nn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=0.1)(x, p),
        lambda x: torch.ops.keel.cross_entropy(x, p, ignore_index, 0.1),
    ):
        xk = x.clone().requires_grad_()
        got = call(xk)
        got.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(xk.grad, xr.grad)
    g = make((4,), torch.float32, device, 2)
    lse = torch.logsumexp(x, -1)
    for given in (None, lse):
        got = torch.ops.keel.cross_entropy_backward(g, x, p, ignore_index, 0.1, "none", given)
        xn = x.clone().requires_grad_()
        F.cross_entropy(xn, p, label_smoothing=0.1, reduction="none").backward(g)
        torch.testing.assert_close(got, xn.grad)


def test_torch_func_grad_and_vmap_match_torch():
    x = make((4, 6), torch.float64, "cpu", 0)
    w = class_weights(6, "cpu", torch.float64)
    p = probabilities((4, 6), "cpu", torch.float64)
    for target, w in ((torch.tensor([0, 5, -100, 2]), w), (p, w), (p, None)):  # (p, ...): the fused kernel
        got = torch.func.grad(lambda x: keel.cross_entropy(x, target, label_smoothing=0.1, weight=w))(x)
        want = torch.func.grad(lambda x: F.cross_entropy(x, target, label_smoothing=0.1, weight=w))(x)
        torch.testing.assert_close(got, want)
        xs = make((3, 4, 6), torch.float64, "cpu", 1)
        got = torch.vmap(lambda x: keel.cross_entropy(x, target, weight=w))(xs)
        torch.testing.assert_close(got, torch.vmap(lambda x: F.cross_entropy(x, target, weight=w))(xs))


def test_the_op_takes_probabilities_of_the_logits_dtype_on_cpu():
    """torch.ops.keel's cross_entropy ops take a float target of the logits' dtype and
    shape (the fused kernel); the backward given the forward's lse and without it."""
    x, p = make((4, 9), torch.float32, "cpu", 0, 3.0), probabilities((4, 9), "cpu")
    loss, lse = torch.ops.keel.cross_entropy_with_lse(x, p, -100, 0.1, "none")
    torch.testing.assert_close(loss, F.cross_entropy(x, p, label_smoothing=0.1, reduction="none"))
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))
    torch.testing.assert_close(torch.ops.keel.cross_entropy(x, p), F.cross_entropy(x, p))
    g = make((4,), torch.float32, "cpu", 2)
    xr = x.clone().requires_grad_()
    F.cross_entropy(xr, p, label_smoothing=0.1, reduction="none").backward(g)
    for given in (None, lse):
        torch.testing.assert_close(torch.ops.keel.cross_entropy_backward(g, x, p, -100, 0.1, "none", given), xr.grad)
    bad = [
        (lambda: torch.ops.keel.cross_entropy(x, p.double()), r"keel::cross_entropy: argument 'target' of probabilities must have the logits' dtype torch.float32 \(or, for float32, float16 and bfloat16 logits, another of those three\), got torch.float64"),
        (lambda: torch.ops.keel.cross_entropy(x.double(), p.half()), r"keel::cross_entropy: argument 'target' of probabilities must have the logits' dtype torch.float64 \(or, for float32, float16 and bfloat16 logits, another of those three\), got torch.float16"),
        (lambda: torch.ops.keel.cross_entropy(x, p.half(), -100, 0.0, "mean", class_weights(9, "cpu")), r"keel::cross_entropy: argument 'weight' must have the target's dtype torch.float16 \(probabilities of torch.float32 logits\), got torch.float32"),
        (lambda: torch.ops.keel.cross_entropy(x, p[:, :5]), r"keel::cross_entropy: argument 'target' of probabilities must have the logits' shape \[4, 9\], got \[4, 5\]"),
        (lambda: torch.ops.keel.cross_entropy(x, p, 0), r"keel::cross_entropy: argument 'ignore_index' applies to class indices only, not to probabilities \(a float target\), got 0"),
        (lambda: torch.ops.keel.cross_entropy(x, p.int()), r"keel::cross_entropy: argument 'target' must have dtype torch.int64 \(class indices\) or the logits' torch.float32 \(probabilities\), got torch.int32"),
        (lambda: torch.ops.keel.cross_entropy_backward(g, x, p.double(), -100, 0.1, "none"), r"keel::cross_entropy_backward: argument 'target' of probabilities must have the logits' dtype torch.float32 \(or, for float32, float16 and bfloat16 logits, another of those three\), got torch.float64"),
        (lambda: torch.ops.keel.cross_entropy_backward(g.half(), x, p.half(), -100, 0.1, "none"), r"keel::cross_entropy_backward: argument 'grad' must have the loss's dtype torch.float32 \(that of a torch.float16 target of torch.float32 logits\), got torch.float16"),
    ]
    for call, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            call()


@pytest.mark.parametrize("device", devices())
def test_the_op_reads_float32_probabilities_of_16bit_logits(device):
    """torch.ops.keel's cross_entropy ops take a float32 target for float16 and
    bfloat16 logits and read it as it is (a teacher's float32 softmax against a
    student's logits), and a 16-bit target of float32 logits or of the other
    16-bit dtype: the loss is float32 (torch's promotion), and so is its
    gradient; the class weights have the target's dtype; loss, lse, the backward op given the lse and without it, with and
    without class weights and label smoothing, against float64 with the same
    target; then a target value that bfloat16 cannot hold, whose gradient is not
    that of the rounded value."""
    narrow = [d for d in dtypes_for(device) if d in (torch.float32, torch.float16, torch.bfloat16)]
    for dtype, pd in ((d, e) for d in narrow for e in narrow if d != e):
        atol, rtol = TOL[dtype]
        x, p = make((6, 1000), dtype, device, 0, 3.0), probabilities((6, 1000), device, pd)
        # Weights of the target's dtype (float32 ones of values 16-bit floats cannot hold).
        for w in (None, class_weights(1000, device, pd)):
            for ls in (0.0, 0.1):
                xr = x.double().requires_grad_()
                wr = None if w is None else w.double()
                want = F.cross_entropy(xr, p.double(), weight=wr, label_smoothing=ls, reduction="none")
                g = make((6,), torch.float32, device, 2)
                want.backward(g.double())
                loss, lse = torch.ops.keel.cross_entropy_with_lse(x, p, -100, ls, "none", w)
                assert loss.dtype == torch.float32
                # Sums of a thousand float32 terms of size |x|: float32's error, not the logits'.
                torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-5)
                mean = torch.ops.keel.cross_entropy(x, p, -100, ls, "mean", w)
                assert mean.dtype == torch.float32
                torch.testing.assert_close(mean.double(), want.detach().mean(), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), -1), atol=1e-5, rtol=1e-5)
                for given in (None, lse):
                    dx = torch.ops.keel.cross_entropy_backward(g, x, p, -100, ls, "none", given, w)
                    assert dx.dtype == dtype
                    torch.testing.assert_close(dx.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)
    # dx_0 = A / 4 - p_0 = -0.75 p_0 for uniform logits and a target p_0 at class
    # 0: 1 + 3 2^-10 gives -0.75220, bfloat16 -0.75391; the target rounded to
    # bfloat16 (1) would give -0.75.
    x = torch.zeros(1, 4, dtype=torch.bfloat16, device=device)
    p = torch.tensor([[1 + 3 / 1024, 0.0, 0.0, 0.0]], device=device)
    one = torch.ones((), device=device)
    dx = torch.ops.keel.cross_entropy_backward(one, x, p, -100, 0.0, "sum")
    assert dx[0, 0].item() == -0.75390625, dx
    with pytest.raises(RuntimeError, match=r"keel::cross_entropy_backward: argument 'grad' must have the loss's dtype torch.float32 \(that of a torch.float32 target of torch.bfloat16 logits\), got torch.bfloat16"):
        torch.ops.keel.cross_entropy_backward(one.bfloat16(), x, p, -100, 0.0, "sum")
    w = torch.ones(4, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match=r"keel::cross_entropy: argument 'weight' must have the target's dtype torch.float32 \(probabilities of torch.bfloat16 logits\), got torch.bfloat16"):
        torch.ops.keel.cross_entropy(x, p, -100, 0.0, "sum", w)
    # Through the typed API (the fused kernel): the float32 loss, and the gradient.
    xk = x.clone().requires_grad_()
    loss = keel.cross_entropy(xk, p, reduction="sum")
    assert loss.dtype == torch.float32
    loss.backward()
    assert xk.grad[0, 0].item() == -0.75390625, xk.grad


@pytest.mark.parametrize("device", devices())
def test_opcheck_with_float32_probabilities_of_bfloat16_logits(device):
    """The fake (meta) rule gives the float32 loss the kernels write."""
    from torch.library import opcheck

    from conftest import OPCHECK_UTILS

    x = make((6, 11), torch.bfloat16, device, 0).requires_grad_()
    p = probabilities((6, 11), device, torch.float32)
    for reduction, w in [(r, w) for r in REDUCTIONS for w in (None, class_weights(11, device, torch.float32))]:
        args = (x, p, -100, 0.1, reduction, w)
        opcheck(torch.ops.keel.cross_entropy.default, args, test_utils=OPCHECK_UTILS)
        opcheck(torch.ops.keel.cross_entropy_with_lse.default, args, test_utils=OPCHECK_UTILS)
        g = torch.randn(6, device=device) if reduction == "none" else torch.tensor(0.5, device=device)
        lse = torch.logsumexp(x.detach().float(), -1)
        for given in (None, lse):
            bwd = (g, x.detach(), p, -100, 0.1, reduction, given, w)
            opcheck(torch.ops.keel.cross_entropy_backward.default, bwd, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices()[1:])
def test_cuda_op_takes_probabilities(device):
    """The CUDA kernels against probabilities, through torch.ops and the typed API
    (fused: no weight, a target of the logits' dtype with no gradient)."""
    for dtype in dtypes_for(device):
        x, p = make((6, 1000), dtype, device, 0, 3.0), probabilities((6, 1000), device, dtype)
        atol, rtol = TOL[dtype]
        xr = x.double().requires_grad_()
        want = F.cross_entropy(xr, p.double(), label_smoothing=0.1, reduction="none")
        g = make((6,), dtype, device, 2)
        want.backward(g.double())
        loss, lse = torch.ops.keel.cross_entropy_with_lse(x, p, -100, 0.1, "none")
        torch.testing.assert_close(loss.double(), want.detach(), atol=atol * 10, rtol=rtol * 2)
        torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), -1), atol=1e-5, rtol=1e-5)
        for given in (None, lse):
            dx = torch.ops.keel.cross_entropy_backward(g, x, p, -100, 0.1, "none", given)
            torch.testing.assert_close(dx.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)
        xk = x.clone().requires_grad_()
        got = keel.cross_entropy(xk, p, label_smoothing=0.1)
        got.backward()
        xr.grad = None
        want = F.cross_entropy(xr, p.double(), label_smoothing=0.1)
        want.backward()
        torch.testing.assert_close(got.double(), want.detach(), atol=atol * 10, rtol=rtol * 2)
        torch.testing.assert_close(xk.grad.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_op_takes_class_weights_with_probabilities(device, reduction):
    """torch.ops.keel's cross_entropy ops with their ``weight`` argument (the kernels
    read the weights beside each row): loss, lse, the backward op given the lse and
    without it, and autograd through the op, the weights' gradient included."""
    for dtype in dtypes_for(device):
        atol, rtol = TOL[dtype]
        x, p = make((6, 300), dtype, device, 0, 3.0), probabilities((6, 300), device, dtype)
        w = class_weights(300, device, dtype)
        w[3] = 0
        for ls in (0.0, 0.1):
            xr, wr = x.double().clone().requires_grad_(), w.double().clone().requires_grad_()
            want = F.cross_entropy(xr, p.double(), weight=wr, label_smoothing=ls, reduction=reduction)
            g = make(want.shape, dtype, device, 2)
            want.backward(g.double())
            loss, lse = torch.ops.keel.cross_entropy_with_lse(x, p, -100, ls, reduction, w)
            torch.testing.assert_close(loss.double(), want.detach(), atol=atol * 10, rtol=rtol * 2)
            torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), -1), atol=1e-5, rtol=1e-5)
            plain = torch.ops.keel.cross_entropy(x, p, -100, ls, reduction, w)
            torch.testing.assert_close(plain, loss, atol=0, rtol=0)
            assert_weighted_gradients(g, x, p, w, ls, reduction, lse, xr.grad, wr.grad)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_op_takes_class_weights_with_class_indices(device, reduction):
    """torch.ops.keel's cross_entropy ops with ``weight`` and class indices (the kernels
    read ``w[t]``, and ``sum(w x)`` with label smoothing), ignored rows and a zero
    weight: loss, lse, the backward op given the lse and without it, and autograd
    through the op, the weights' gradient included (``"mean"`` divides by the
    targets' weights, which takes a term of its own)."""
    for dtype in dtypes_for(device):
        atol, rtol = TOL[dtype]
        x, t = make((8, 300), dtype, device, 0, 3.0), targets(8, 300, device)
        w = class_weights(300, device, dtype)
        w[t[0]] = 0
        for ls in (0.0, 0.1):
            xr, wr = x.double().clone().requires_grad_(), w.double().clone().requires_grad_()
            want = class_weighted_loss(xr, t, wr, ls, reduction)
            torch.testing.assert_close(
                want, F.cross_entropy(xr, t, weight=wr.detach(), label_smoothing=ls, reduction=reduction)
            )
            g = make(want.shape, dtype, device, 2)
            want.backward(g.double())
            loss, lse = torch.ops.keel.cross_entropy_with_lse(x, t, -100, ls, reduction, w)
            assert loss.dtype == dtype
            torch.testing.assert_close(loss.double(), want.detach(), atol=atol * 10, rtol=rtol * 2)
            want_lse = torch.logsumexp(x.double(), -1) * (t != -100)
            torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.ops.keel.cross_entropy(x, t, -100, ls, reduction, w), loss, atol=0, rtol=0)
            assert_weighted_gradients(g, x, t, w, ls, reduction, lse, xr.grad, wr.grad)


def assert_weighted_gradients(g, x, target, w, ls, reduction, lse, want_x, want_w):
    """The logits' gradient from ``cross_entropy_backward`` (given `lse` and
    without it), and the logits' and weights' from autograd through both
    cross_entropy ops with weights `w`, against the float64 references
    `want_x` and `want_w` (the weights' tolerance scales with their largest)."""
    atol, rtol = TOL[x.dtype]
    for given in (None, lse):
        dx = torch.ops.keel.cross_entropy_backward(g, x, target, -100, ls, reduction, given, w)
        torch.testing.assert_close(dx.double(), want_x, atol=atol * 2, rtol=rtol * 2)
    for op in (torch.ops.keel.cross_entropy, torch.ops.keel.cross_entropy_with_lse):
        xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = op(xk, target, -100, ls, reduction, wk)
        (out[0] if isinstance(out, tuple) else out).backward(g)
        torch.testing.assert_close(xk.grad.double(), want_x, atol=atol * 2, rtol=rtol * 2)
        scale = want_w.abs().max().item()
        torch.testing.assert_close(wk.grad.double(), want_w, atol=atol * 10 * scale, rtol=rtol * 2)


def class_weighted_loss(x, t, w, ls, reduction):
    """torch's class-index loss with weights ``w``, differentiable in them (torch's
    own is not): ``-(1 - ls) w_t log p_t - ls / C sum_c w_c log p_c`` per row not
    ignored, "mean" over the targets' weights."""
    live = t != -100
    logp = torch.log_softmax(x, -1)[live]
    tl = t[live]
    rows = -(1 - ls) * w[tl] * logp[torch.arange(len(tl)), tl] - ls / x.shape[1] * (logp * w).sum(-1)
    if reduction == "none":
        return torch.zeros(x.shape[0], dtype=x.dtype, device=x.device).masked_scatter(live, rows)
    return rows.sum() / w[tl].sum() if reduction == "mean" else rows.sum()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_index_weights_needing_a_gradient(device, reduction):
    """keel.cross_entropy and keel.cross_entropy_with_lse with class indices and
    weights that need a gradient (``_ce_forms.weighted``: applied to the op's
    unweighted per-row results; torch's own loss is not differentiable in
    them): loss and gradients in logits and weights against the float64
    reference, ignored rows and a zero weight, with and without label smoothing."""
    for dtype in dtypes_for(device):
        atol, rtol = TOL[dtype]
        x, t = make((8, 300), dtype, device, 0, 3.0), targets(8, 300, device)
        w = class_weights(300, device, torch.float32)
        w[t[1]] = 0
        for ls in (0.0, 0.1):
            xr, wr = x.double().clone().requires_grad_(), w.double().clone().requires_grad_()
            want = class_weighted_loss(xr, t, wr, ls, reduction)
            g = make(want.shape, torch.float64, device, 2)
            want.backward(g)
            for call in (keel.cross_entropy, lambda *a, **k: keel.cross_entropy_with_lse(*a, **k)[0]):
                xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
                got = call(xk, t, label_smoothing=ls, reduction=reduction, weight=wk)
                torch.testing.assert_close(got.double(), want.detach(), atol=atol * 10, rtol=rtol * 2)
                got.backward(g.to(got.dtype))
                torch.testing.assert_close(xk.grad.double(), xr.grad, atol=atol * 2, rtol=rtol * 2)
                scale = wr.grad.abs().max().item()
                torch.testing.assert_close(wk.grad.double(), wr.grad, atol=atol * 10 * scale, rtol=rtol * 2)


def test_the_ops_class_index_weights_gradcheck():
    """First and second derivatives through the op with class indices and weights
    (``_autograd._ce_class_weight_grad``, ``_twice``), both inputs, ignored rows."""
    x = make((5, 7), torch.float64, "cpu", 0).requires_grad_()
    w = class_weights(7, "cpu", torch.float64).requires_grad_()
    t = torch.tensor([1, -100, 6, 1, 0])
    for reduction in REDUCTIONS:
        for ls in (0.0, 0.2):
            op = lambda x, w: torch.ops.keel.cross_entropy(x, t, -100, ls, reduction, w)  # noqa: E731
            assert torch.autograd.gradcheck(op, (x, w))
            assert torch.autograd.gradgradcheck(op, (x, w))


def test_the_ops_weights_gradcheck():
    """Second derivatives through the op with weights (``_twice``), both inputs."""
    x = make((4, 7), torch.float64, "cpu", 0).requires_grad_()
    w = class_weights(7, "cpu", torch.float64).requires_grad_()
    p = probabilities((4, 7), "cpu", torch.float64)
    for reduction in REDUCTIONS:
        op = lambda x, w: torch.ops.keel.cross_entropy(x, p, -100, 0.2, reduction, w)  # noqa: E731
        assert torch.autograd.gradcheck(op, (x, w))
        assert torch.autograd.gradgradcheck(op, (x, w))


@pytest.mark.parametrize("target", ["indices", "probabilities"])
def test_the_op_called_directly_keeps_its_lse_for_the_backward(target):
    """``torch.ops.keel.cross_entropy`` where a gradient is wanted runs the twin
    of ``cross_entropy_with_lse`` (``_autograd.KEEPS``): its backward takes that
    lse (one read of each row of logits), and so do the target's and weights'
    formulas (no logsumexp of their own); values as torch's."""
    x = make((6, 40), torch.float32, "cpu", 0, 3.0).requires_grad_()
    w = class_weights(40, "cpu").requires_grad_()
    t = torch.tensor([1, -100, 6, 39, 0, 2]) if target == "indices" else probabilities((6, 40), "cpu").requires_grad_()
    calls = _Calls()
    with calls:
        loss = torch.ops.keel.cross_entropy(x, t, -100, 0.1, "sum", w)
        loss.backward()
    assert "_cross_entropy_with_lse_nograd.default" in calls.names()
    assert [a[5] is not None for f, a in calls.calls if f.__name__.startswith("_cross_entropy_backward_nograd")] == [True]
    assert not any("logsumexp" in n for n in calls.names()), calls.names()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if target == "indices":  # torch's own loss gives class-index weights no gradient
        want = class_weighted_loss(xr, t, wr, 0.1, "sum")
    else:
        tr = t.detach().clone().requires_grad_()
        want = F.cross_entropy(xr, tr, weight=wr, label_smoothing=0.1, reduction="sum")
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    if target == "probabilities":
        torch.testing.assert_close(t.grad, tr.grad)


def test_the_ops_target_gradcheck():
    """A probability target needing a gradient through the ops themselves
    (``_autograd._ce_target_grad``; ``keel.cross_entropy`` builds such a target
    on the op's lse instead): first and second derivatives in logits, target and
    weights, with and without weights and label smoothing, each reduction, both
    forward ops."""
    x = make((5, 7), torch.float64, "cpu", 0).requires_grad_()
    p = probabilities((5, 7), "cpu", torch.float64).requires_grad_()
    w = class_weights(7, "cpu", torch.float64).requires_grad_()
    for op in (torch.ops.keel.cross_entropy, torch.ops.keel.cross_entropy_with_lse):
        for reduction in REDUCTIONS:
            for ls in (0.0, 0.2):
                f = lambda x, p, *w: op(x, p, -100, ls, reduction, w[0] if w else None)  # noqa: E731
                for args in ((x, p), (x, p, w)):
                    assert torch.autograd.gradcheck(f, args)
                    assert torch.autograd.gradgradcheck(f, args)
    # The target's gradient alone, against torch's.
    for reduction in REDUCTIONS:
        pk, pr = p.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
        torch.ops.keel.cross_entropy(x.detach(), pk, -100, 0.1, reduction, w.detach()).sum().backward()
        F.cross_entropy(x.detach(), pr, w.detach(), label_smoothing=0.1, reduction=reduction).sum().backward()
        torch.testing.assert_close(pk.grad, pr.grad)


BAD_OP_WEIGHT = [
    ("class indices dtype", lambda x, p, w: torch.ops.keel.cross_entropy(x, torch.tensor([0, 1, 2, 3]), -100, 0.0, "mean", w.half()), r"keel::cross_entropy: argument 'weight' has dtype torch.float16 but 'logits' has torch.float32"),
    ("class indices shape", lambda x, p, w: torch.ops.keel.cross_entropy_with_lse(x, torch.tensor([0, 1, 2, 3]), -100, 0.1, "none", w[1:]), r"keel::cross_entropy_with_lse: argument 'weight' must have shape \[9\]"),
    ("class indices backward", lambda x, p, w: torch.ops.keel.cross_entropy_backward(torch.ones(()), x, torch.tensor([0, 1, 2, 3]), -100, 0.0, "sum", None, w[:, None]), r"keel::cross_entropy_backward: argument 'weight' must have shape \[9\]"),
    ("dtype", lambda x, p, w: torch.ops.keel.cross_entropy(x, p, -100, 0.0, "mean", w.double()), r"keel::cross_entropy: argument 'weight' has dtype torch.float64 but 'logits' has torch.float32"),
    ("shape", lambda x, p, w: torch.ops.keel.cross_entropy_with_lse(x, p, -100, 0.0, "mean", w[:5]), r"keel::cross_entropy_with_lse: argument 'weight' must have shape \[9\]"),
    ("device", lambda x, p, w: torch.ops.keel.cross_entropy(x, p, -100, 0.0, "mean", w.to("meta")), r"keel::cross_entropy: argument 'weight' is on meta but 'logits' is on cpu"),
    ("backward", lambda x, p, w: torch.ops.keel.cross_entropy_backward(torch.ones(()), x, p, -100, 0.0, "sum", None, w[None]), r"keel::cross_entropy_backward: argument 'weight' must have shape \[9\]"),
]


@pytest.mark.parametrize("call,msg", [b[1:] for b in BAD_OP_WEIGHT], ids=[b[0] for b in BAD_OP_WEIGHT])
def test_the_ops_bad_weight_raises_naming_op_and_argument(call, msg):
    x, p = make((4, 9), torch.float32, "cpu", 0), probabilities((4, 9), "cpu")
    with pytest.raises(RuntimeError, match=msg):
        call(x, p, class_weights(9, "cpu"))
