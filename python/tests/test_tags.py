"""Keel's ops carry torch's ``pt2_compliant_tag`` where torch takes tags at an
op's definition (2.12 on, ``torch_library_def_with_tags``), as every op that
``torch.library.custom_op`` defines does: ``torch.compile`` under
``torch._dynamo.config.only_allow_pt2_compliant_ops`` keeps them in its graph
where it would otherwise break the graph on each. The tag claims that the op
passes ``torch.library.opcheck``: each op's own test file runs it, and this
one runs it on the ``_nograd`` twins, which the typed API and compiled graphs
call where no gradient is needed."""
import pytest
import torch
from torch.torch_version import TorchVersion

import keel
from conftest import OPCHECK_UTILS, devices

TAKES_TAGS = TorchVersion(torch.__version__) >= (2, 12)
NEEDS_TAGS = pytest.mark.skipif(
    not TAKES_TAGS, reason=f"torch {torch.__version__} takes no tags at an op's definition (2.12 on does)"
)


def keel_ops():
    """Every op in the keel namespace, by name (`rms_norm`, `_rms_norm_nograd`, ...)."""
    names = [n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("keel::")]
    assert "rms_norm" in names and "_rms_norm_nograd" in names
    return sorted(names)


def test_every_op_but_the_abi_selftest_is_pt2_compliant_where_torch_takes_tags():
    for name in keel_ops():
        tags = getattr(torch.ops.keel, name).default.tags
        want = TAKES_TAGS and name != "_abi_selftest"
        assert (torch.Tag.pt2_compliant_tag in tags) == want, (name, tags, torch.__version__)


def _twin_args(device):
    """Arguments for each `_nograd` twin: tensors that need no gradient, as the
    twins are called (the schema's scalars given, not defaulted)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(device)

    x, w, b = t(3, 16), t(16), t(16)
    target = torch.tensor([1, -100, 15]).to(device)
    a = t(3, 4)
    return {
        "rms_norm": (x, w, 1e-6),
        "layer_norm": (x, w, b, 1e-5),
        "fused_add_rms_norm": (x, t(3, 16), w, 1e-6),
        "silu_and_mul": (x,),
        "gelu_and_mul": (x, "tanh"),
        "softmax": (x, 0.5),
        "cross_entropy": (x, target, -100, 0.1, "sum", w.abs()),
        "cross_entropy_with_lse": (x, target, -100, 0.0, "mean", None),
        "rotary_embedding": (t(2, 3, 2, 8), a.cos(), a.sin(), True),
        "rms_norm_backward": (t(3, 16), x, w, 1e-6),
        "layer_norm_backward": (t(3, 16), x, None, b, 1e-5),
        "fused_add_rms_norm_backward": (t(3, 16), t(3, 16), x, w, 1e-6),
        "silu_and_mul_backward": (t(3, 8), x),
        "gelu_and_mul_backward": (t(3, 8), x, "tanh"),
        "softmax_backward": (t(3, 16), x.softmax(-1), 0.5),
        "cross_entropy_backward": (t(()), x, target, -100, 0.1, "mean", None, w.abs()),
        "rotary_embedding_backward": (t(2, 3, 2, 8), a.cos(), a.sin(), False),
    }


@pytest.mark.parametrize("device", devices())
def test_opcheck_of_every_nograd_twin(device):
    from torch.library import opcheck

    args = _twin_args(device)
    twins = [n for n in keel_ops() if n.endswith("_nograd")]
    assert sorted(f"_{n}_nograd" for n in args) == twins, "a twin without a case here"
    for name, a in args.items():
        twin = getattr(torch.ops.keel, f"_{name}_nograd").default
        opcheck(twin, a, test_utils=OPCHECK_UTILS)
        # The twin is the op's kernels under another name.
        got, want = twin(*a), getattr(torch.ops.keel, name).default(*a)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _model(x, w, b, r, target, cos, sin):
    h = keel.rms_norm(x, w)
    h = keel.layer_norm(h, w, b)
    h, s = keel.fused_add_rms_norm(h, r, w)
    h = keel.silu_and_mul(torch.cat([h, s], -1)) + keel.gelu_and_mul(torch.cat([s, h], -1), "tanh")
    h = keel.softmax(h, 0.5)
    q = keel.rotary_embedding(h.view(1, 4, 2, 8), cos, sin)
    return keel.cross_entropy(q.reshape(4, 16), target)


@NEEDS_TAGS
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_compile_keeps_every_op_in_its_graph_under_only_allow_pt2_compliant_ops(grad):
    """fullgraph=True: a graph break on any op (a Keel op without the tag)
    fails the call. Both the ops and, where no gradient is needed, their twins."""
    import torch._dynamo

    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    w, b = torch.rand(16, generator=g) + 0.5, torch.randn(16, generator=g)
    w.requires_grad_(grad)
    target = torch.tensor([3, -100, 0, 15])
    a = torch.randn(4, 4, generator=g)
    args = (x, w, b, r, target, a.cos(), a.sin())
    want = _model(*args)
    gwant = torch.autograd.grad(want, w)[0] if grad else None
    torch._dynamo.reset()
    with torch._dynamo.config.patch(only_allow_pt2_compliant_ops=True):
        got = torch.compile(_model, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if grad:
        torch.testing.assert_close(torch.autograd.grad(got, w)[0], gwant, atol=1e-6, rtol=1e-5)


@NEEDS_TAGS
def test_compile_keeps_the_in_place_ops_under_only_allow_pt2_compliant_ops():
    import torch._dynamo

    def f(x, r, w, q, cos, sin):
        keel.fused_add_rms_norm_(x, r, w)
        keel.rotary_embedding_(q, cos, sin)
        return x * 2, r, q

    g = torch.Generator().manual_seed(2)
    x, r, w = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.rand(16, generator=g)
    q, a = torch.randn(1, 4, 2, 8, generator=g), torch.randn(4, 4, generator=g)
    eager = [t.clone() for t in (x, r, w, q)]
    want = f(*eager[:3], eager[3], a.cos(), a.sin())
    torch._dynamo.reset()
    with torch._dynamo.config.patch(only_allow_pt2_compliant_ops=True):
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w, q, a.cos(), a.sin())
    for gt, wt in zip(got, want):
        torch.testing.assert_close(gt, wt, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(TAKES_TAGS, reason=f"torch {torch.__version__} takes tags: the ops have them")
def test_without_tags_the_ops_still_compile_where_non_compliant_ops_are_allowed():
    """Before 2.12 the ops are defined untagged; torch.compile's default takes them."""
    x, w = torch.randn(4, 16), torch.rand(16)
    torch.testing.assert_close(torch.compile(keel.rms_norm, fullgraph=True, backend="aot_eager")(x, w), keel.rms_norm(x, w))
