"""Second derivatives through the typed API under torch.func: Hessian-vector
products (``jvp(grad(f))``), ``grad(grad(f))`` and ``hessian`` run torch's own
op on float32 tensors (``_func.route``) and give the float64 definition's
values; a ``grad`` wrapper gets no zero tangent (``_twice.zero_tangents``)."""
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jvp

import keel
from conftest import DispatchedOps, torchs_op_calls
from keel import _twice

ROWS, HIDDEN = 4, 16


def _inputs():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.rand(HIDDEN, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(HIDDEN, generator=gen, dtype=torch.float64)
    r = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    c = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    v = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    t = torch.randint(0, HIDDEN, (ROWS,), generator=gen)
    t[1] = -100
    return x, w, b, r, c, v, t


def _losses(w, b, r, c, t):
    """Op name -> (Keel's scalar loss of x, the float64 definition's): each
    op's output weighted by `c` and squared, so that its second derivative is
    not 0."""
    return {
        "softmax": (
            lambda x: (keel.softmax(x) * c).square().sum(),
            lambda x: (torch.softmax(x, -1) * c).square().sum(),
        ),
        "rms_norm": (
            lambda x: (keel.rms_norm(x, w, 1e-6) * c).square().sum(),
            lambda x: (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w * c).square().sum(),
        ),
        "layer_norm": (
            lambda x: (keel.layer_norm(x, w, b) * c).square().sum(),
            lambda x: (F.layer_norm(x, x.shape[-1:], w, b) * c).square().sum(),
        ),
        "fused_add_rms_norm": (
            lambda x: (keel.fused_add_rms_norm(x, r, w, 1e-6)[0] * c).square().sum(),
            lambda x: ((x + r) * torch.rsqrt((x + r).square().mean(-1, keepdim=True) + 1e-6) * w * c).square().sum(),
        ),
        "cross_entropy": (
            lambda x: keel.cross_entropy(x, t, label_smoothing=0.1),
            lambda x: F.cross_entropy(x, t, label_smoothing=0.1),
        ),
    }


def _second(how, f, x, v):
    if how == "jvp(grad)":
        return jvp(grad(f), (x,), (v,))[1]
    if how == "grad(grad)":
        return grad(lambda y: (grad(f)(y) * v).sum())(x)
    return torch.tensordot(hessian(f)(x), v, dims=2)


@pytest.mark.parametrize("how", ["jvp(grad)", "grad(grad)", "hessian"])
@pytest.mark.parametrize("name", ["softmax", "rms_norm", "layer_norm", "fused_add_rms_norm", "cross_entropy"])
def test_float32_second_derivatives_run_torchs_own_op(name, how, monkeypatch):
    """A Hessian-vector product of each op with torch's own op serving (but
    layer_norm's with a ``jvp``: the torch-op version, as in forward mode
    alone), against the float64 definition's (float32 tolerance: 1e-4 of the
    largest term)."""
    served = torchs_op_calls(monkeypatch, name)
    x, w, b, r, c, v, t = _inputs()
    mine, want = _losses(*(a.float() for a in (w, b, r, c)), t)[name][0], _losses(w, b, r, c, t)[name][1]
    got = _second(how, mine, x.float(), v.float())
    ref = _second(how, want, x, v)
    forward = how != "grad(grad)"
    assert bool(served) != (name == "layer_norm" and forward), f"{name} {how}: torch's own op served: {served}"
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["softmax", "rms_norm", "layer_norm", "cross_entropy"])
def test_a_hessian_vector_product_dispatches_about_as_many_ops_as_torchs(name):
    """``jvp(grad(f))`` and ``grad(grad(f))`` of Keel's op on float32 dispatch
    at most 1.25x as many ops as the same of torch's own, and 10 (Keel's
    checks, a layer_norm row's centring; layer_norm's ``jvp(grad)`` is the
    torch-op version's: 255 against 211). With zero tangents under the
    ``grad`` level, ``jvp(grad)`` dispatched 4x torch's (rms_norm ``[8, 64]``:
    772 against 187) and took 3.5-4.5x its time."""
    x, w, b, r, c, v, t = (a.float() if a.is_floating_point() else a for a in _inputs())
    theirs = {
        "softmax": lambda x: (torch.softmax(x, -1) * c).square().sum(),
        "rms_norm": lambda x: (F.rms_norm(x, x.shape[-1:], w, 1e-6) * c).square().sum(),
        "layer_norm": lambda x: (F.layer_norm(x, x.shape[-1:], w, b) * c).square().sum(),
        "cross_entropy": lambda x: F.cross_entropy(x, t, label_smoothing=0.1),
    }[name]
    mine = _losses(w, b, r, c, t)[name][0]
    for how in ("jvp(grad)", "grad(grad)"):
        counts = []
        for f in (mine, theirs):
            _second(how, f, x, v)  # Keel's checks pass once a signature; count the calls after
            with DispatchedOps() as calls:
                _second(how, f, x, v)
            counts.append(len(calls.on_data))
        assert counts[0] <= counts[1] * 1.25 + 10, f"{name} {how}: Keel {counts[0]} ops, torch {counts[1]}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_keep_the_torch_op_version_for_second_derivatives(dtype, monkeypatch):
    """float64 and the 16-bit dtypes (torch's double backward computes in
    them) take the second derivative through the torch-op version Keel writes
    out, with Keel's values."""
    monkeypatch.undo()
    seen = []
    ref = _twice.rms_norm
    monkeypatch.setattr(_twice, "rms_norm", lambda *a: seen.append(1) or ref(*a))
    x, w, b, r, c, v, t = _inputs()
    mine = _losses(*(a.to(dtype) for a in (w, b, r, c)), t)["rms_norm"][0]
    got = _second("jvp(grad)", mine, x.to(dtype), v.to(dtype))
    want = _second("jvp(grad)", _losses(w, b, r, c, t)["rms_norm"][1], x, v)
    assert seen and got.dtype == dtype
    tol = 1e-10 if dtype == torch.float64 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol * want.abs().max().item())


def test_layer_norm_with_a_bias_and_no_weight_keeps_the_torch_op_version(monkeypatch):
    """torch's double backward of ``F.layer_norm`` raises where a bias without a
    weight is differentiated; Keel's second derivative there comes from the
    torch-op version, and equals the definition's."""
    monkeypatch.undo()
    seen = []
    ref = _twice.layer_norm
    monkeypatch.setattr(_twice, "layer_norm", lambda *a: seen.append(1) or ref(*a))
    x, _, b, _, c, _, _ = _inputs()

    def define(x, b):
        mean = x.mean(-1, keepdim=True)
        return ((x - mean) * torch.rsqrt((x - mean).square().mean(-1, keepdim=True) + 1e-5) + b) * c

    def second(f, x, b):
        first = grad(lambda x, b: f(x, b).square().sum(), (0, 1))
        return grad(lambda x, b: sum(g.sin().sum() for g in first(x, b)), (0, 1))(x, b)

    got = second(lambda x, b: keel.layer_norm(x, None, b) * c.float(), x.float(), b.float())
    want = second(define, x, b)
    assert seen
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g.double(), w_, rtol=0, atol=1e-4 * w_.abs().max().item())


def test_zero_tangents_leave_the_tensors_of_a_grad_level_alone():
    """Under ``jvp(grad(f))`` the input's ``grad`` wrapper shows no tangent (it is
    below the wrapper), and a plain weight is lifted by the ``grad`` level:
    neither gets a zero tangent. Under ``jvp`` alone the weight does."""
    x, w = torch.randn(2, 8), torch.randn(8)
    kept = []

    def f(x):
        args = (x, w)
        kept.append(all(a is b for a, b in zip(_twice.zero_tangents(args), args)))
        return (x * w).sin().sum()

    jvp(grad(f), (x,), (x,))
    assert kept == [True]
    kept.clear()
    jvp(f, (x,), (x,))
    assert kept == [False]
