"""Forward-mode AD and ``torch.func`` through bare ``torch.ops.keel``
(``keel._torch_version``): torch drops a custom op's tangents without a word,
and runs no custom op's Python autograd inside a transform; each of Keel's ops
with an autograd kernel, forward and backward ops alike, now takes its torch-op
version there. Tangents against central differences of the ops' own kernels,
and transforms' gradients against autograd's, in float64."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import keel
from keel._autograd import WITH_TWIN
from conftest import DispatchedOps
from test_backward_grad import CASES as BACKWARD_CASES

ops = torch.ops.keel


def _t(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _forward_cases():
    x, w, b, r = _t(3, 6, seed=1), _t(6, seed=2), _t(6, seed=3), _t(3, 6, seed=4)
    logits, classes = _t(4, 5, seed=5), torch.tensor([1, 4, -100, 0])
    probs = torch.softmax(_t(4, 5, seed=6), -1)
    rx, cs, sn = _t(2, 3, 2, 8, seed=7), _t(3, 3, seed=8), _t(3, 3, seed=9)
    return {
        "rms_norm": (ops.rms_norm, (x, w, 1e-5)),
        "rms_norm rounded before the weight": (ops.rms_norm, (x, w, 1e-5, True)),
        "layer_norm": (ops.layer_norm, (x, w, b)),
        "fused_add_rms_norm": (ops.fused_add_rms_norm, (x, r, w)),
        "silu_and_mul": (ops.silu_and_mul, (x,)),
        "gelu_and_mul": (ops.gelu_and_mul, (x,)),
        "gelu_and_mul tanh": (ops.gelu_and_mul, (x, "tanh")),
        "softmax": (ops.softmax, (x, 0.7)),
        "cross_entropy": (ops.cross_entropy, (logits, classes, -100, 0.1)),
        "cross_entropy probabilities": (ops.cross_entropy, (logits, probs, -100, 0.0, "sum", w[:5].abs())),
        "cross_entropy_with_lse": (ops.cross_entropy_with_lse, (logits, classes, -100, 0.0, "none")),
        "rotary_embedding": (ops.rotary_embedding, (rx, cs, sn)),
    }


CASES = {**_forward_cases(), **{f"{k} (backward op)": v for k, v in BACKWARD_CASES.items()}}


def test_every_op_with_an_autograd_kernel_has_a_case():
    named = {op._qualified_op_name.split("::")[1] for op, _ in CASES.values()}
    assert named == set(WITH_TWIN)


def _outputs(y):
    return y if isinstance(y, tuple) else (y,)


def _floats(args):
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]


def _moved(args, tangents, h):
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    for i, t in tangents.items():
        args[i] = args[i] + h * t
    return args


@pytest.mark.parametrize("grad_mode", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_tangents_match_finite_differences(name, grad_mode):
    op, args = CASES[name]
    g = torch.Generator().manual_seed(11)
    tangents = {i: torch.randn(args[i].shape, generator=g, dtype=args[i].dtype) for i in _floats(args)}
    with fwAD.dual_level(), torch.set_grad_enabled(grad_mode):
        dual = [fwAD.make_dual(a.detach(), tangents[i]) if i in tangents else a for i, a in enumerate(args)]
        outs = _outputs(op(*dual))
        got = [fwAD.unpack_dual(o).tangent for o in outs]
        values = [fwAD.unpack_dual(o).primal for o in outs]
        assert not any(o.requires_grad for o in outs), name  # no graph where none is wanted
    plain = _outputs(op(*_moved(args, tangents, 0.0)))
    h = 1e-6
    plus, minus = _outputs(op(*_moved(args, tangents, h))), _outputs(op(*_moved(args, tangents, -h)))
    for v, p0, t, p, m in zip(values, plain, got, plus, minus):
        assert v.dtype == p0.dtype and v.shape == p0.shape, name
        torch.testing.assert_close(v, p0, atol=1e-12, rtol=1e-10)
        if p0.numel() == 0:  # a missing weight's empty stand-in
            continue
        assert t is not None, name
        torch.testing.assert_close(t, (p - m) / (2 * h), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["rms_norm", "softmax", "rms_norm (backward op)", "cross_entropy (backward op)"])
def test_forward_over_reverse(name):
    """A Hessian-vector product through the bare op: a dual input that also
    requires grad, then a reverse gradient whose tangent is the product."""
    op, args = CASES[name]
    i = _floats(args)[0] if "backward" not in name else 1  # the input (not grad_out)
    x = args[i].detach()
    v = _t(*x.shape, seed=12)

    def grad_at(z, dual=None):
        a = list(args)
        a[i] = z if dual is None else dual
        out = _outputs(op(*a))
        return torch.autograd.grad(sum(o.square().sum() for o in out), z)[0]

    with fwAD.dual_level():
        z = x.clone().requires_grad_()
        hvp = fwAD.unpack_dual(grad_at(z, fwAD.make_dual(z, v))).tangent
    h = 1e-6
    want = (grad_at((x + h * v).requires_grad_()) - grad_at((x - h * v).requires_grad_())) / (2 * h)
    assert hvp is not None
    torch.testing.assert_close(hvp, want, atol=1e-5, rtol=1e-4)


def test_bad_argument_with_a_tangent_gets_keels_error():
    x, w = _t(3, 6, seed=1), _t(5, seed=2)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="keel::rms_norm: .*weight"):
            ops.rms_norm(fwAD.make_dual(x, torch.ones_like(x)), w, 1e-6)


_TYPED = {
    "layer_norm": lambda x, w, b: keel.layer_norm(x, w, b),
    "silu_and_mul": lambda x, w, b: keel.silu_and_mul(x),
    "rotary_embedding": lambda x, w, b: keel.rotary_embedding(x.reshape(1, 3, 1, 6), w[:3].expand(3, 3), b[:3].expand(3, 3)),
}


_KERNEL_DUALS = {  # case -> (forward kernel on the primal, backward kernel for the tangent)
    "layer_norm": ("layer_norm", "layer_norm_backward"),
    "typed layer_norm": ("layer_norm", "layer_norm_backward"),
    "rms_norm": ("rms_norm", "rms_norm_backward"),
    "rms_norm rounded before the weight": ("rms_norm", "rms_norm_backward"),
    "fused_add_rms_norm": ("fused_add_rms_norm", "rms_norm_backward"),
    "softmax": ("softmax", "softmax_backward"),
}


@pytest.mark.parametrize("name", list(CASES) + [f"typed {k}" for k in _TYPED])
def test_forward_mode_runs_no_kernel_on_the_primals(name):
    """With a tangent, Keel's kernel is not run on the primals as well (its
    values would be thrown away: the torch-op version or torch's own op gives
    them); its checks run on meta stand-ins. Rotary, the norms and softmax
    with a tangent on ``x`` alone are the exceptions: their output is the
    kernel's on the primal, their tangent Keel's kernels' (rotary's on the
    tangent, the others' backward; ``_twice.kernel_parts``)."""
    if name.startswith("typed "):
        x, w, b = _t(3, 6, seed=1), _t(6, seed=2), _t(6, seed=3)
        op, args = _TYPED[name[len("typed ") :]], (x, w, b)
    else:
        op, args = CASES[name]
    i = _floats(args)[0]
    with fwAD.dual_level():
        dual = list(args)
        dual[i] = fwAD.make_dual(args[i].detach(), torch.ones_like(args[i]))
        with DispatchedOps() as mode:
            outs = _outputs(op(*dual))
        assert fwAD.unpack_dual(outs[0]).tangent is not None, name
    kernels = [op for op in mode.on_data if op.startswith("keel.")]
    if name in ("rotary_embedding", "typed rotary_embedding"):
        assert kernels == ["keel._rotary_embedding_nograd.default"] * 2, name
    elif name in _KERNEL_DUALS:
        assert kernels == [f"keel._{k}_nograd.default" for k in _KERNEL_DUALS[name]], name
    else:
        assert kernels == [], name


_SCALAR_CASES = {
    "softmax scale": lambda z: keel.softmax(z, 0.5),
    "softmax scale f32": lambda z: keel.softmax(z.float(), 0.5),
    "gelu_and_mul tanh": lambda z: keel.gelu_and_mul(z, "tanh"),
    "rms_norm": lambda z: keel.rms_norm(z, None),
    "layer_norm": lambda z: keel.layer_norm(z, None, None),
    "gelu_and_mul backward": lambda z: ops.gelu_and_mul_backward(z[:, :3], z),
    "silu_and_mul backward": lambda z: ops.silu_and_mul_backward(z[:, :3], z),
    "gelu_and_mul tanh backward": lambda z: ops.gelu_and_mul_backward(z[:, :3], z, "tanh"),
    "softmax backward": lambda z: ops.softmax_backward(z, z.softmax(-1), 0.5),
    "layer_norm weight bias": lambda z: keel.layer_norm(z, _t(6, seed=2), _t(6, seed=3)),
    "rms_norm weight": lambda z: keel.rms_norm(z, _t(6, seed=2)),
    "rms_norm weight f32": lambda z: keel.rms_norm(z.float(), _t(6, seed=2).float()),
    "bare layer_norm weight bias": lambda z: ops.layer_norm(z, _t(6, seed=2), _t(6, seed=3)),
    "rotary": lambda z: keel.rotary_embedding(z.reshape(1, 3, 1, 6), _t(3, 3, seed=4), _t(3, 3, seed=5)),
    "rotary expanded cos": lambda z: keel.rotary_embedding(z.reshape(1, 3, 1, 6), _t(3, seed=4).expand(3, 3), _t(3, 3, seed=5)),
}


@pytest.mark.parametrize("name", list(_SCALAR_CASES))
def test_forward_mode_takes_no_zero_tensor_path(name):
    """In forward mode the torch-op versions add and multiply numbers through
    ``add.Scalar`` and ``mul.Scalar`` (``_common.plus``, ``times``), and on small
    tensors give a weight, a bias, rotary's cos and sin a zero tangent
    (``_twice.zero_tangents``): else torch makes the missing tangent an
    efficient zero tensor (``aten::_efficientzerotensor``) and sizes its op
    through the op's meta (for ``add``, Python's: ``prims::``), 0.2 ms or more
    a call."""
    events = _profiled_with_a_tangent(_SCALAR_CASES[name])
    zero_path = [e.name for e in events if e.name.startswith("prims::") or e.name == "aten::_efficientzerotensor"]
    assert zero_path == []


def _profiled_with_a_tangent(case):
    """The profiler's events of `case` called on a ``[3, 6]`` float64 tensor
    with a tangent, its first output checked to carry one."""
    x = _t(3, 6, seed=1)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with torch.autograd.profiler.profile() as prof:
            out = case(dual)
        assert fwAD.unpack_dual(_outputs(out)[0]).tangent is not None
    return prof.function_events


_CE_TARGET = torch.tensor([1, -100, 5])
_CE_CASES = {
    "cross_entropy weight": lambda z: keel.cross_entropy(z, _CE_TARGET, weight=_t(6, seed=2).abs()),
    "cross_entropy weight smoothing": lambda z: keel.cross_entropy(z, _CE_TARGET, label_smoothing=0.1, weight=_t(6, seed=2).abs()),
    "cross_entropy weight none": lambda z: keel.cross_entropy(z, _CE_TARGET, reduction="none", weight=_t(6, seed=2).abs()),
    "cross_entropy_with_lse": lambda z: keel.cross_entropy_with_lse(z, _CE_TARGET),
    "bare cross_entropy_with_lse": lambda z: ops.cross_entropy_with_lse(z, _CE_TARGET),
}


@pytest.mark.parametrize("name", list(_CE_CASES))
def test_forward_mode_cross_entropy_masks_without_zero_tensor_products(name):
    """Cross-entropy's torch-op versions zero the ignored rows' log-sum-exp
    with ``where``, not a product with the mask, and scale the class weights
    and the smoothing term through ``mul.Scalar`` (``_common.class_weighted``):
    in forward mode such a product meets the mask's or the number's missing
    tangent as an efficient zero tensor (0.19-0.35 ms a call on ``[8, 64]``,
    docs/BENCHMARKS.md session 112). ``where`` with a number makes one too,
    sized without the Python meta: the only zero tensors left."""
    events = _profiled_with_a_tangent(_CE_CASES[name])
    assert [e.name for e in events if e.name.startswith("prims::")] == []
    made_by = {e.cpu_parent.name for e in events if e.name == "aten::_efficientzerotensor"}
    assert made_by <= {"aten::where"}


@pytest.mark.parametrize("bare", [False, True])
def test_forward_mode_lse_of_an_ignored_row_is_zero(bare):
    """An ignored row's log-sum-exp is 0 in forward mode as from the kernel,
    an inf among its logits included (a product with the mask gave NaN), with
    tangent 0; the other rows' values and tangents as the kernel's and
    ``torch.logsumexp``'s."""
    op = ops.cross_entropy_with_lse if bare else keel.cross_entropy_with_lse
    x = _t(3, 6, seed=1)
    x[1, 2] = float("inf")
    want_loss, want_lse = op(x, _CE_TARGET)
    v = _t(3, 6, seed=2)
    with fwAD.dual_level():
        loss, lse = (fwAD.unpack_dual(o) for o in op(fwAD.make_dual(x, v), _CE_TARGET))
    torch.testing.assert_close(loss.primal, want_loss, atol=0, rtol=1e-12)
    torch.testing.assert_close(lse.primal, want_lse, atol=0, rtol=1e-12)
    assert lse.primal[1] == 0 and lse.tangent[1] == 0
    p = torch.softmax(x[[0, 2]], -1)
    torch.testing.assert_close(lse.tangent[[0, 2]], (p * v[[0, 2]]).sum(-1), atol=1e-12, rtol=1e-10)


def _loss(op, args, i):
    """`op`'s outputs' sum of squares as a function of argument `i`."""

    def f(z):
        a = list(args)
        a[i] = z
        return sum(o.square().sum() for o in _outputs(op(*a)) if o.numel())

    return f


@pytest.mark.parametrize("name", list(CASES))
def test_torch_func_grad_and_jvp_match_autograd(name):
    """torch.func.grad and torch.func.jvp of the bare op (each floating argument
    in turn) against torch.autograd through Keel's formulas."""
    op, args = CASES[name]
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    for i in _floats(args):
        f = _loss(op, args, i)
        z = args[i].clone().requires_grad_()
        # (layer_norm_backward's outputs do not depend on the bias: zeros.)
        (want,) = torch.autograd.grad(f(z), z, allow_unused=True, materialize_grads=True)
        torch.testing.assert_close(torch.func.grad(f)(args[i]), want, atol=1e-10, rtol=1e-8, msg=lambda m: f"{name} {i}: {m}")
        v = _t(*args[i].shape, seed=13)
        _, tangent = torch.func.jvp(f, (args[i],), (v,))
        torch.testing.assert_close(tangent, (want * v).sum(), atol=1e-9, rtol=1e-8, msg=lambda m: f"{name} {i}: {m}")


def test_hessian_of_a_backward_op():
    op, (g, x, w, eps) = CASES["rms_norm (backward op)"]
    f = _loss(op, (g.detach(), x.detach(), w.detach(), eps), 1)
    h = torch.func.hessian(f)(x.detach())
    v = _t(*x.shape, seed=14)
    z = x.detach().clone().requires_grad_()
    (gz,) = torch.autograd.grad(f(z), z, create_graph=True)
    (want,) = torch.autograd.grad((gz * v).sum(), z)
    torch.testing.assert_close((h * v).sum((2, 3)), want, atol=1e-9, rtol=1e-8)


def test_bad_argument_inside_torch_func_gets_keels_error():
    """Errors name the op (not its ``_nograd`` twin) and the argument."""
    x, w = _t(3, 6, seed=1), _t(5, seed=2)
    with pytest.raises(RuntimeError, match="keel::rms_norm_backward: .*weight"):
        torch.func.grad(lambda z: ops.rms_norm_backward(z, x, w, 1e-6)[0].sum())(x)
    meta = _t(6, seed=2).to("meta")
    with pytest.raises(RuntimeError, match="^keel::rms_norm: argument 'weight' is on meta but 'input' is on cpu"):
        torch.func.grad(lambda z: ops.rms_norm(z, meta, 1e-6).sum())(x)


_BARE_NORMS = {
    "rms_norm": lambda x, r, w, b: ops.rms_norm(x, w, 1e-6),
    "layer_norm": lambda x, r, w, b: ops.layer_norm(x, w, b),
    "layer_norm without weight": lambda x, r, w, b: ops.layer_norm(x, None, b),
    "fused_add_rms_norm": lambda x, r, w, b: ops.fused_add_rms_norm(x, r, w),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_BARE_NORMS))
def test_bare_norms_inside_torch_func_run_torchs_own_op(name, dtype, monkeypatch):
    """The bare norms under ``vjp`` and ``vmap(grad)`` run torch's own op
    (``F.rms_norm``, ``F.layer_norm``: the torch-op version is refused), at
    every size (torch.func runs no Function inside an op's autograd kernel):
    outputs and gradients those of autograd through Keel's kernels within one
    rounding (f32: 1e-5; bf16: 2^-7, of the largest)."""
    from keel import _torch_version

    def refuse(*_):
        raise AssertionError("the torch-op version ran")

    for k in ("rms_norm", "layer_norm", "fused_add_rms_norm"):
        monkeypatch.setitem(_torch_version.REFS, k, refuse)
    gen = torch.Generator().manual_seed(3)
    x, r, t = (torch.randn(4, 6, 32, generator=gen).to(dtype) for _ in range(3))
    w, b = (torch.randn(32, generator=gen).to(dtype) for _ in range(2))
    fn = _BARE_NORMS[name]

    def outs(o):
        return o if isinstance(o, tuple) else (o,)

    def loss(x, w, b, r, t):
        return sum((o.float() * t.float()).sum() for o in outs(fn(x, r, w, b)))

    leaves = [a.detach().requires_grad_() for a in (x, w, b)]
    want_out = outs(fn(leaves[0], r, *leaves[1:]))
    want = torch.autograd.grad(loss(*leaves, r, t), leaves, allow_unused=True, materialize_grads=True)
    tol = 1e-5 if dtype == torch.float32 else 2**-7

    def close(a, b):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * max(b.float().abs().max().item(), 1))

    out, pull = torch.func.vjp(lambda x, w, b: fn(x, r, w, b), x, w, b)
    for a, b_ in zip(outs(out), want_out):
        close(a, b_)
    ones = torch.autograd.grad(list(want_out), leaves, [torch.ones_like(o) for o in want_out], allow_unused=True)
    cotangent = tuple(torch.ones_like(o) for o in outs(out))
    for a, b_ in zip(pull(cotangent if isinstance(out, tuple) else cotangent[0]), ones):
        close(a, torch.zeros_like(a) if b_ is None else b_)
    per_example = torch.func.vmap(torch.func.grad(loss, (0, 1, 2)), in_dims=(0, None, None, 0, 0))(x, w, b, r, t)
    close(per_example[0], want[0])
    for a, b_ in zip(per_example[1:], want[1:]):
        close(a.sum(0), b_)


def test_bare_norms_keep_the_torch_op_version_for_float64_round_before_weight_and_second_derivatives(monkeypatch):
    """float64 (``F.layer_norm`` loses digits on rows far from 0), rms_norm's
    ``round_before_weight`` (torch's op has none) and a second derivative
    (``F.layer_norm``'s double backward raises for a bias without weight) keep
    the torch-op version, as the typed API's do."""
    from keel import _torch_version

    seen = []
    for k in ("rms_norm", "layer_norm"):
        ref = _torch_version.REFS[k]
        monkeypatch.setitem(_torch_version.REFS, k, lambda *a, ref=ref, k=k: seen.append(k) or ref(*a))
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.func.grad(lambda x: ops.layer_norm(x.double(), None, w.double()).sum())(x)
    torch.func.grad(lambda x: torch.func.grad(lambda x: ops.layer_norm(x, None, w).sin().sum())(x).sum())(x)
    torch.func.grad(lambda x: ops.rms_norm(x, w, 1e-6, True).sum())(x)
    assert seen == ["layer_norm", "layer_norm", "rms_norm"]
    seen.clear()
    torch.func.grad(lambda x: ops.layer_norm(x, None, w).sum())(x)
    torch.func.grad(lambda x: ops.rms_norm(x, w, 1e-6, False).sum())(x)
    assert seen == []


def _rotary_inputs(seed, shape=(1, 3, 2, 8), half=3, inf=True):
    x = _t(*shape, seed=seed)
    if inf:
        x[0, 1, 0, 1] = float("inf")  # its partner's tangent too: x[..., 1 + half] pairs with it
    return x, _t(shape[1], half, seed=seed + 1), _t(shape[1], half, seed=seed + 2), _t(*shape, seed=seed + 3)


_ROTARY_CALLS = {
    "typed": lambda x, c, s, i: keel.rotary_embedding(x, c, s, i),
    "bare": lambda x, c, s, i: ops.rotary_embedding(x, c, s, i),
}


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("call", list(_ROTARY_CALLS))
@pytest.mark.parametrize("mode", ["forward_ad", "jvp"])
@pytest.mark.parametrize("shape", [(1, 3, 2, 8), (2, 128, 8, 64)], ids=["small", "past the zero-tangent bound"])
def test_forward_mode_rotary_tangent_is_the_rotation_of_the_tangent(shape, mode, call, interleaved):
    """rotary_embedding is linear in ``x``: where only ``x`` carries a tangent
    its output's tangent is the rotation of that tangent, finite wherever
    ``cos`` and ``sin`` are, an inf in ``x`` included (a zero tangent given to
    cos and sin made it NaN there: ``0 * inf``), at every size; the primal is
    the kernel's. Against Keel's kernel on the tangent, float64."""
    x, c, s, v = _rotary_inputs(11, shape, shape[-1] // 2 - 1)
    fn = _ROTARY_CALLS[call]
    want = ops.rotary_embedding(x, c, s, interleaved)
    want_t = ops.rotary_embedding(v, c, s, interleaved)
    assert want_t.isfinite().all()
    if mode == "jvp":
        primal, tangent = torch.func.jvp(lambda z: fn(z, c, s, interleaved), (x,), (v,))
    else:
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, v), c, s, interleaved))
    torch.testing.assert_close(primal, want, atol=0, rtol=1e-12, equal_nan=True)
    torch.testing.assert_close(tangent, want_t, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("call", list(_ROTARY_CALLS))
def test_forward_ad_rotary_runs_the_kernel_on_primal_and_tangent(call):
    """Under ``forward_ad`` alone (no ``torch.func`` transform) both the output
    and its tangent come from Keel's kernel: its ``_nograd`` twin runs twice, and
    no torch op of the written-out version (no ``cat``) does. (A first call
    before: Keel's checks run the twin on meta stand-ins too, once for each
    kind of arguments, so the count would depend on the tests run before.)"""
    x, c, s, v = _rotary_inputs(21, inf=False)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, v)
        _ROTARY_CALLS[call](dual, c, s, False)
        with torch.autograd.profiler.profile() as prof:
            out = _ROTARY_CALLS[call](dual, c, s, False)
        assert fwAD.unpack_dual(out).tangent is not None
    names = [e.name for e in prof.function_events]
    assert names.count("keel::_rotary_embedding_nograd") == 2, names
    assert "aten::cat" not in names


_JVP_STACKS = {  # x and v stacked for vmap beforehand (stack runs cat)
    "jvp": lambda f, x, v: torch.func.jvp(f, (x,), (v,)),
    "vmap(jvp)": lambda f, x, v: torch.func.vmap(lambda a, b: torch.func.jvp(f, (a,), (b,)))(x, v),
    "jacfwd": lambda f, x, v: (torch.func.jacfwd(f)(x),),
}


@pytest.mark.parametrize("stack", list(_JVP_STACKS))
@pytest.mark.parametrize("call", list(_ROTARY_CALLS))
def test_jvp_rotary_runs_the_kernel_on_primal_and_tangent(call, stack):
    """Under ``jvp`` (``vmap`` beside it: ``jacfwd``) too, with a tangent on
    ``x`` alone, the output and its tangent come from Keel's kernel on
    functorch's wrappers (its ``_nograd`` twin; no ``cat`` of the
    written-out version), with the written-out version's values, the
    per-example ``cos`` of a ``vmap`` included."""
    x, c, s, v = _rotary_inputs(23, inf=False)
    fn = _ROTARY_CALLS[call]
    run = _JVP_STACKS[stack]
    if stack == "vmap(jvp)":
        x, v = torch.stack([x, 2 * x]), torch.stack([v, -v])
    with torch.autograd.profiler.profile() as prof:
        got = run(lambda z: fn(z, c, s, False), x, v)
    names = [e.name for e in prof.function_events]
    assert names.count("keel::_rotary_embedding_nograd") >= 2, names
    assert "aten::cat" not in names
    want = run(lambda z: keel._twice.rotary(z, c, s, False), x, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    if stack == "vmap(jvp)":
        cs = torch.stack([c, c.flip(0)])
        got = torch.func.vmap(lambda a, b, c: torch.func.jvp(lambda z: fn(z, c, s, False), (a,), (b,)))(x, v, cs)
        for i in range(2):
            torch.testing.assert_close(got[0][i], ops.rotary_embedding(x[i], cs[i], s), atol=0, rtol=0)
            torch.testing.assert_close(got[1][i], ops.rotary_embedding(v[i], cs[i], s), atol=0, rtol=0)


_TRACKED_OUTSIDE = {
    # an autograd graph through jvp: x requires a gradient below the wrapper
    "autograd of jvp": lambda f, x, v: torch.autograd.grad(
        sum((o * w).sum() for o, w in zip(torch.func.jvp(f, (x,), (v,)), (_t(*x.shape, seed=51), _t(*x.shape, seed=52)))),
        x,
    ),
    # an outer tangent on x: through the inner jvp's primal
    "jvp of jvp": lambda f, x, v: torch.func.jvp(
        lambda a: (lambda o, t: o * t.sum())(*torch.func.jvp(f, (a,), (v,))), (x,), (_t(*x.shape, seed=53),)
    ),
    "grad of jvp": lambda f, x, v: torch.func.grad(lambda a: (torch.func.jvp(f, (a,), (v,))[1] ** 2).sum())(x),
    "jvp of grad": lambda f, x, v: torch.func.jvp(torch.func.grad(lambda a: (f(a) ** 3).sum()), (x,), (v,)),
}


@pytest.mark.parametrize("outer", list(_TRACKED_OUTSIDE))
@pytest.mark.parametrize("call", list(_ROTARY_CALLS))
def test_rotary_tracked_outside_its_jvp_keeps_every_derivative(call, outer):
    """Where something outside rotary's ``jvp`` tracks ``x`` too (an autograd
    graph, an outer ``jvp``, a ``grad`` transform), Keel's kernel on the
    wrappers would lose that level's derivative (the twin has no autograd):
    the results are the written-out version's, float64."""
    x, c, s, v = _rotary_inputs(41, inf=False)
    fn = _ROTARY_CALLS[call]
    run = _TRACKED_OUTSIDE[outer]
    xs = [x.clone().requires_grad_() if outer == "autograd of jvp" else x for _ in range(2)]
    got = run(lambda z: fn(z, c, s, False), xs[0], v)
    want = run(lambda z: keel._twice.rotary(z, c, s, False), xs[1], v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("requires", ["x", "cos"])
def test_forward_mode_rotary_with_a_gradient_or_a_cos_tangent_keeps_the_written_out_version(requires):
    """Where ``x`` also requires a gradient (forward-over-reverse) or ``cos``
    carries a tangent too, rotary's torch-op version serves: its tangent and
    the input's gradient against central differences and autograd."""
    x, c, s, v = _rotary_inputs(31, inf=False)
    ct = _t(*c.shape, seed=35)
    h = 1e-6
    with fwAD.dual_level():
        if requires == "x":
            xg = x.clone().requires_grad_()
            out = keel.rotary_embedding(fwAD.make_dual(xg, v), c, s)
            primal, tangent = fwAD.unpack_dual(out)
            want_t = (keel.rotary_embedding(x + h * v, c, s) - keel.rotary_embedding(x - h * v, c, s)) / (2 * h)
            (g,) = torch.autograd.grad(primal.sum(), xg)
            torch.testing.assert_close(g, torch.autograd.grad(keel.rotary_embedding(xg, c, s).sum(), xg)[0])
        else:
            out = keel.rotary_embedding(fwAD.make_dual(x, v), fwAD.make_dual(c, ct), s)
            tangent = fwAD.unpack_dual(out).tangent
            hi = keel.rotary_embedding(x + h * v, c + h * ct, s)
            want_t = (hi - keel.rotary_embedding(x - h * v, c - h * ct, s)) / (2 * h)
    torch.testing.assert_close(tangent, want_t, atol=1e-7, rtol=1e-6)
