"""keel.cross_entropy on random combinations of its forms, against its definition
in float64, seeded so that a failure repeats.

The grid tests (test_cross_entropy.py, test_cross_entropy_forms.py) take each form
on its own: class weights, probability targets of each dtype, torch's layouts,
ignored rows, label smoothing, gradients in each input. Here they come together at
random: logits of every dtype and layout (a transposed view among them), far from 0
at times, class indices with ignored rows or probabilities (normalised or not) of
any float dtype, weights of any float dtype (zeros among them), every reduction and
smoothing, and a gradient asked of any of the three inputs, with a random cotangent.

Each result is held against ``_reference``, the plain formula in float64 (itself
checked against torch's float64 ``F.cross_entropy`` on every case), within the
tolerance of the narrowest dtype taking part. Where torch takes the inputs in
their own dtypes, the loss has torch's dtype and Keel must take them too; where
torch's float64 refuses them, Keel refuses, naming itself.
"""
import random

import pytest
import torch
import torch.nn.functional as F

import keel
from conftest import devices, dtypes_for

# Within a few units in the last place of a dtype, relative to the result's scale.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FLOATS = list(TOL)


def _reference(x, t, w, ignore_index, smoothing, reduction):
    """F.cross_entropy's definition, differentiable in all three float inputs:
    log-softmax over dim 1 (dim 0 of one row), a row's loss ``(1 - s) w_t nll + s/V
    sum_c w_c (-log p_c)`` for class indices (0 for ignored rows, the mean over their
    weights) and ``-sum_c w_c ((1 - s) t_c + s/V) log p_c`` for probabilities (the
    mean over the rows). Returns the loss and the size of the terms that each
    gradient of a row is a difference of (where those cancel to an exact 0, as
    ``A softmax - a`` of one class does), per unit of the loss's gradient: in the
    logits ``max |w| max(1, sum |t|)``, in the weights ``max |log p|``, each over
    the mean's divisor."""
    v = x.shape[0] if x.dim() == 1 else x.shape[1]
    rows = x[None] if x.dim() == 1 else x.movedim(1, -1).reshape(-1, v)
    logp = torch.log_softmax(rows, -1)
    ww = torch.ones(v, dtype=x.dtype) if w is None else w
    if t.dtype.is_floating_point:
        tt = (t[None] if t.dim() == 1 else t.movedim(1, -1).reshape(-1, v)) * (1 - smoothing) + smoothing / v
        per_row = -(logp * tt * ww).sum(-1)
        denom = torch.tensor(float(per_row.numel()), dtype=x.dtype)
    else:
        tr = t.reshape(-1)
        valid = tr != ignore_index
        safe = torch.where(valid, tr, 0)
        # Ignored rows masked, not multiplied by 0: torch's gradients there are 0
        # even where the mean is NaN (every row ignored).
        wt = torch.where(valid, ww[safe], 0.0)
        nll = -logp.gather(1, safe[:, None]).squeeze(1) * wt
        smooth = torch.where(valid, -(logp * ww).sum(-1), 0.0)
        per_row = torch.where(valid, (1 - smoothing) * nll + smoothing / v * smooth, 0.0)
        denom = wt.sum()
    mass = float(ww.detach().abs().max()) if v else 0.0
    if t.dtype.is_floating_point and t.numel():
        mass *= max(1.0, float(t.detach().abs().sum(0 if t.dim() == 1 else 1).max()))
    spread = float(logp.detach().abs().max()) if logp.numel() else 0.0
    per = 1.0
    if reduction == "mean":
        per = 1.0 / abs(float(denom)) if float(denom) else 0.0
    terms = {"logits": mass * per, "target": 0.0, "weight": spread * per}
    if reduction == "mean":
        # NaN over no weight, label smoothing or not (torch's 0/0 of its nll term).
        return per_row.sum() / torch.where(denom == 0, torch.nan, denom), terms
    if reduction == "sum":
        return per_row.sum(), terms
    return per_row.reshape(() if x.dim() == 1 else x.shape[:1] + x.shape[2:]), terms


def _logits(rng, g, xd, device):
    """Random logits of a random layout: ``[V]``, ``[N, V]`` or ``[N, V, d...]`` (at
    times the transposed view of ``[N, d, V]`` logits)."""
    v = rng.choice([1, 2, 3, 5, 16, 33, 130])
    rank = rng.choice([1, 2, 2, 2, 3, 4])
    n = rng.choice([0, 1, 3, 7, 40]) if rank == 2 else rng.choice([1, 2, 3])
    extra = [rng.choice([1, 2, 5]) for _ in range(rank - 2)]
    scale, offset = rng.choice([1.0, 4.0, 20.0]), rng.choice([0.0, 0.0, -30.0, 300.0])
    if rank == 1:
        shape = [v]
    elif rank == 3 and rng.random() < 0.5:
        return (torch.randn([n, extra[0], v], generator=g, dtype=torch.float64) * scale + offset).to(xd).to(device).transpose(1, 2)
    else:
        shape = [n, v] + extra
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(xd).to(device)


def _target(rng, g, x, ignore_index, device):
    """Class indices with some rows ignored, or probabilities of a random dtype."""
    v = x.shape[0] if x.dim() == 1 else x.shape[1]
    if rng.random() < 0.5:
        shape = [] if x.dim() == 1 else [x.shape[0]] + list(x.shape[2:])
        t = torch.randint(0, v, shape, generator=g)
        if ignore_index < 0:
            t = torch.where(torch.rand(shape, generator=g) < 0.2, ignore_index, t)
        return t.to(device)
    pd = rng.choice([x.dtype, x.dtype] + FLOATS)
    raw = torch.randn(x.shape, generator=g, dtype=torch.float64)
    p = raw.softmax(0 if x.dim() == 1 else 1) if rng.random() < 0.7 else raw.abs()
    return p.to(pd).to(device)


def _case(rng, device):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    xd = rng.choice(dtypes_for(device))
    x = _logits(rng, g, xd, device)
    v = x.shape[0] if x.dim() == 1 else x.shape[1]
    ignore_index = rng.choice([-100, -100, -1, 1])
    t = _target(rng, g, x, ignore_index, device)
    w = None
    if rng.random() < 0.5:
        w = torch.rand(v, generator=g, dtype=torch.float64) * 1.8 + 0.2
        if v > 1 and rng.random() < 0.3:
            w[rng.randrange(v)] = 0.0
        w = w.to(rng.choice([xd, xd] + [d for d in FLOATS if d in dtypes_for(device)])).to(device)
    kw = dict(
        ignore_index=ignore_index,
        label_smoothing=rng.choice([0.0, 0.0, 0.1, 1.0]),
        reduction=rng.choice(["mean", "sum", "none"]),
    )
    grads = (rng.random() < 0.8, t.dtype.is_floating_point and rng.random() < 0.4, w is not None and rng.random() < 0.3)
    return x, t, w, kw, grads


def _leaf(a, grad):
    return None if a is None else a.detach().clone().requires_grad_(grad)


def _cotangent(g, loss):
    return (torch.rand(loss.shape, generator=g, dtype=torch.float64) + 0.5).to(loss.dtype).to(loss.device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(10))
def test_cross_entropy_forms_at_random_agree_with_the_definition(device, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    checked = 0
    for i in range(80):
        x, t, w, kw, grads = _case(rng, device)
        where = (
            f"case {i}: logits {x.dtype} {tuple(x.shape)} stride {x.stride()}, target {t.dtype} {tuple(t.shape)}, "
            f"weight {None if w is None else w.dtype}, {kw}, grads {grads}"
        )
        f64 = [None if a is None else (a.double() if a.is_floating_point() else a).cpu() for a in (x, t, w)]
        try:
            torch_want = F.cross_entropy(f64[0], f64[1], weight=f64[2], **kw)
        except (RuntimeError, ValueError):
            with pytest.raises((RuntimeError, ValueError), match=r"keel"):
                keel.cross_entropy(x, t, weight=w, **kw)
            continue
        leaves = [_leaf(a, r and a is not None and a.is_floating_point()) for a, r in zip(f64, grads)]
        want, terms = _reference(*(_leaf(a, False) for a in f64), kw["ignore_index"], kw["label_smoothing"], kw["reduction"])
        torch.testing.assert_close(want, torch_want, rtol=1e-12, atol=1e-12, equal_nan=True, msg=lambda m: f"{where}\n{m}")
        if grads[2] and not t.dtype.is_floating_point:
            # torch's nll_loss has no gradient in its weights: the definition's.
            want = _reference(leaves[0], leaves[1], leaves[2], kw["ignore_index"], kw["label_smoothing"], kw["reduction"])[0]
        else:
            want = F.cross_entropy(leaves[0], leaves[1], weight=leaves[2], **kw)
        try:
            torch_dtype = F.cross_entropy(x, t, weight=w, **kw).dtype
        except (RuntimeError, ValueError):
            torch_dtype = None  # torch refuses these dtypes together; Keel may take them

        ours = [_leaf(a, r and a is not None and a.is_floating_point()) for a, r in zip((x, t, w), grads)]
        got = keel.cross_entropy(ours[0], ours[1], weight=ours[2], **kw)
        assert torch_dtype is None or got.dtype == torch_dtype, where
        assert got.shape == want.shape, where
        taking_part = {x.dtype, got.dtype} | {a.dtype for a in (t, w) if a is not None and a.is_floating_point()}
        tol = max(TOL[d] for d in taking_part)
        scale = max(float(want.detach().abs().nan_to_num(0, 0, 0).max()) if want.numel() else 0.0, 1.0)
        torch.testing.assert_close(got.double().cpu(), want.detach(), rtol=tol, atol=tol * scale, equal_nan=True, msg=lambda m: f"{where}\n{m}")
        checked += 1

        needs = [a for a in ours if a is not None and a.requires_grad]
        if not needs or got.numel() == 0:
            continue
        cot = _cotangent(g, got)
        got.backward(cot)
        want.backward(cot.double().cpu())
        for name, a, ref in zip(("logits", "target", "weight"), ours, leaves):
            if a is None or not a.requires_grad:
                continue
            assert a.grad is not None and a.grad.dtype == a.dtype, f"{where}: {name}"
            biggest = float(ref.grad.abs().nan_to_num(0, 0, 0).max()) if ref.grad.numel() else 0.0
            gscale = max(biggest, terms[name] * float(cot.abs().max()))
            torch.testing.assert_close(
                a.grad.double().cpu(), ref.grad, rtol=tol, atol=tol * gscale, equal_nan=True, msg=lambda m: f"{where}: d{name}\n{m}"
            )
    assert checked >= 40  # the generator reaches the comparisons, not only refusals
