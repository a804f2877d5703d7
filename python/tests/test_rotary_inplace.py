"""keel.rotary_embedding_ (in place, vLLM's form) against the out-of-place op:
the same bits through x's own strides, nothing else in its storage written,
version counters, the refusal of gradients, opcheck, torch.compile, bad input."""
import pytest
import torch

import keel
from conftest import OPCHECK_UTILS, devices, dtypes_for, make
from test_rotary import angles, strided_layouts

op = torch.ops.keel.rotary_embedding_.default


def layouts(b, s, h, d, dtype, device):
    """strided_layouts without the broadcast batch (heads that overlap), plus a
    contiguous x."""
    out = [(n, leaf, view) for n, leaf, view in strided_layouts(b, s, h, d, dtype, device) if n != "broadcast batch"]
    return out + [("contiguous", make((b, s, h, d), dtype, device, 7), lambda t: t)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("call", ["typed", "op"])
def test_same_bits_as_out_of_place_through_the_strides(device, interleaved, partial, call):
    b, s, h, d = 2, 5, 3, 16
    a = angles(s, 4 if partial else 8, device)
    for dtype in dtypes_for(device):
        cos, sin = a.cos().to(dtype), a.sin().to(dtype)
        for name, leaf, view in layouts(b, s, h, d, dtype, device):
            want = keel.rotary_embedding(view(leaf), cos, sin, interleaved)
            before = leaf.clone()
            x = view(leaf)
            out = keel.rotary_embedding_(x, cos, sin, interleaved) if call == "typed" else op(x, cos, sin, interleaved)
            assert out is None
            assert torch.equal(x, want), (name, dtype)
            # Everything of the storage that x does not reach is as it was.
            untouched = torch.ones_like(leaf, dtype=torch.bool)
            view(untouched).fill_(False)
            assert torch.equal(leaf[untouched], before[untouched]), (name, dtype)


def test_typed_api_makes_no_copy():
    from conftest import DispatchedOps

    qkv = torch.randn(2, 5, 3 * 4 * 16)
    q = qkv[..., : 4 * 16].view(2, 5, 4, 16)
    a = angles(5, 8, "cpu")
    cos, sin = a.cos().float(), a.sin().float()
    with DispatchedOps() as calls:
        keel.rotary_embedding_(q, cos, sin)
    assert calls.ops == ["keel.rotary_embedding_.default"], calls.ops


@pytest.mark.parametrize("mode", ["grad", "no_grad", "below autograd"])
@pytest.mark.parametrize("call", ["typed", "op"])
def test_a_strided_x_is_bumped_once(mode, call):
    """As for fused_add_rms_norm_: the write-back of the copy a strided x is
    rotated in bumps no version of its own."""
    modes = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "below autograd": torch._C._AutoDispatchBelowAutograd}
    a = angles(3, 4, "cpu")
    cos, sin = a.cos().float(), a.sin().float()
    x = torch.randn(1, 3, 2, 16)[..., ::2]
    want = keel.rotary_embedding(x, cos, sin)
    with modes[mode]():
        (keel.rotary_embedding_ if call == "typed" else op)(x, cos, sin, False)
    assert x._version == 1 and torch.equal(x, want)


@pytest.mark.parametrize("call", ["typed", "op"])
def test_bumps_version_and_refuses_gradients(call):
    f = keel.rotary_embedding_ if call == "typed" else op
    a = angles(3, 4, "cpu")
    cos, sin = a.cos().float(), a.sin().float()
    x = torch.randn(1, 3, 2, 8)
    f(x, cos, sin, False)
    assert x._version == 1
    leaf = torch.randn(1, 3, 2, 8, requires_grad=True)
    saved = leaf * 1
    out = saved.sin()  # saves `saved`
    with torch.no_grad():
        f(saved, cos, sin, False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    for arg in ("x", "cos", "sin"):
        t = {"x": torch.randn(1, 3, 2, 8), "cos": cos.clone(), "sin": sin.clone()}
        t[arg].requires_grad_()
        with pytest.raises(RuntimeError, match=rf"keel::rotary_embedding_: argument '{arg}' requires grad, and this in-place op has no backward; use keel.rotary_embedding"):
            f(t["x"] if arg != "x" else t["x"] * 1, t["cos"], t["sin"], False)


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    from torch.library import opcheck

    a = angles(5, 4, device)
    for dtype in dtypes_for(device)[:3]:
        cos, sin = a.cos().to(dtype), a.sin().to(dtype)
        for name, leaf, view in layouts(2, 5, 3, 16, dtype, device):
            opcheck(op, (view(leaf.clone()), cos, sin, False), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph_on_views_of_qkv(device):
    torch._dynamo.reset()
    h, d = 4, 16

    def attn_in(qkv, cos, sin):
        b, s, _ = qkv.shape
        q = qkv[..., : h * d].view(b, s, h, d)
        k = qkv[..., h * d : 2 * h * d].view(b, s, h, d)
        keel.rotary_embedding_(q, cos, sin)
        keel.rotary_embedding_(k, cos, sin)
        return q.sum(-1) + k.sum(-1)

    compiled = torch.compile(attn_in, fullgraph=True, dynamic=True)
    for s in (5, 9):
        a = angles(s, d // 2, device)
        cos, sin = a.cos().float(), a.sin().float()
        qkv = torch.randn(2, s, 3 * h * d, device=device)
        ref = qkv.clone()
        want = attn_in(ref, cos, sin)
        got = compiled(qkv, cos, sin)
        torch.testing.assert_close(got, want)  # inductor's sums may add in another order
        torch.testing.assert_close(qkv, ref, atol=0, rtol=0)  # q and k written where they lie, v untouched


def _cs(seq=3, half=4):
    a = torch.randn(seq, half)
    return a.cos(), a.sin()


BAD = [
    ("head not contiguous, heads shared", lambda: (torch.randn(1, 3, 1, 16)[..., ::2].expand(1, 3, 2, 8), *_cs()), r"argument 'x' has elements that share memory \(sizes \[1, 3, 2, 8\], strides \[48, 16, 0, 2\]\): the op writes it in place"),
    ("broadcast batch", lambda: (torch.randn(1, 3, 2, 8).expand(2, 3, 2, 8), *_cs()), r"argument 'x' has heads that overlap \(strides \[0, 16, 8, 1\]\)"),
    ("overlapping heads", lambda: (torch.randn(64).as_strided((1, 3, 2, 8), (48, 16, 4, 1)), *_cs()), r"argument 'x' has heads that overlap \(strides \[48, 16, 4, 1\]\)"),
    ("cos inside x", lambda: (lambda t: (t[:48].view(1, 3, 2, 8), t[40:52].view(3, 4), _cs()[1]))(torch.randn(64)), r"argument 'cos' shares memory with 'x'"),
    ("3-d x", lambda: (torch.randn(3, 2, 8), *_cs()), r"argument 'x' must have 4 dims"),
    ("cos seq", lambda: (torch.randn(1, 4, 2, 8), *_cs()), r"argument 'cos' must have shape \[seq, rotary_dim / 2\] with seq = 4"),
    ("integer", lambda: (torch.ones(1, 3, 2, 8, dtype=torch.int32), *_cs()), r"argument 'x' must be float32"),
]


@pytest.mark.parametrize("name,make_args,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, make_args, msg):
    args = make_args()
    before = [a.clone() for a in args]
    with pytest.raises(RuntimeError, match=r"keel::rotary_embedding_: " + msg):
        op(*args, False)
    for a, b in zip(args, before):  # a refused call writes nothing
        assert torch.equal(a, b)


def test_meta_and_empty():
    cos, sin = torch.empty(3, 4, device="meta"), torch.empty(3, 4, device="meta")
    assert op(torch.empty(1, 3, 2, 8, device="meta"), cos, sin, False) is None
    x = torch.empty(0, 3, 2, 8)
    keel.rotary_embedding_(x, *_cs())
    assert x.shape == (0, 3, 2, 8)
