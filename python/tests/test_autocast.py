"""cross_entropy under torch.autocast returns a float32 loss, as torch's does, with
float32 precision and no float32 copy of the logits (``keel/_autocast.py``)."""
import pytest
import torch
import torch.nn.functional as F

import keel
from conftest import devices

HALF = [torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]


def _entry_points(target, ls, reduction):
    """Every way to call the loss, each on autocast's half-precision logits."""
    return {
        "keel.cross_entropy": lambda h: keel.cross_entropy(h, target, -100, ls, reduction),
        "torch.ops.keel.cross_entropy": lambda h: torch.ops.keel.cross_entropy(h, target, -100, ls, reduction),
        "keel.nn.CrossEntropyLoss": lambda h: keel.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=ls)(h, target),
        "keel.cross_entropy_with_lse": lambda h: keel.cross_entropy_with_lse(h, target, -100, ls, reduction)[0],
        "torch.ops.keel.cross_entropy_with_lse": lambda h: torch.ops.keel.cross_entropy_with_lse(h, target, -100, ls, reduction)[0],
    }


def _layer_and_batch(device):
    """A linear layer into 96 classes, a batch of 16 and its targets, one row ignored."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, device=device)
    x = torch.randn(16, 64, device=device)
    target = torch.randint(0, 96, (16,), device=device)
    target[3] = -100
    return lin, x, target


# Unit roundoff (half an ulp, relative) of each half-precision dtype.
_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _assert_weight_grad_close(got, want, g, xh, name):
    """`got` and `want`, the linear layer's weight gradients ``round(g^T xh)``
    of two logits gradients each within a rounding of the same exact one (`g`,
    torch's; `xh`, the layer's input in the half dtype): they can differ by 2u
    of each |g| (one ulp apart) and each product's own rounding, u of the
    sum; in all at most 4.2u of ``|g|^T |xh|`` (u: the dtype's unit roundoff;
    f32 accumulation adds 16 x 2^-24 of it). A cancelling sum of a bfloat16
    gradient can thus differ far beyond a relative tolerance of itself; where
    nothing cancels the bound is about 4.5u of the value (1.8e-2 in bfloat16,
    2.2e-3 in float16)."""
    scale = g.abs().float().t() @ xh.abs().float()
    allowed = 4.5 * _UNIT[g.dtype] * scale + 1e-7
    err = (got - want).abs()
    worst = (err - allowed).argmax()
    j, k = divmod(worst.item(), err.shape[1])
    assert (err <= allowed).all(), (
        f"{name}: {(err > allowed).sum().item()} weight gradients off; worst [{j}, {k}]: "
        f"{got[j, k].item()} vs torch's {want[j, k].item()}, allowed {allowed[j, k].item():.3g} "
        f"(|g|^T|x| {scale[j, k].item():.3g})"
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_loss_is_float32_with_torchs_value_and_gradient(device, dtype, reduction, ls):
    lin, x, target = _layer_and_batch(device)
    lin.zero_grad()
    with torch.autocast(device, dtype=dtype):
        h = lin(x)
        want = F.cross_entropy(h, target, label_smoothing=ls, reduction=reduction)
    h.retain_grad()
    want.sum().backward()
    want_grad = lin.weight.grad.clone()
    # float64 from the same half-precision logits: what a float32 loss is held to.
    exact = F.cross_entropy(h.detach().double(), target, label_smoothing=ls, reduction=reduction)
    assert want.dtype == torch.float32 and h.grad.dtype == dtype
    for name, call in _entry_points(target, ls, reduction).items():
        lin.zero_grad()
        with torch.autocast(device, dtype=dtype):
            got = call(lin(x))
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        # float32's precision (a bfloat16 loss would be 2e-3 off at these values).
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6 * got.numel(), msg=lambda m: f"{name}: {m}")
        got.sum().backward()
        # The gradient reaches the float32 weight through autocast's casts, as
        # torch's: the half-precision matmul of a logits gradient that (the test
        # below) is the float64 one rounded.
        _assert_weight_grad_close(lin.weight.grad, want_grad, h.grad, x.to(dtype), name)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_logits_gradient_is_the_float64_one_rounded(device, dtype, reduction, ls):
    """Keel's own part of the test above: the gradient each entry point gives
    autocast's half-precision logits is the float64 gradient of the same logits
    rounded to their dtype: within half an ulp (at most 2^-8 of the value in
    bfloat16, 2^-11 in float16) and float32's error, which can tip a rounding.
    (The test above failed on an H200 for bfloat16 "sum" and "none", where
    float16 and "mean" passed; this separates the op from the linear layer.)"""
    lin, x, target = _layer_and_batch(device)
    with torch.autocast(device, dtype=dtype):
        h = lin(x).detach()
    exact = h.double().requires_grad_()
    F.cross_entropy(exact, target, label_smoothing=ls, reduction=reduction).sum().backward()
    half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    # float32's error in each value, and float16's subnormal spacing.
    allowed = half_ulp * exact.grad.abs() * (1 + 1e-5) + 1e-6 * exact.grad.abs().amax(-1, keepdim=True) + 2.0**-24
    for name, call in _entry_points(target, ls, reduction).items():
        hk = h.clone().requires_grad_()
        with torch.autocast(device, dtype=dtype):
            got = call(hk)
        got.sum().backward()
        assert hk.grad.dtype == dtype, name
        err = (hk.grad.double() - exact.grad).abs()
        worst = (err - allowed).argmax()
        i, j = divmod(worst.item(), err.shape[1])
        assert (err <= allowed).all(), (
            f"{name}: {(err > allowed).sum().item()} values off; worst [{i}, {j}] (target {target[i].item()}): "
            f"{hk.grad[i, j].item()} vs float64 {exact.grad[i, j].item()}"
        )


def test_a_large_loss_keeps_float32_precision():
    # At a loss near 36 bfloat16's grid is 0.25 wide: the loss comes from each
    # row's float32 log-sum-exp, not from a rounded bfloat16 loss.
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 1000, generator=g) * 12).bfloat16()
    target = logits.float().argmin(-1)
    exact = F.cross_entropy(logits.double(), target)
    assert exact > 30
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = keel.cross_entropy(logits, target)
    assert got.dtype == torch.float32
    assert abs(got.item() - exact.item()) < 1e-5 * exact.item()
    assert abs(keel.cross_entropy(logits, target).float().item() - exact.item()) > 1e-3  # outside: bfloat16


def test_no_float32_copy_of_the_logits():
    # torch's autocast copies the logits to float32; Keel reads them as they are:
    # no op but Keel's makes a tensor as large as the [N, V] logits (the float32
    # loss comes from [N] values).
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    made.append((str(func), t.numel()))
            return out

    logits = torch.randn(4, 32).bfloat16()
    target = torch.randint(0, 32, (4,))
    for ls in (0.0, 0.1):
        made.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16), Sizes():
            keel.cross_entropy(logits, target, label_smoothing=ls)
        assert any(op.startswith("keel.") for op, _ in made), made
        assert all(n < logits.numel() for op, n in made if not op.startswith("keel.")), made


def test_ignored_rows_and_an_all_ignored_mean():
    logits = torch.randn(5, 7).bfloat16()
    target = torch.tensor([1, -100, 2, -100, 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = keel.cross_entropy(logits, target, reduction="none")
        none_kept = keel.cross_entropy(logits, torch.full((5,), -100))
    assert rows.dtype == torch.float32 and rows[1] == 0 and rows[3] == 0
    torch.testing.assert_close(rows.double(), F.cross_entropy(logits.double(), target, reduction="none"), rtol=1e-6, atol=1e-6)
    assert none_kept.dtype == torch.float32 and none_kept.isnan()  # as torch's


def test_float32_logits_and_other_ops_are_unchanged():
    logits, target = torch.randn(4, 9), torch.randint(0, 9, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert keel.cross_entropy(logits, target).dtype == torch.float32
        assert keel.cross_entropy(logits.double(), target).dtype == torch.float64
        assert keel.softmax(logits.bfloat16()).dtype == torch.bfloat16
    assert keel.cross_entropy(logits.bfloat16(), target).dtype == torch.bfloat16  # outside autocast


def test_errors_name_the_op_called():
    logits = torch.randn(3, 5).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for call in (keel.cross_entropy, torch.ops.keel.cross_entropy):
            with pytest.raises(RuntimeError, match=r"^keel::cross_entropy: argument 'target' holds 9 at row 1"):
                call(logits, torch.tensor([0, 9, 1]))
        with pytest.raises(RuntimeError, match=r"^keel::cross_entropy_with_lse: argument 'target'"):
            keel.cross_entropy_with_lse(logits, torch.tensor([0, 9, 1]))
        with pytest.raises(RuntimeError, match=r"keel::cross_entropy: argument 'logits' must be a Tensor"):
            keel.cross_entropy([1.0, 2.0], torch.tensor([0]))


@pytest.mark.parametrize("fullgraph", [True])
def test_under_torch_compile(fullgraph):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    x, target = torch.randn(8, 16), torch.randint(0, 24, (8,))
    loss_fn = keel.nn.CrossEntropyLoss(label_smoothing=0.1)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(lin(x), target)

    want = step(x)
    got = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(x)
    assert want.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, want)
