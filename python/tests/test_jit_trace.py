"""torch.jit.trace (also what the TorchScript ONNX exporter and TensorBoard's
add_graph run) of modules and functions built on Keel's typed API.

trace records the ops a call dispatches, then checks the trace by running the
function again under no_grad. The typed API calls an op's ``_nograd`` twin
where no gradient can be needed, so a module with parameters traced in grad
mode recorded ``keel::rms_norm`` and its check ``keel::_rms_norm_nograd``:
"Graphs differed across invocations". While tracing, the typed API now calls
the op itself."""
import warnings

import pytest
import torch

import keel

torch.manual_seed(0)


def _swiglu():
    return keel.nn.SwiGLU(32, 48)


def _ce(logits):
    return keel.cross_entropy(logits, torch.arange(logits.shape[0]) % logits.shape[1])


CASES = [
    ("RMSNorm", lambda: keel.nn.RMSNorm(32), (4, 32)),
    ("LayerNorm", lambda: keel.nn.LayerNorm(32), (4, 32)),
    ("SwiGLU", _swiglu, (4, 32)),
    ("softmax", lambda: (lambda x: keel.softmax(x, 0.5)), (4, 32)),
    ("gelu_and_mul", lambda: (lambda x: keel.gelu_and_mul(x, "tanh")), (4, 32)),
    ("cross_entropy", lambda: _ce, (4, 32)),
]


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_trace_passes_its_check_and_matches_eager(name, make, shape, requires_grad):
    f = make()
    x = torch.randn(*shape, requires_grad=requires_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trace's warnings about Python values becoming constants
        traced = torch.jit.trace(f, (x,))  # check_trace=True: raises where the graphs differ
    graph = str(traced.graph)
    assert "keel::" in graph and "_nograd" not in graph, graph
    torch.testing.assert_close(traced(x), f(x), rtol=0, atol=0)
    if requires_grad:
        (g,) = torch.autograd.grad(traced(x).sum(), x)
        (want,) = torch.autograd.grad(f(x).sum(), x)
        # float32's default tolerance: eager cross_entropy's backward reads the lse its
        # forward saved, the traced op's recomputes it (both against float64: tested elsewhere).
        torch.testing.assert_close(g, want)


# torch.jit.script compiles calls of `torch.ops.keel.*` (the ops' schemas type
# them); the typed API and keel.nn are Python (try/except, *args) and are not
# scriptable: trace them, as above.
@torch.jit.script
def _scripted(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, target: torch.Tensor):
    normed, summed = torch.ops.keel.fused_add_rms_norm(x, residual, w, 1e-6)
    probs = torch.ops.keel.softmax(torch.ops.keel.layer_norm(normed, None, None, 1e-5), 0.5)
    gated = torch.ops.keel.gelu_and_mul(probs, "tanh")
    loss = torch.ops.keel.cross_entropy(summed, target, -100, 0.1, "sum")
    return gated, loss


def _eager(x, w, residual, target):
    normed, summed = keel.fused_add_rms_norm(x, residual, w, 1e-6)
    gated = keel.gelu_and_mul(keel.softmax(keel.layer_norm(normed, None, None, 1e-5), 0.5), "tanh")
    return gated, keel.cross_entropy(summed, target, -100, 0.1, "sum")


def test_script_of_keel_ops_matches_eager_after_save_and_load():
    import io

    buf = io.BytesIO()
    torch.jit.save(_scripted, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    assert "keel::fused_add_rms_norm" in str(loaded.graph)
    args = [torch.randn(6, 32), torch.randn(32), torch.randn(6, 32), torch.tensor([0, 31, -100, 5, 7, 1])]
    want = _eager(*args)
    for f in (_scripted, loaded):
        xs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        got = f(*xs)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        (got[0].sum() + got[1]).backward()
        xe = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        e = _eager(*xe)
        (e[0].sum() + e[1]).backward()
        for a, b in zip(xs[:3], xe[:3]):
            # float32's default tolerance: the typed cross_entropy's backward reads the lse
            # its forward saved, the op's recomputes it (as for the traced case above).
            torch.testing.assert_close(a.grad, b.grad)
