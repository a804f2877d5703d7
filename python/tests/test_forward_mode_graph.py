"""Forward mode through Keel's kernels with an autograd graph beside it.

Under plain ``torch.autograd.forward_ad`` in grad mode, where a tensor requires
a gradient (a module's weight, an input with a graph behind it, a tangent
computed from one), the norms, softmax and rotary embedding still run Keel's
kernels (``_twice.kernel_parts``: the op itself on the primals, its autograd
recording the graph; ``J t`` by the backward kernel through
``_twice._KernelTangent``, whose backward is the written-out version's). Every
derivative is the written-out version's: the output's and the tangent's
gradients, and a gradient of those gradients. Under ``torch.func.jvp`` (and
``vmap(jvp)``, ``jacfwd``) the typed API does the same through the op's
Function for torch.func with a ``jvp`` (``_func.DUAL_FUNCTIONS``).
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import keel
from keel import _func
from conftest import devices
from test_forward_mode_kernels import _OPS, _PARAMS, _fn, _inputs, _names
from test_torch_version import _JVP_STACKS, _t

ops = torch.ops.keel

_LEAVES = {  # which of x's primal, x's tangent, the weight and the bias require a gradient
    "weight": ("w",),
    "x": ("x",),
    "tangent": ("v",),
    "x and tangent": ("x", "v"),
    "all": ("x", "v", "w", "b"),
}


def _cases():
    for op in _OPS:
        for leaves in _LEAVES:
            if op == "softmax" and ("w" in _LEAVES[leaves] and leaves != "all"):
                continue
            yield op, leaves


def _leaves(op, names, seed, shape=(3, 2, 8)):
    """``x``, its tangent ``v``, the weight and bias (None where the op takes
    none), those named in `names` fresh leaves requiring a gradient."""
    x, v = _inputs(seed, shape)
    w, b = _PARAMS["weight and bias"](shape[-1], seed + 10)
    if op == "softmax":
        w = None
    if op != "layer_norm":
        b = None
    got = {"x": x, "v": v, "w": w, "b": b}
    return {k: (t.clone().requires_grad_() if k in names and t is not None else t) for k, t in got.items()}


def _softmax_written(z):
    """softmax at scale 0.7 in torch's ops, but not ``torch.softmax``: under
    forward_ad its tangent formula writes in place into a tensor its backward
    saved, so a backward through it raises (pytorch#162350, torch 2.15; Keel's
    kernels' path does not)."""
    e = torch.exp(0.7 * z - (0.7 * z).amax(-1, keepdim=True).detach())
    return e / e.sum(-1, keepdim=True)


def _dual_call(op, kind, t):
    """The op (`kind`: typed, bare or written) on ``x`` made dual with ``v``
    under forward_ad: the output and its tangent, and the profiler's op names."""
    fn = _softmax_written if (op, kind) == ("softmax", "written") else _fn(op, kind, t["w"], t["b"])
    with fwAD.dual_level(), torch.autograd.profiler.profile() as prof:
        primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(t["x"], t["v"])))
    return primal, tangent, _names(prof)


def _loss(primal, tangent):
    """A loss that takes in the output and its tangent (a Jacobian penalty)."""
    c = _t(*primal.shape, seed=71).to(primal.dtype)
    return (primal * c).sum() + (tangent * tangent).sum()


def _required(t):
    return [k for k in ("x", "v", "w", "b") if t[k] is not None and t[k].requires_grad]


@pytest.mark.parametrize("call", ["typed", "bare"])
@pytest.mark.parametrize("op, leaves", list(_cases()))
def test_forward_ad_with_a_graph_runs_the_kernels_and_keeps_every_derivative(op, leaves, call):
    """Output and tangent as the written-out version's (float64, to 1e-12; the
    output the kernel's exactly), Keel's kernels and no op of the written-out
    version run in the forward, and the gradients of a loss of both (each leaf)
    and of the squared gradients (a second order) as the written-out version's
    to 1e-10."""
    mine, ref = _leaves(op, _LEAVES[leaves], 81), _leaves(op, _LEAVES[leaves], 81)
    primal, tangent, names = _dual_call(op, call, mine)
    assert f"keel::_{_OPS[op][2]}_nograd" in names
    assert "aten::rsqrt" not in names and "aten::_softmax" not in names
    want, want_t, _ = _dual_call(op, "written", ref)
    torch.testing.assert_close(primal, _fn(op, "bare", mine["w"], mine["b"])(mine["x"].detach()), atol=0, rtol=0)
    torch.testing.assert_close(primal, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(tangent, want_t, atol=1e-12, rtol=1e-12)
    assert tangent.requires_grad
    keys = _required(mine)
    got = torch.autograd.grad(_loss(primal, tangent), [mine[k] for k in keys], create_graph=True)
    exp = torch.autograd.grad(_loss(want, want_t), [ref[k] for k in keys], create_graph=True)
    for k, g, e in zip(keys, got, exp):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10, msg=lambda m: f"{k}: {m}")
    got2 = torch.autograd.grad(sum((g * g).sum() for g in got), [mine[k] for k in keys], allow_unused=True)
    exp2 = torch.autograd.grad(sum((e * e).sum() for e in exp), [ref[k] for k in keys], allow_unused=True)
    for k, g, e in zip(keys, got2, exp2):
        if e is None:
            assert g is None or not g.any(), k
        else:
            torch.testing.assert_close(g, e, atol=1e-9, rtol=1e-9, msg=lambda m: f"second order, {k}: {m}")


@pytest.mark.parametrize("op", list(_OPS))
def test_backward_after_the_level_takes_keels_backward(op):
    """A module's weight requiring a gradient: a gradient of the output alone
    (the tangent unused) after the dual level runs Keel's backward kernel, no
    written-out op (no tensor of that backward carries a tangent any more:
    ``_twice.wanted``), and gives autograd's gradient of the op called
    plainly."""
    t = _leaves(op, ("w", "x") if op != "softmax" else ("x",), 91)
    with fwAD.dual_level():
        primal, _ = fwAD.unpack_dual(_fn(op, "typed", t["w"], t["b"])(fwAD.make_dual(t["x"], t["v"])))
    with torch.autograd.profiler.profile() as prof:
        got = torch.autograd.grad((primal * primal).sum(), _leaf_list(t))
    names = _names(prof)
    backward = "fused_add_rms_norm_backward" if op == "fused_add_rms_norm" else _OPS[op][2]
    assert f"keel::_{backward}_nograd" in names, names
    assert "aten::rsqrt" not in names and "aten::_softmax" not in names, names
    plain = _fn(op, "typed", t["w"], t["b"])(t["x"])
    exp = torch.autograd.grad((plain * plain).sum(), _leaf_list(t))
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("call", ["typed", "bare"])
@pytest.mark.parametrize("op", list(_OPS))
def test_gradient_inside_the_level_carries_its_tangent(op, call):
    """Forward-over-reverse: a gradient taken inside the level, of ``x`` and
    of the weight, carries its tangent along ``x``'s (the backward sees the
    inputs dual): against central differences of the gradient at ``x +- h v``."""
    names = ("x", "w") if op != "softmax" else ("x",)
    t = _leaves(op, names, 97)

    def grads_at(z):
        z = z.detach().requires_grad_()
        out = _fn(op, call, t["w"], t["b"])(z)
        return torch.autograd.grad((out * out * out).sum(), [z] + _leaf_list(t)[1:])

    with fwAD.dual_level():
        out = _fn(op, call, t["w"], t["b"])(fwAD.make_dual(t["x"], t["v"]))
        got = [fwAD.unpack_dual(g).tangent for g in torch.autograd.grad((out * out * out).sum(), _leaf_list(t))]
    h = 1e-6
    up, down = grads_at(t["x"] + h * t["v"]), grads_at(t["x"] - h * t["v"])
    for g, a, b in zip(got, up, down):
        assert g is not None
        torch.testing.assert_close(g, (a - b) / (2 * h), atol=1e-6, rtol=1e-5)


def _leaf_list(t):
    return [t[k] for k in _required(t)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("device", devices())
def test_forward_ad_with_a_graph_in_each_dtype(device, op, dtype):
    """A weight and ``x`` requiring a gradient, float32 and bfloat16 (CPU and
    CUDA kernels): the tangent within four of the dtype's units of float64's
    written-out one (relative to the largest; two roundings in bfloat16, as
    without a graph), the weight's gradient of the tangent's squares within
    eight."""
    names = ("x", "w") if op != "softmax" else ("x",)
    ref = _leaves(op, names, 95, (16, 256))
    want, want_t, _ = _dual_call(op, "written", ref)
    exp = torch.autograd.grad((want_t * want_t).sum(), _leaf_list(ref))
    mine = {k: (None if a is None else a.detach().to(device, dtype).requires_grad_(a.requires_grad)) for k, a in ref.items()}
    primal, tangent, _ = _dual_call(op, "typed", mine)
    assert primal.dtype == tangent.dtype == dtype and tangent.device == mine["x"].device
    unit = {torch.float32: 1e-5 / 4, torch.bfloat16: 2.0**-8}[dtype]
    assert (tangent.double().cpu() - want_t).abs().max().item() <= 4 * unit * want_t.abs().max().item()
    got = torch.autograd.grad((tangent.float() * tangent.float()).sum(), _leaf_list(mine))
    for g, e in zip(got, exp):
        assert g.dtype == dtype
        assert (g.double().cpu() - e).abs().max().item() <= 8 * unit * e.abs().max().item()


def _rotary_leaves(names, seed):
    x, v = _t(2, 3, 2, 8, seed=seed), _t(2, 3, 2, 8, seed=seed + 1)
    cos, sin = _t(3, 3, seed=seed + 2), _t(3, 3, seed=seed + 3)
    got = {"x": x, "v": v, "cos": cos, "sin": sin}
    return {k: (t.clone().requires_grad_() if k in names else t) for k, t in got.items()}


def _rotary_dual_call(mode, fn, t):
    if mode == "jvp":
        return torch.func.jvp(lambda a: fn(a, t["cos"], t["sin"]), (t["x"],), (t["v"],))
    with fwAD.dual_level():
        return fwAD.unpack_dual(fn(fwAD.make_dual(t["x"], t["v"]), t["cos"], t["sin"]))


@pytest.mark.parametrize("mode", ["forward_ad", "jvp"])
@pytest.mark.parametrize("call", ["typed", "bare"])
@pytest.mark.parametrize("names", [("cos", "sin"), ("x",), ("v",), ("x", "v", "cos", "sin")], ids=" and ".join)
def test_rotary_forward_mode_with_a_graph(names, call, mode, monkeypatch):
    """Rotary embedding, linear in ``x``: the op itself (its autograd) on the
    primal and the tangent, no op of the written-out version (under
    ``forward_ad``, and under ``jvp`` through the typed API); values and the
    gradients of a loss of both as the written-out version's (float64)."""
    from keel import _twice

    if mode == "jvp" and "v" in names:
        pytest.skip("torch.func.jvp takes no tangent requiring a gradient")
    _no_bound(monkeypatch)
    fn = {"typed": lambda x, c, s: keel.rotary_embedding(x, c, s), "bare": lambda x, c, s: ops.rotary_embedding(x, c, s, False)}[call]
    results = []
    for kind in (fn, lambda x, c, s: _twice.rotary(x, c, s, False)):
        t = _rotary_leaves(names, 101)
        # once before counting: Keel's check on meta stand-ins runs the twin once per kind of arguments
        _rotary_dual_call(mode, kind, t)
        with torch.autograd.profiler.profile() as prof:
            primal, tangent = _rotary_dual_call(mode, kind, t)
        keys = [k for k in names]
        grads = torch.autograd.grad(_loss(primal, tangent), [t[k] for k in keys])
        results.append((primal, tangent, grads, _names(prof)))
    (p, tg, g, names_run), (wp, wt, wg, _) = results
    if mode == "forward_ad" or call == "typed":
        assert names_run.count("keel::_rotary_embedding_nograd") >= 2, names_run
        assert "aten::cat" not in names_run, names_run
    torch.testing.assert_close(p, wp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(tg, wt, atol=1e-12, rtol=1e-12)
    for a, b in zip(g, wg):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


_JVP_LEAVES = {"weight": ("w",), "x": ("x",), "x and weight": ("x", "w")}


def _jvp_cases():
    for op in _OPS:
        for leaves in _JVP_LEAVES:
            if op != "softmax" or leaves == "x":
                yield op, leaves


def _no_bound(monkeypatch):
    """Keel's kernels under ``jvp`` with a graph at every size (the tests' tensors
    are below ``_func.JVP_GRAPH_MIN_ELEMENTS``)."""
    monkeypatch.setattr(_func, "JVP_GRAPH_MIN_ELEMENTS", dict.fromkeys(_func.JVP_GRAPH_MIN_ELEMENTS, 0))


@pytest.mark.parametrize("bound", ["none", "as set"])
@pytest.mark.parametrize("stack", list(_JVP_STACKS))
@pytest.mark.parametrize("call", ["typed", "bare"])
@pytest.mark.parametrize("op, leaves", list(_jvp_cases()))
def test_jvp_with_a_graph_below_keeps_every_derivative(op, leaves, call, stack, bound, monkeypatch):
    """Under ``jvp`` (``vmap`` beside it: ``jacfwd``) with a tensor requiring
    a gradient below the transform (a module's parameter in grad mode, an
    input with a graph): outputs and the gradients of a loss of them (each
    leaf) as the written-out version's (float64, to 1e-10). The typed API runs
    Keel's kernels there (the op's Function for torch.func with a ``jvp``,
    ``_func.DUAL_FUNCTIONS``) from ``_func.JVP_GRAPH_MIN_ELEMENTS`` on (here
    with no bound, and with the bound as set: these tensors are below it, so
    the paths of before); a bare op, whose autograd kernel cannot run a
    Function under torch.func, keeps the paths of before."""
    if bound == "none":
        _no_bound(monkeypatch)
    run = _JVP_STACKS[stack]
    got = []
    for kind in (call, "written"):
        t = _leaves(op, _JVP_LEAVES[leaves], 111)
        x, v = t["x"], t["v"]
        if stack == "vmap(jvp)":
            x, v = torch.stack([x, 2 * x]), torch.stack([v, -v])
        with torch.autograd.profiler.profile() as prof:
            outs = run(_fn(op, kind, t["w"], t["b"]), x, v)
        keys = _required(t)
        loss = sum((o * _t(*o.shape, seed=113 + i)).sum() for i, o in enumerate(outs))
        got.append((outs, torch.autograd.grad(loss, [t[k] for k in keys]), _names(prof)))
    (outs, grads, names), (want, want_g, _) = got
    if call == "typed" and bound == "none":
        assert f"keel::_{_OPS[op][2]}_nograd" in names, names
        assert "aten::rsqrt" not in names and "aten::_softmax" not in names, names
    else:
        assert f"keel::_{_OPS[op][2]}_nograd" not in names, names
    for a, c in zip(outs, want):
        torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
    for a, c in zip(grads, want_g):
        torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("op", list(_OPS))
def test_tangents_gradient_plain_and_batched(op):
    """The gradient of the tangent alone, ``x`` requiring one (through
    ``_twice._KernelTangent``'s backward): a plain backward leaves no graph on
    it (``requires_grad`` false, as the written-out version's), and a batched
    one (``is_grads_batched``: the backward under vmap) gives each row of
    gradients the written-out version's (float64, 1e-10)."""
    got = []
    for kind in ("typed", "written"):
        t = _leaves(op, ("x",), 123)
        _, tangent, _ = _dual_call(op, kind, t)
        gs = _t(3, *tangent.shape, seed=121)
        plain = torch.autograd.grad(tangent, t["x"], gs[1], retain_graph=True)[0]
        batched = torch.autograd.grad(tangent, t["x"], gs, is_grads_batched=True)[0]
        got.append((plain, batched))
    (plain, batched), (want_plain, want_batched) = got
    assert not plain.requires_grad and not batched.requires_grad
    torch.testing.assert_close(plain, want_plain, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(batched, want_batched, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(batched[1], plain, atol=1e-12, rtol=1e-12)
