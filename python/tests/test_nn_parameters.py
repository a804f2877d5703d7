"""keel.nn's modules use their parameters and buffers wherever torch's tooling
puts them: their forwards read the module's own ``_parameters`` / ``_buffers``
dict (faster than ``nn.Module.__getattr__``) and fall back to the attribute
where the name is not there. A parametrization, ``weight_norm``'s plain
attribute and ``torch.func.functional_call``'s tensors must all be the ones
used, in values and gradients."""
import warnings

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

import keel
import keel.nn as knn


class Twice(nn.Module):
    def forward(self, w):
        return 2 * w


def _x():
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


def test_a_parametrized_weight_is_used_with_its_gradient():
    for m, f in [
        (knn.RMSNorm(8), lambda x, w, b: keel.rms_norm(x, w, 1e-6)),
        (knn.LayerNorm(8), lambda x, w, b: keel.layer_norm(x, w, b, 1e-5)),
    ]:
        if isinstance(m, knn.RMSNorm):
            m.eps = 1e-6
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
        parametrize.register_parametrization(m, "weight", Twice())
        original = m.parametrizations.weight.original
        x = _x()
        got = m(x)
        want = f(x, 2 * original.detach(), getattr(m, "bias", None))
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        got.sum().backward()
        assert original.grad is not None and original.grad.abs().sum() > 0, type(m)


def test_weight_norms_plain_attribute_is_used():
    m = knn.LayerNorm(8)
    with torch.no_grad():
        m.weight.uniform_(-2, 2, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        torch.nn.utils.weight_norm(m, "weight", dim=0)
    assert "weight" not in m._parameters
    with torch.no_grad():
        m.weight_g.mul_(3)  # so that the weight it computes is not the one it started from
    x = _x()
    got = m(x)
    # Its pre-hook has set the plain attribute to g * v / norm(v), the weight to use.
    w = m.__dict__["weight"].detach()
    torch.testing.assert_close(w.abs(), m.weight_g.detach().abs(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, keel.layer_norm(x, w, m.bias.detach(), 1e-5), atol=0, rtol=0)


def test_functional_call_uses_the_tensors_it_is_given():
    x = _x()
    w, b = torch.rand(8) + 0.5, torch.randn(8)
    rms, ln = knn.RMSNorm(8, eps=1e-6), knn.LayerNorm(8)
    torch.testing.assert_close(functional_call(rms, {"weight": w}, (x,)), keel.rms_norm(x, w, 1e-6), atol=0, rtol=0)
    got = functional_call(ln, {"weight": w, "bias": b}, (x,))
    torch.testing.assert_close(got, keel.layer_norm(x, w, b, 1e-5), atol=0, rtol=0)
    # The modules' own parameters are untouched and used again afterwards.
    torch.testing.assert_close(rms(x), keel.rms_norm(x, torch.ones(8), 1e-6), atol=0, rtol=0)

    loss = knn.CrossEntropyLoss(weight=torch.ones(8))
    t = torch.tensor([1, 7, 0])
    cw = torch.rand(8) + 0.5
    got = functional_call(loss, {"weight": cw}, (x, t))
    torch.testing.assert_close(got, keel.cross_entropy(x, t, weight=cw), atol=0, rtol=0)
    torch.testing.assert_close(loss(x, t), keel.cross_entropy(x, t), atol=0, rtol=0)
