"""Cross-entropy with class weights under torch.func: where no transform nor
autograd differentiates the weights (``_func._constant``), torch's own op
serves float32 logits (``_func.NATIVE``), with the float64 definition's values;
where one does, the torch-op version Keel writes out, with its gradient in
the weights."""
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacfwd, jvp, vmap

import keel
from conftest import torchs_op_calls

_TARGET = torch.tensor([3, -100, 0, 31, 7, -100])
_KW = [{}, {"label_smoothing": 0.2}, {"reduction": "sum"}, {"reduction": "none", "label_smoothing": 0.1}]


def _inputs():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=gen, dtype=torch.float64)
    w = torch.rand(32, generator=gen, dtype=torch.float64) + 0.1
    v = torch.randn(6, 32, generator=gen, dtype=torch.float64)
    return x, w, v


def _loss(ce, w, kw):
    return lambda x: ce(x, _TARGET, weight=w, **kw).sum()


_TRANSFORMS = {
    "grad": lambda f, x, v: grad(f)(x),
    "jvp": lambda f, x, v: jvp(f, (x,), (v,))[1],
    "jacfwd": lambda f, x, v: jacfwd(f)(x),
    "jvp(grad)": lambda f, x, v: jvp(grad(f), (x,), (v,))[1],
    "grad(grad)": lambda f, x, v: grad(lambda y: (grad(f)(y) * v).sum())(x),
    "vmap(grad)": lambda f, x, v: vmap(grad(f))(torch.stack([x, v])),
}


@pytest.mark.parametrize("how", list(_TRANSFORMS))
@pytest.mark.parametrize("kw", _KW, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "mean")
def test_constant_class_weights_run_torchs_own_op(kw, how, monkeypatch):
    """float32 logits with weights no transform differentiates: torch's own op
    serves (not in forward mode alone with label smoothing, where the torch-op
    version was faster), and the result is the float64 definition's within
    1e-5 of its largest term."""
    served = torchs_op_calls(monkeypatch, "cross_entropy")
    x, w, v = _inputs()
    got = _TRANSFORMS[how](_loss(keel.cross_entropy, w.float(), kw), x.float(), v.float())
    want = _TRANSFORMS[how](_loss(F.cross_entropy, w, kw), x, v)
    alone = how in ("jvp", "jacfwd") and kw.get("label_smoothing", 0) != 0
    assert bool(served) != alone, f"{how}: torch's own op served: {served}"
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * max(want.abs().max().item(), 1e-3))


def test_forward_mode_with_constant_class_weights_runs_torchs_own_op(monkeypatch):
    """``torch.autograd.forward_ad`` with class weights that carry no tangent:
    torch's own op, the definition's tangent."""
    served = torchs_op_calls(monkeypatch, "cross_entropy")
    x, w, v = _inputs()
    fwad = torch.autograd.forward_ad
    with fwad.dual_level():
        dual = fwad.make_dual(x.float(), v.float())
        got = fwad.unpack_dual(keel.cross_entropy(dual, _TARGET, weight=w.float())).tangent
    want = jvp(_loss(F.cross_entropy, w, {}), (x,), (v,))[1]
    assert served
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().item())


_DIFFERENTIATED = {
    "grad in x and w": lambda f, x, w, v: grad(f, (0, 1))(x, w)[1],
    "grad in w": lambda f, x, w, v: grad(f, 1)(x, w),
    "jvp in x and w": lambda f, x, w, v: jvp(f, (x, w), (v, w))[1],
    "jvp(grad) in x and w": lambda f, x, w, v: jvp(grad(f), (x, w), (v, w))[1],
    "vmap over w": lambda f, x, w, v: vmap(grad(f), in_dims=(None, 0))(x, torch.stack([w, w * 2])),
}


@pytest.mark.parametrize("how", list(_DIFFERENTIATED))
def test_class_weights_that_a_transform_differentiates_keep_the_torch_op_version(how, monkeypatch):
    """Weights that a transform differentiates or batches: the torch-op version
    Keel writes out (torch's ``nll_loss`` has no derivative in them), with the
    definition's values, the weights' derivative included."""
    served = torchs_op_calls(monkeypatch, "cross_entropy")
    x, w, v = _inputs()

    def define(x, w):
        logp = torch.log_softmax(x, -1)
        live = _TARGET != -100
        picked = torch.where(live, -logp.gather(1, torch.where(live, _TARGET, 0)[:, None])[:, 0], 0.0)
        wt = torch.where(live, w[torch.where(live, _TARGET, 0)], 0.0)
        return (wt * picked).sum() / wt.sum()

    got = _DIFFERENTIATED[how](lambda x, w: keel.cross_entropy(x, _TARGET, weight=w), x.float(), w.float(), v.float())
    want = _DIFFERENTIATED[how](define, x, w, v)
    assert not served, f"{how}: torch's own op served"
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
