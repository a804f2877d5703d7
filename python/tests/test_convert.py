"""keel.nn.convert: torch's RMSNorm, LayerNorm and CrossEntropyLoss in a model
swapped for Keel's, on the same parameters: the same outputs and gradients (to
the dtype's tolerance), the same state dict, an optimizer made before still
training the model."""
import pytest
import torch
from torch import nn

import keel
from conftest import assert_close, devices


class Block(nn.Module):
    def __init__(self, n=32):
        super().__init__()
        self.up = nn.Linear(n, n)
        self.rms = nn.RMSNorm(n, eps=1e-5)
        self.rms_plain = nn.RMSNorm(n, elementwise_affine=False)
        self.ln = nn.LayerNorm(n, eps=1e-3)
        self.ln_nobias = nn.LayerNorm(n, bias=False)
        self.ln_plain = nn.LayerNorm((4, n // 4), elementwise_affine=False)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(n, n), nn.LayerNorm(n)) for _ in range(2)])

    def forward(self, x):
        h = self.rms_plain(self.rms(self.up(x)))
        h = self.ln_nobias(self.ln(h))
        h = self.ln_plain(h.view(*h.shape[:-1], 4, -1)).flatten(-2)
        for layer in self.layers:
            h = h + layer(h)
        return h


class Model(nn.Module):
    def __init__(self, n=32, vocab=48):
        super().__init__()
        self.block = Block(n)
        self.head = nn.Linear(n, vocab)
        self.loss = nn.CrossEntropyLoss(weight=torch.rand(vocab) + 0.5, ignore_index=3, label_smoothing=0.1)

    def forward(self, x, target):
        return self.loss(self.head(self.block(x)), target)


def _torch_modules(m):
    return [s for s in m.modules() if type(s) in (nn.RMSNorm, nn.LayerNorm, nn.CrossEntropyLoss)]


@pytest.mark.parametrize("device", devices())
def test_a_converted_model_gives_the_same_loss_and_gradients_and_keeps_its_parameters(device):
    torch.manual_seed(0)
    model = Model().to(device)
    x, target = torch.randn(6, 32, device=device), torch.randint(0, 48, (6,), device=device)
    want = model(x, target)
    want.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad()
    count = len(_torch_modules(model))

    assert keel.nn.convert(model) is model
    assert _torch_modules(model) == []
    kinds = [type(s) for s in model.modules() if type(s).__module__.startswith("keel")]
    assert len(kinds) == count == 8
    # The very parameters, under the same names; the same state dict.
    assert all(p is params[k] for k, p in model.named_parameters()) and len(params) == len(dict(model.named_parameters()))
    assert model.loss.weight is not None and model.state_dict().keys() == state.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k

    got = model(x, target)
    got.backward()
    assert_close(got, want, torch.float32)
    for k, p in model.named_parameters():
        assert_close(p.grad, grads[k], torch.float32, scale=4)


def test_an_optimizer_made_before_trains_the_converted_model():
    torch.manual_seed(1)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keel.nn.convert(model)
    x, target = torch.randn(6, 32), torch.randint(0, 48, (6,))
    before = model.block.rms.weight.detach().clone()
    model(x, target).backward()
    opt.step()
    assert not torch.equal(model.block.rms.weight, before)


def test_settings_and_training_mode_carry_over():
    m = nn.Sequential(nn.RMSNorm([2, 8], eps=None), nn.LayerNorm(8, eps=0.25), nn.CrossEntropyLoss(reduction="sum"))
    m[0].eval()
    keel.nn.convert(m)
    assert isinstance(m[0], keel.nn.RMSNorm) and m[0].normalized_shape == (2, 8) and m[0].eps is None
    assert not m[0].training and m[1].training and m[0].weight.shape == (2, 8)
    assert isinstance(m[1], keel.nn.LayerNorm) and m[1].eps == 0.25 and m[1].bias is not None
    assert isinstance(m[2], keel.nn.CrossEntropyLoss) and m[2].reduction == "sum" and m[2].weight is None
    assert m[2].ignore_index == -100 and m[2].label_smoothing == 0.0


def test_the_module_itself_and_a_shared_module_are_replaced_once(monkeypatch):
    ln = nn.LayerNorm(8)
    new = keel.nn.convert(ln)
    assert isinstance(new, keel.nn.LayerNorm) and new.weight is ln.weight and new.bias is ln.bias
    shared = nn.RMSNorm(8)
    m = nn.Sequential(shared, nn.Linear(8, 8), shared)
    keel.nn.convert(m)
    assert isinstance(m[0], keel.nn.RMSNorm) and m[0] is m[2] and m[0].weight is shared.weight
    # Shared under different parents, and a shared parent holding one.
    shared, inner = nn.RMSNorm(8), nn.Sequential(nn.LayerNorm(8))
    m = nn.Sequential(inner, shared, nn.Sequential(shared), inner)
    keel.nn.convert(m)
    assert m[0] is m[3] is inner and isinstance(inner[0], keel.nn.LayerNorm)
    assert isinstance(m[1], keel.nn.RMSNorm) and m[1] is m[2][0] and m[1].weight is shared.weight
    # One replacement is built for a module however many places it stands at.
    from keel.nn import _convert

    built = []
    monkeypatch.setattr(_convert, "_replacement", lambda m, make=_convert._replacement: built.append(m) or make(m))
    shared = nn.RMSNorm(8)
    keel.nn.convert(nn.Sequential(shared, nn.Sequential(shared), shared))
    assert built == [shared]


def test_subclasses_and_other_modules_are_left_alone():
    class MyNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    mine, lin = MyNorm(8), nn.Linear(8, 8)
    p = nn.LayerNorm(8)
    torch.nn.utils.parametrize.register_parametrization(p, "weight", nn.Identity())
    m = nn.Sequential(mine, lin, p)
    keel.nn.convert(m)
    assert m[0] is mine and m[1] is lin and m[2] is p
    # Converting twice changes nothing more.
    k = keel.nn.convert(nn.Sequential(nn.LayerNorm(8)))
    first = k[0]
    assert keel.nn.convert(k) is k and k[0] is first


def test_a_module_with_hooks_is_refused_and_nothing_changes():
    m = nn.Sequential(nn.RMSNorm(8), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    first = m[0]
    m[1][1].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"keel.nn.convert: the torch.nn.LayerNorm at '1.1' has hooks \(_forward_hooks\)"):
        keel.nn.convert(m)
    assert m[0] is first and type(m[1][1]) is nn.LayerNorm


@pytest.mark.parametrize("device", devices())
def test_half_activations_with_float32_parameters(device):
    """Mixed precision as keel.nn's modules take it: the result within bf16's rounding of torch's."""
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64), nn.LayerNorm(64)).to(device)
    with torch.no_grad():
        m[1].weight.uniform_(0.5, 1.5)
        m[2].weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        want = m(x)
        keel.nn.convert(m)
        got = m(x)
    assert got.dtype == want.dtype
    assert_close(got, want, torch.bfloat16, scale=2)
