"""``__torch_function__``: the typed API and the ``keel.nn`` modules take part
in it as ``torch.nn.functional`` does, so that

- ``torch.fx.symbolic_trace`` records one ``call_function`` node per Keel
  call, where it failed before (a module's shape checks iterated a Proxy);
- a tensor subclass that overrides ``__torch_function__`` sees the Keel call,
  and torch's default handling hands back its subclass;
- a ``TorchFunctionMode`` sees it.

Each case compares the result with the plain call, bit for bit: the same
kernels run."""
import pytest
import torch
import torch.fx
from torch.overrides import TorchFunctionMode

import keel
import keel.functional as F
import keel.nn as knn


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cos_sin(seq, half):
    angles = _t(seq, half, seed=7)
    return angles.cos(), angles.sin()


# (name, the typed function, its tensor arguments (a function making them), the
# other arguments, the positions of the tensors it writes (in-place ops))
CASES = [
    ("rms_norm", F.rms_norm, lambda: (_t(3, 16), _t(16, seed=1)), (1e-5,), ()),
    ("layer_norm", F.layer_norm, lambda: (_t(3, 16), _t(16, seed=1), _t(16, seed=2)), (1e-5,), ()),
    ("fused_add_rms_norm", F.fused_add_rms_norm, lambda: (_t(3, 16), _t(3, 16, seed=1), _t(16, seed=2)), (1e-6,), ()),
    ("fused_add_rms_norm_", F.fused_add_rms_norm_, lambda: (_t(3, 16), _t(3, 16, seed=1), _t(16, seed=2)), (1e-6,),
     (0, 1)),
    ("silu_and_mul", F.silu_and_mul, lambda: (_t(3, 16),), (), ()),
    ("gelu_and_mul", F.gelu_and_mul, lambda: (_t(3, 16),), ("tanh",), ()),
    ("softmax", F.softmax, lambda: (_t(3, 16),), (0.5,), ()),
    ("cross_entropy", F.cross_entropy, lambda: (_t(4, 10), torch.tensor([1, 9, -100, 0])), (-100, 0.1, "mean"), ()),
    ("cross_entropy_with_lse", F.cross_entropy_with_lse, lambda: (_t(4, 10), torch.tensor([1, 9, -100, 0])),
     (-100, 0.0, "none"), ()),
    ("rotary_embedding", F.rotary_embedding, lambda: (_t(2, 3, 4, 8),) + _cos_sin(3, 4), (False,), ()),
    ("rotary_embedding_", F.rotary_embedding_, lambda: (_t(2, 3, 4, 8),) + _cos_sin(3, 4), (True,), (0,)),
]
IDS = [c[0] for c in CASES]


def _run(fn, tensors, others, written):
    """fn's result, or for an in-place op the tensors it wrote."""
    out = fn(*tensors, *others)
    return tuple(tensors[i] for i in written) if written else out


def _equal(actual, expected):
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(torch.Tensor(actual), expected, rtol=0, atol=0)
    else:
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _equal(a, e)


@pytest.mark.parametrize("name,fn,make,others,written", CASES, ids=IDS)
def test_fx_symbolic_trace_records_the_typed_call(name, fn, make, others, written):
    n = len(make())

    def f(*tensors):
        return fn(*tensors[:n], *others)

    traced = _trace_with(f, n)
    calls = [node for node in traced.graph.nodes if node.op == "call_function"]
    assert [c.target for c in calls] == [fn], traced.graph
    want = _run(fn, make(), others, written)
    got_inputs = make()
    got = traced(*got_inputs)
    _equal(tuple(got_inputs[i] for i in written) if written else got, want)


def _trace_with(f, n):
    """torch.fx.symbolic_trace of `f` called with `n` tensors (symbolic_trace
    makes a placeholder per named parameter, not for *args)."""
    names = [f"t{i}" for i in range(n)]
    wrapper = eval(f"lambda {', '.join(names)}: f({', '.join(names)})", {"f": f})  # noqa: S307 (a fixed arity)
    return torch.fx.symbolic_trace(wrapper)


class Logged(torch.Tensor):
    """A subclass whose __torch_function__ records each function called on it."""

    calls = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("name,fn,make,others,written", CASES, ids=IDS)
def test_subclass_sees_the_call_and_gets_its_type_back(name, fn, make, others, written):
    want = _run(fn, make(), others, written)
    tensors = tuple(t.as_subclass(Logged) for t in make())
    Logged.calls.clear()
    got = _run(fn, tensors, others, written)
    assert Logged.calls[0] is fn, Logged.calls
    for out in (got if isinstance(got, tuple) else (got,)):
        assert type(out) is Logged
    _equal(got, want)


class Recording(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,fn,make,others,written", CASES, ids=IDS)
def test_torch_function_mode_sees_the_call(name, fn, make, others, written):
    want = _run(fn, make(), others, written)
    tensors = make()
    with Recording() as mode:
        got = _run(fn, tensors, others, written)
    assert mode.calls[0] is fn, mode.calls
    _equal(got, want)


def _model(normalized_shape):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = knn.RMSNorm(normalized_shape, eps=1e-6)
            self.ln = knn.LayerNorm(normalized_shape)
            self.mlp = knn.SwiGLU(32, 24)
            self.loss = knn.CrossEntropyLoss(label_smoothing=0.05)

        def forward(self, x, target):
            h = self.ln(self.norm(x)).reshape(x.shape[0], 32)
            logits = self.mlp(h)
            return self.loss(logits, target)

    torch.manual_seed(0)
    block = Block()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return block


@pytest.mark.parametrize("normalized_shape", [32, (4, 8)], ids=["one-dim", "two-dims"])
def test_fx_traces_modules_to_one_node_each_with_eager_values_and_gradients(normalized_shape):
    block = _model(normalized_shape)
    shape = (5, 32) if normalized_shape == 32 else (5, 4, 8)
    traced = torch.fx.symbolic_trace(block)
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert knn._rms_norm_module in targets and knn._layer_norm_module in targets, traced.graph
    assert F.silu_and_mul in targets and F.cross_entropy in targets, traced.graph
    x, target = _t(*shape, seed=3), torch.tensor([0, 5, -100, 31, 2])
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    losses = [block(xs[0], target), traced(xs[1], target)]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    grads = [torch.autograd.grad(loss, [xi, *block.parameters()]) for loss, xi in zip(losses, xs)]
    for g_traced, g_eager in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_traced, g_eager, rtol=0, atol=0)


def test_module_subclass_input_sees_the_module_call():
    norm = knn.RMSNorm((4, 8))
    x = _t(3, 4, 8)
    Logged.calls.clear()
    out = norm(x.as_subclass(Logged))
    # Only the outer call: torch's default __torch_function__ runs it with subclass
    # handling off, as for torch.nn.functional.
    assert Logged.calls == [knn._rms_norm_module], Logged.calls
    assert type(out) is Logged
    torch.testing.assert_close(torch.Tensor(out), norm(x), rtol=0, atol=0)


def test_device_context_manager_is_a_mode_and_the_ops_still_run():
    """``with torch.device(...)`` is a TorchFunctionMode: every typed call takes
    the __torch_function__ path there, and must give the same result."""
    x, w = _t(3, 16), _t(16, seed=1)
    want = keel.rms_norm(x, w)
    with torch.device("cpu"):
        got = keel.rms_norm(x, w)
        got_module = knn.RMSNorm(16, eps=1e-6)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_module, keel.rms_norm(x, torch.ones(16)), rtol=0, atol=0)
