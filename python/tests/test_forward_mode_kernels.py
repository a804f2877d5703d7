"""The norms, softmax in forward mode through Keel's kernels (``_twice.kernel_parts``).

With a tangent on ``x`` alone, which ``forward_ad`` or one ``jvp`` alone tracks,
the output is Keel's forward kernel on the primal and the tangent ``w * J t``,
``J`` the Jacobian without the weight: symmetric for layer_norm, rms_norm and
softmax, so Keel's backward kernel with ``t`` for the output's gradient and no
weight gives ``J t``. Elsewhere the written-out version (``_twice``) serves, with
every derivative. (Rotary, linear in ``x``: test_torch_version.)
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import keel
from keel import _twice
from conftest import devices
from test_torch_version import _JVP_STACKS, _TRACKED_OUTSIDE, _t

ops = torch.ops.keel


def _pick(typed, bare, written):
    return lambda kind: {"typed": typed, "bare": bare, "written": written}[kind]


_LAYER_NORM = _pick(keel.layer_norm, ops.layer_norm, _twice.layer_norm)
_RMS_NORM = _pick(keel.rms_norm, ops.rms_norm, _twice.rms_norm)
_SOFTMAX = _pick(keel.softmax, ops.softmax, _twice.softmax)
_FUSED = _pick(keel.fused_add_rms_norm, ops.fused_add_rms_norm, _twice.fused_add_rms_norm)


def _residual(x):
    """A residual without a tangent, shaped like `x` (one example's under vmap;
    no random numbers, which vmap refuses)."""
    return torch.arange(x.numel(), dtype=torch.float64).mul(0.37).cos().reshape(x.shape).to(x.device, x.dtype)


_OPS = {  # name -> ((kind, x, weight, bias) -> output, its forward kernel, the tangent's kernel)
    "layer_norm": (lambda kind, x, w, b: _LAYER_NORM(kind)(x, w, b, 1e-5), "layer_norm", "layer_norm_backward"),
    "rms_norm": (lambda kind, x, w, b: _RMS_NORM(kind)(x, w, 1e-6), "rms_norm", "rms_norm_backward"),
    "rms_norm rounded": (lambda kind, x, w, b: _RMS_NORM(kind)(x, w, 1e-6, True), "rms_norm", "rms_norm_backward"),
    "softmax": (lambda kind, x, w, b: _SOFTMAX(kind)(x, 0.7), "softmax", "softmax_backward"),
    # both outputs in one tensor (the normed sum, the sum), for the tests written for one
    "fused_add_rms_norm": (
        lambda kind, x, w, b: torch.stack(_FUSED(kind)(x, _residual(x), w, 1e-6)),
        "fused_add_rms_norm",
        "rms_norm_backward",
    ),
}

_WRITTEN_OUT_OP = {"softmax": "aten::_softmax"}
"""An op that the written-out version runs and Keel's kernels' path does not
(the norms': ``rsqrt``)."""

_CALLS = ["typed", "bare"]

_PARAMS = {
    "weight and bias": lambda n, seed: (_t(n, seed=seed), _t(n, seed=seed + 1)),
    "weight": lambda n, seed: (_t(n, seed=seed), None),
    "none": lambda n, seed: (None, None),
}

_OP_PARAMS = [(op, p) for op in _OPS for p in _PARAMS if op != "softmax" or p == "none"]
_WEIGHTED = [op for op in _OPS if op != "softmax"]


def _inputs(seed, shape=(3, 2, 8)):
    """``x`` (rows of unlike means and spreads), its tangent ``v``."""
    x = _t(*shape, seed=seed) * _t(*shape[:-1], 1, seed=seed + 5).abs().add(0.1) + _t(*shape[:-1], 1, seed=seed + 6)
    return x, _t(*shape, seed=seed + 3)


def _fn(op, kind, w, b):
    f = _OPS[op][0]
    return lambda z: f(kind, z, w, b)


def _written_out(op, x, v, w, b):
    return torch.func.jvp(_fn(op, "written", w, b), (x,), (v,))


@pytest.mark.parametrize("op, params", _OP_PARAMS)
@pytest.mark.parametrize("call", _CALLS)
@pytest.mark.parametrize("mode", ["forward_ad", "jvp"])
@pytest.mark.parametrize("shape", [(3, 2, 8), (64, 4096)], ids=["small", "past the zero-tangent bound"])
def test_forward_mode_is_the_kernels_with_the_written_out_values(shape, mode, call, op, params):
    """Output and tangent equal the written-out version's (float64, to 1e-12),
    with or without weight and bias, at every size; the output is the kernel's
    (the call without a tangent) exactly."""
    x, v = _inputs(11, shape)
    w, b = _PARAMS[params](shape[-1], 20)
    fn = _fn(op, call, w, b)
    if mode == "jvp":
        primal, tangent = torch.func.jvp(fn, (x,), (v,))
    else:
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, v)))
    want, want_t = _written_out(op, x, v, w, b)
    torch.testing.assert_close(primal, _fn(op, "bare", w, b)(x), atol=0, rtol=0)
    torch.testing.assert_close(primal, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(tangent, want_t, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["forward_ad", "jvp"])
@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("device", devices())
def test_forward_mode_in_each_dtype_against_float64(device, op, mode, dtype):
    """In float32 the tangent is within 1e-5 of float64's written-out one
    (relative to the largest); in a half dtype ``J t`` is rounded before the
    weight multiplies it, two roundings, so within four of the dtype's units
    (2^-8 for bfloat16, 2^-11 for float16) of the largest. On CUDA too (Keel's
    CUDA kernels; the reference on the CPU)."""
    x, v = _inputs(13, (16, 256))
    w, b = _PARAMS["weight and bias"](256, 30)
    want, want_t = _written_out(op, x, v, w, b)
    xs, vs, ws, bs = (a.to(device, dtype) for a in (x, v, w, b))
    fn = _fn(op, "typed", ws, bs)
    if mode == "jvp":
        primal, tangent = torch.func.jvp(fn, (xs,), (vs,))
    else:
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(xs, vs)))
    assert primal.dtype == tangent.dtype == dtype
    torch.testing.assert_close(primal, fn(xs), atol=0, rtol=0)
    unit = {torch.float32: 1e-5 / 4, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    assert tangent.device == xs.device
    assert (tangent.double().cpu() - want_t).abs().max().item() <= 4 * unit * want_t.abs().max().item()


def _names(prof):
    return [e.name for e in prof.function_events]


@pytest.mark.parametrize("call", _CALLS)
@pytest.mark.parametrize("op", list(_OPS))
def test_forward_ad_runs_the_kernels(op, call):
    """Under ``forward_ad`` alone the forward kernel gives the output and the
    backward kernel the tangent: no op of the written-out version runs."""
    x, v = _inputs(21)
    w, b = _PARAMS["weight and bias"](8, 22)
    _, forward, tangent = _OPS[op]
    with fwAD.dual_level():
        with torch.autograd.profiler.profile() as prof:
            out = _fn(op, call, w, b)(fwAD.make_dual(x, v))
        assert fwAD.unpack_dual(out).tangent is not None
    names = _names(prof)
    assert names.count(f"keel::_{tangent}_nograd") == 1, names
    assert f"keel::_{forward}_nograd" in names
    assert _WRITTEN_OUT_OP.get(op, "aten::rsqrt") not in names


@pytest.mark.parametrize("stack", list(_JVP_STACKS))
@pytest.mark.parametrize("call", _CALLS)
@pytest.mark.parametrize("op", list(_OPS))
def test_jvp_runs_the_kernels(op, call, stack):
    """Under ``jvp`` (``vmap`` beside it: ``jacfwd``) too, with a tangent on
    ``x`` alone, Keel's kernels run on functorch's wrappers (no op of the
    written-out version), with the written-out version's values, a
    per-example weight of a ``vmap`` included."""
    x, v = _inputs(23)
    w, b = _PARAMS["weight and bias"](8, 24)
    run = _JVP_STACKS[stack]
    if stack == "vmap(jvp)":
        x, v = torch.stack([x, 2 * x]), torch.stack([v, -v])
    with torch.autograd.profiler.profile() as prof:
        got = run(_fn(op, call, w, b), x, v)
    names = _names(prof)
    assert names.count(f"keel::_{_OPS[op][2]}_nograd") >= 1, names
    assert _WRITTEN_OUT_OP.get(op, "aten::rsqrt") not in names
    want = run(_fn(op, "written", w, b), x, v)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-12)
    if stack == "vmap(jvp)" and op in _WEIGHTED:
        ws = torch.stack([w, w.flip(0)])
        got = torch.func.vmap(lambda a, t, u: torch.func.jvp(_fn(op, call, u, b), (a,), (t,)))(x, v, ws)
        for i in range(2):
            want = _written_out(op, x[i], v[i], ws[i], b)
            torch.testing.assert_close(got[0][i], _fn(op, "bare", ws[i], b)(x[i]), atol=0, rtol=0)
            torch.testing.assert_close(got[1][i], want[1], atol=1e-12, rtol=1e-12)
        # the weight alone per-example: the tangent is batched by the weight
        got = torch.func.vmap(lambda u: torch.func.jvp(_fn(op, call, u, b), (x[0],), (v[0],)))(ws)
        for i in range(2):
            torch.testing.assert_close(got[1][i], _written_out(op, x[0], v[0], ws[i], b)[1], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("outer", list(_TRACKED_OUTSIDE))
@pytest.mark.parametrize("call", _CALLS)
@pytest.mark.parametrize("op", list(_OPS))
def test_tracked_outside_its_jvp_keeps_every_derivative(op, call, outer):
    """Where something outside the op's ``jvp`` tracks ``x`` too (an autograd
    graph, an outer ``jvp``, a ``grad`` transform), Keel's kernels on the
    wrappers would lose that level's derivative: the results are the
    written-out version's, float64."""
    x, v = _inputs(41)
    w, b = _PARAMS["weight and bias"](8, 42)
    run = _TRACKED_OUTSIDE[outer]
    xs = [x.clone().requires_grad_() if outer == "autograd of jvp" else x for _ in range(2)]
    got = run(_fn(op, call, w, b), xs[0], v)
    want = run(_fn(op, "written", w, b), xs[1], v)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)


_OTHER_TANGENTS = [
    (op, on) for op in _WEIGHTED for on in ("weight", "bias") if on == "weight" or op == "layer_norm"
]


@pytest.mark.parametrize("op, tangent_on", _OTHER_TANGENTS)
def test_forward_mode_with_another_tangent_keeps_the_written_out_version(op, tangent_on):
    """Where the weight or the bias carries a tangent too, the written-out
    version or torch's op serves: its tangent against central differences, and
    no backward kernel ran. (A tensor requiring a gradient instead:
    test_forward_mode_graph.)"""
    x, v = _inputs(31)
    w, b = _PARAMS["weight and bias"](8, 32)
    wt, bt = (_t(8, seed=35) if tangent_on == "weight" else None), (_t(8, seed=36) if tangent_on == "bias" else None)
    h = 1e-6

    def moved(s):
        return _fn(op, "typed", w if wt is None else w + s * wt, b if bt is None else b + s * bt)(x + s * v)

    want_t = (moved(h) - moved(-h)) / (2 * h)
    with fwAD.dual_level(), torch.autograd.profiler.profile() as prof:
        wd = w if wt is None else fwAD.make_dual(w, wt)
        bd = b if bt is None else fwAD.make_dual(b, bt)
        tangent = fwAD.unpack_dual(_fn(op, "typed", wd, bd)(fwAD.make_dual(x, v))).tangent
    assert f"keel::_{_OPS[op][2]}_nograd" not in _names(prof)
    torch.testing.assert_close(tangent, want_t, atol=1e-7, rtol=1e-6)


_RESIDUAL_TANGENTS = {
    "residual": lambda x, r, tx, tr: ((r,), (tr,), lambda f: lambda b: f(x, b)),
    "both": lambda x, r, tx, tr: ((x, r), (tx, tr), lambda f: f),
}


@pytest.mark.parametrize("mode", ["forward_ad", "jvp"])
@pytest.mark.parametrize("call", _CALLS)
@pytest.mark.parametrize("on", list(_RESIDUAL_TANGENTS))
def test_fused_add_rms_norm_with_a_residual_tangent_runs_the_kernels(on, call, mode):
    """fused_add_rms_norm's residual may carry a tangent too (alone or with
    ``x``'s): the sum's tangent is theirs added, the normed output's ``w J
    t_s``; both outputs and tangents as the written-out version's (float64), no
    ``rsqrt`` of it run."""
    x, tx = _inputs(51)
    r, tr = _inputs(55)
    w = _t(8, seed=59)
    primals, tangents, bind = _RESIDUAL_TANGENTS[on](x, r, tx, tr)
    fn = bind(lambda a, b: _FUSED(call)(a, b, w, 1e-6))
    with torch.autograd.profiler.profile() as prof:
        if mode == "jvp":
            out, tangent = torch.func.jvp(fn, primals, tangents)
        else:
            with fwAD.dual_level():
                dual = fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents)))
                out, tangent = zip(*(fwAD.unpack_dual(o) for o in dual))
    assert "aten::rsqrt" not in _names(prof)
    want, want_t = torch.func.jvp(lambda a, b: _twice.fused_add_rms_norm(a, b, w, 1e-6), (x, r), (tx if on == "both" else 0 * tx, tr))
    torch.testing.assert_close(tuple(out), ops.fused_add_rms_norm(x, r, w, 1e-6), atol=0, rtol=0)
    torch.testing.assert_close(tuple(tangent), tuple(want_t), atol=1e-12, rtol=1e-12)
    # no output's tangent is an input's (the sum's is a copy where one is given)
    assert all(t.data_ptr() != g.data_ptr() for t in tangent for g in tangents)
