"""keel.nn's norms with float32 parameters and half-precision activations (mixed
precision, autocast), as torch's modules accept them."""
import pytest
import torch

import keel
from conftest import assert_close, devices

HALF = [torch.bfloat16, torch.float16]


def _pair(kind, device):
    torch.manual_seed(0)
    if kind == "RMSNorm":
        ours, theirs = keel.nn.RMSNorm(64, eps=1e-6, device=device), torch.nn.RMSNorm(64, eps=1e-6, device=device)
    else:
        ours, theirs = keel.nn.LayerNorm(64, device=device), torch.nn.LayerNorm(64, device=device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_float32_parameters_with_half_activations(kind, dtype, device):
    """Against torch's module in float64 (torch's own half-precision gradients
    differ between versions: 2.10's LayerNorm bias gradient in float16 is 6% off
    on one element here)."""
    ours, theirs = _pair(kind, device)
    x = torch.randn(4, 5, 64, device=device).to(dtype).requires_grad_()
    y = ours(x)
    # torch's module keeps the activations' dtype too (on CPU; its CUDA
    # layer_norm refuses a float32 weight with half activations).
    assert y.dtype == dtype
    if device == "cpu":
        assert theirs(x).dtype == dtype
    ref = theirs.double()
    x64 = x.detach().double().requires_grad_()
    y64 = ref(x64)
    # Keel rounds the weight to the activations' dtype, torch multiplies in float32.
    assert_close(y, y64, dtype, scale=2)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ours.parameters()], g)
    want = torch.autograd.grad(y64, [x64, *ref.parameters()], g.double())
    assert [a.dtype for a in got] == [dtype] + [torch.float32] * (len(got) - 1)
    for a, b in zip(got, want):
        assert_close(a, b, dtype, scale=4)


def test_autocast_training_step():
    """A Linear then the norm under CPU autocast (bfloat16), one SGD step: the
    float32 parameters move as torch's do."""
    results = []
    for norm_cls in (keel.nn.RMSNorm, torch.nn.RMSNorm):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), norm_cls(64, eps=1e-6))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert a.dtype == torch.float32
        assert_close(a, b, torch.bfloat16)


def test_functional_api_still_refuses_a_weight_of_another_dtype():
    """The ops and the functional API keep their check: only the modules, which own
    their parameters, cast them."""
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(8)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: argument 'weight' has dtype torch.float32"):
        keel.rms_norm(x, w)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: argument 'weight'"):
        keel.rms_norm(x, w.long())


@pytest.mark.parametrize("device", devices())
def test_ops_keep_their_inputs_dtype_under_autocast(device):
    """Under autocast Keel's ops compute in their inputs' dtype (f32
    accumulation) and return it, where torch's autocast runs softmax and
    layer_norm on CUDA in float32 and returns float32: the values are torch's
    float32 results rounded once (README, "Mixed precision"). cross_entropy
    returns a float32 loss, as torch's (``_autocast``; test_autocast.py)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, device=device)
    x = torch.randn(16, 64, device=device)
    target = torch.randint(0, 96, (16,), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        h = lin(x)
        assert h.dtype == torch.bfloat16
        got = {
            "cross_entropy": keel.cross_entropy(h, target),
            "softmax": keel.softmax(h, 0.5),
            "layer_norm": keel.layer_norm(h),
            "rms_norm": keel.rms_norm(h),
        }
    hf = h.float()
    want = {
        "cross_entropy": torch.nn.functional.cross_entropy(hf, target),
        "softmax": torch.softmax(hf * 0.5, -1),
        "layer_norm": torch.nn.functional.layer_norm(hf, (96,)),
        "rms_norm": torch.nn.functional.rms_norm(hf, (96,), eps=1e-6),
    }
    for name, out in got.items():
        if name == "cross_entropy":
            assert out.dtype == torch.float32
            assert_close(out, want[name], torch.float32)
            continue
        assert out.dtype == torch.bfloat16, name
        assert_close(out, want[name].bfloat16(), torch.bfloat16)
    # The loss is differentiable back to the float32 parameters through autocast's
    # casts, with torch's gradient (its loss is float32; the gradient's bfloat16
    # rounding is the same on both sides: h's).
    got["cross_entropy"].backward()
    ours, lin.weight.grad = lin.weight.grad, None
    with torch.autocast(device, dtype=torch.bfloat16):
        torch.nn.functional.cross_entropy(lin(x), target).backward()
    assert ours.dtype == torch.float32
    assert_close(ours, lin.weight.grad, torch.bfloat16)
