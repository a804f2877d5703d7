"""Each differentiable op's autograd kernel: Keel's own Python kernel on the op
itself, in every torch version (``_autograd._autograd_kernel``): the formula
where an argument requires a gradient, else the op's ``_nograd`` twin (the
same kernels, no autograd kernel; ``_common.nograd``)."""
import sys

import pytest
import torch

import keel
from keel._autograd import FORMULAS, WITH_TWIN
from keel._common import nograd

ops = torch.ops.keel


def test_every_differentiable_op_has_its_formula_and_twin():
    # Rust's list of ops with twins is Python's list of formulas: the
    # differentiable ops' and their backward ops' (``_backward_grad``).
    registered = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("keel::_")}
    assert {n for n in registered if n.endswith("_nograd")} == {f"keel::{nograd(n)}" for n in WITH_TWIN}
    assert not [n for n in registered if n.endswith("_autograd")], registered
    assert {f"{n}_backward" for n in FORMULAS if n != "cross_entropy_with_lse"} == set(WITH_TWIN) - set(FORMULAS)
    for name in WITH_TWIN:
        twin = nograd(name)
        schema, own = getattr(ops, twin).default._schema, getattr(ops, name).default._schema
        assert str(schema) == str(own).replace(f"keel::{name}(", f"keel::{twin}(", 1), (schema, own)
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"keel::{twin}", key), (twin, key)
        # The formula sits on the op; the twin has none (torch's fallthrough passes it).
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"keel::{name}", "Autograd"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"keel::{twin}", "Autograd"), twin


def _python_calls(f):
    """The Python functions called while `f()` runs (file name, function)."""
    seen = []

    def prof(frame, event, arg):
        if event == "call":
            seen.append((frame.f_code.co_filename, frame.f_code.co_name))

    sys.setprofile(prof)
    try:
        out = f()
    finally:
        sys.setprofile(None)
    return out, seen


@pytest.mark.parametrize("requires_grad", [True, False])
def test_grad_mode_runs_keels_autograd_kernel_not_torch_librarys(requires_grad):
    """On every torch: the Python autograd kernel that runs in grad mode is
    Keel's, not the one
    ``torch.library.register_autograd`` generates (15 us more a call for
    cross_entropy, most of it filling in defaults through the schema)."""
    x = torch.randn(4, 8, requires_grad=requires_grad)
    t = torch.tensor([1, 7, 0, 2])
    for op, call, setup in (
        ("softmax", lambda: ops.softmax.default(x, 1.0), "_softmax_setup"),
        ("cross_entropy", lambda: ops.cross_entropy_with_lse.default(x, t, -100, 0.0, "mean")[0], "_cross_entropy_lse_setup"),
    ):
        call()
        y, seen = _python_calls(call)
        assert (y.grad_fn is not None) == requires_grad, op
        ours = {s[1] for s in seen if s[0].endswith("_autograd.py")}
        assert "kernel" in ours, (op, seen)
        assert (setup in ours) == requires_grad, (op, seen)
        assert not [s for s in seen if "_library" in s[0]], (op, seen)


def test_defaults_left_out_reach_the_formula():
    """The dispatcher leaves trailing arguments equal to their defaults out of
    a Python kernel's call; Keel's autograd kernel puts them back for the formula."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 7, 0])
    cos, sin = torch.randn(2, 4, dtype=torch.float64).cos(), torch.randn(2, 4, dtype=torch.float64).sin()
    half = lambda v: v[..., :4]  # noqa: E731
    cases = {
        "softmax": (lambda v: ops.softmax(v), lambda v: torch.softmax(v, -1)),
        "gelu_and_mul": (lambda v: ops.gelu_and_mul(v), lambda v: torch.nn.functional.gelu(half(v)) * v[..., 4:]),
        "cross_entropy": (lambda v: ops.cross_entropy(v, t), lambda v: torch.nn.functional.cross_entropy(v, t)),
        "rms_norm": (lambda v: ops.rms_norm(v, None), lambda v: torch.nn.functional.rms_norm(v, (8,), None, 1e-6)),
        "rotary_embedding": (
            lambda v: ops.rotary_embedding(v.view(1, 3, 1, 8)[:, :2], cos, sin),
            lambda v: keel.rotary_embedding(v.view(1, 3, 1, 8)[:, :2], cos, sin),
        ),
    }
    for name, (keel_call, ref_call) in cases.items():
        (got,) = torch.autograd.grad(keel_call(x).square().sum(), x)
        (want,) = torch.autograd.grad(ref_call(x).square().sum(), x)
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize("mode", ["grad", "no_grad"])
def test_the_autograd_kernel_calls_the_twins_c_function(mode):
    """Where no gradient is needed, Keel's autograd kernel calls the twin's C
    function (``OpOverload._op``) with the arguments the dispatcher passed: no
    second ``OpOverload.__call__`` frame, no defaults filled back in (torch's
    parser costs 0.4-0.7 us for each scalar; softmax [1, 64] through
    ``torch.ops.keel``: 0.81-0.85x the time, measured). The caller's own
    ``__call__`` is the only one; the values are the twin's."""
    cm = {"grad": torch.enable_grad, "no_grad": torch.no_grad}[mode]
    x, t = torch.randn(4, 8), torch.tensor([1, 7, 0, 2])
    with cm():
        for name, call, twin in (
            ("softmax", lambda: ops.softmax.default(x), lambda: ops._softmax_nograd.default(x, 1.0)),
            ("cross_entropy", lambda: ops.cross_entropy.default(x, t), lambda: ops._cross_entropy_nograd.default(x, t)),
        ):
            got, seen = _python_calls(call)
            overloads = [s for s in seen if s[0].endswith("_ops.py") and s[1] == "__call__"]
            assert len(overloads) == 1, (name, seen)
            assert "kernel" in {s[1] for s in seen if s[0].endswith("_autograd.py")}, (name, seen)
            assert torch.equal(got, twin()), name


@pytest.mark.parametrize("mode", ["grad", "no_grad", "requires_grad"])
def test_every_op_forwards_values_and_gradients(mode):
    """Through torch.ops in each mode: values as the typed API's, and gradients
    where one is wanted."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, requires_grad=mode == "requires_grad")
    w = torch.randn(8)
    cos, sin = torch.randn(2, 4).cos(), torch.randn(2, 4).sin()
    t = torch.tensor([1, 7, 0])
    calls = {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
        "layer_norm": lambda: ops.layer_norm(x, w, None, 1e-5),
        "fused_add_rms_norm": lambda: ops.fused_add_rms_norm(x, w.expand(3, 8).contiguous(), w, 1e-6)[0],
        "silu_and_mul": lambda: ops.silu_and_mul(x),
        "gelu_and_mul": lambda: ops.gelu_and_mul(x, "tanh"),
        "softmax": lambda: ops.softmax(x, 0.5),
        "cross_entropy": lambda: ops.cross_entropy(x, t, -100, 0.0, "mean"),
        "cross_entropy_with_lse": lambda: ops.cross_entropy_with_lse(x, t, -100, 0.0, "sum")[0],
        "rotary_embedding": lambda: ops.rotary_embedding(x.view(1, 3, 1, 8)[:, :2], cos, sin, False),
    }
    assert set(calls) == set(FORMULAS)
    for name, call in calls.items():
        with torch.set_grad_enabled(mode != "no_grad"):
            y = call()
        with torch.inference_mode():
            want = call()  # the backend kernel, no autograd kernel at all
        torch.testing.assert_close(y.detach(), want, rtol=0, atol=0, msg=name)
        assert (y.grad_fn is not None) == (mode == "requires_grad"), name
        if mode == "requires_grad":
            (g,) = torch.autograd.grad(y.sum(), x)
            assert g.shape == x.shape and torch.isfinite(g).all(), name


@pytest.mark.parametrize("mode", ["grad", "no_grad", "requires_grad", "inference"])
def test_errors_name_the_op_and_argument_in_every_mode(mode):
    """The message is the kernel's own, word for word (no Python frames, no
    prefix added on the way through the autograd kernel and the twin)."""
    x = torch.randn(2, 8, requires_grad=mode == "requires_grad")
    w = torch.randn(8, dtype=torch.float64)
    ctx = torch.inference_mode() if mode == "inference" else torch.set_grad_enabled(mode != "no_grad")
    with ctx:
        x = x.detach().requires_grad_(mode == "requires_grad") if mode != "inference" else torch.randn(2, 8)
        with pytest.raises(RuntimeError, match=r"^keel::rms_norm: argument 'weight' has dtype torch.float64 but 'input' has torch.float32$"):
            ops.rms_norm(x, w, 1e-6)
        with pytest.raises(RuntimeError, match=r"^keel::gelu_and_mul: argument 'approximate' must be \"none\" or \"tanh\", got \"erf\"$"):
            ops.gelu_and_mul(x, "erf")


def test_calls_keep_reference_counts():
    """No argument gains or loses a reference through the autograd kernel and
    the twin, in either mode, on success or error."""
    x, w = torch.randn(2, 8), torch.randn(8)
    before = (sys.getrefcount(x), sys.getrefcount(w))
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for _ in range(500):
                ops.rms_norm(x, w, 1e-6)
                with pytest.raises(RuntimeError):
                    ops.rms_norm(x, w, -1.0)
    assert (sys.getrefcount(x), sys.getrefcount(w)) == before


def test_typed_api_in_grad_mode_calls_the_formula_without_the_ops_kernel():
    """Where an argument requires a gradient, the typed API calls the formula's
    ``apply`` itself (``_autograd.APPLY``): the same autograd.Function as the op's
    kernel would run, without the dispatcher's trip through that kernel (softmax
    [1, 64]: 6.8 against 9.2 us a call). Same graph node, same gradients."""
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 7, 0, 2])
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    for name, typed, op in (
        ("softmax", lambda: keel.softmax(x, 0.5), lambda: ops.softmax.default(x, 0.5)),
        ("rms_norm", lambda: keel.rms_norm(x, w, 1e-6), lambda: ops.rms_norm.default(x, w, 1e-6)),
        ("cross_entropy_with_lse", lambda: keel.cross_entropy(x, t, -100, 0.1, "mean"),
         lambda: ops.cross_entropy_with_lse.default(x, t, -100, 0.1, "mean")[0]),
    ):
        y, seen = _python_calls(typed)
        ours = {s[1] for s in seen if s[0].endswith("_autograd.py")}
        assert "kernel" not in ours and "forward" in ours, (name, seen)
        want = op()
        assert type(y.grad_fn).__name__ == type(want.grad_fn).__name__ == f"KeelBackward_{name}Backward"
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        grads = torch.autograd.grad(y.sum(), (x, w), allow_unused=True)
        wanted = torch.autograd.grad(want.sum(), (x, w), allow_unused=True)
        for g, e in zip(grads, wanted):
            assert (g is None) == (e is None), name
            if g is not None:
                torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_typed_api_without_a_gradient_skips_the_overloads_python_frame(mode):
    """Where no gradient can be needed, the typed API calls the op's C function
    (``OpOverload._op``, ``functional._fast``) without ``OpOverload.__call__``'s
    Python frame (0.7 us of a 3.5 us call on [1, 64]): the ``_nograd`` twin's, and
    the in-place ops' below their Python kernels or under inference mode. Same
    values as the op through ``torch.ops.keel``."""
    cm = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    with cm():
        x, w, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
        q, cos, sin = torch.randn(1, 4, 2, 8), torch.randn(4, 4), torch.randn(4, 4)
        cases = (
            ("softmax", lambda: keel.softmax(x, 0.5), lambda: ops.softmax(x, 0.5)),
            ("rms_norm", lambda: keel.rms_norm(x, w, 1e-6), lambda: ops.rms_norm(x, w, 1e-6)),
            ("fused_add_rms_norm_", lambda: _inplace(keel.fused_add_rms_norm_, (x, r), w, 1e-6),
             lambda: _inplace(ops.fused_add_rms_norm_, (x, r), w, 1e-6)),
            ("rotary_embedding_", lambda: _inplace(keel.rotary_embedding_, (q,), cos, sin),
             lambda: _inplace(ops.rotary_embedding_, (q,), cos, sin, False)),
        )
        for name, typed, op in cases:
            got, seen = _python_calls(typed)
            assert not [s for s in seen if s[0].endswith("_ops.py") and s[1] == "__call__"], (name, seen)
            want = op()
            for g, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert torch.equal(g, e), name


def _inplace(f, written, *args):
    """`f` on copies of the tensors `written` (then `args`); the copies."""
    copies = tuple(t.clone() for t in written)
    f(*copies, *args)
    return copies


def test_compiled_graphs_in_grad_mode_hold_the_ops_not_the_formula():
    """While torch.compile traces, the typed API calls the op itself, whose
    autograd AOTAutograd handles: dynamo's graph holds the ops, not an
    autograd.Function, and the gradient is the eager one."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    x, t = torch.randn(4, 8, requires_grad=True), torch.tensor([1, 2, 3, 0])
    norm = keel.nn.RMSNorm(8)

    def f(x):
        return keel.cross_entropy(keel.softmax(x, 0.5), t) + norm(x).sum()

    torch._dynamo.reset()
    y = torch.compile(f, backend=backend, fullgraph=True)(x)
    targets = [str(n.target) for n in graphs[0].nodes if n.op == "call_function" and "keel" in str(n.target)]
    assert targets == ["keel.softmax.default", "keel.cross_entropy_with_lse.default", "keel.rms_norm.default"], targets
    (g,) = torch.autograd.grad(y, x)
    (want,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(g, want)
