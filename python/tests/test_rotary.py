"""keel.rotary_embedding against plain torch implementations of the GPT-NeoX
(Llama) and GPT-J layouts, with Llama's own cos/sin; gradients, opcheck,
gradcheck, torch.compile, bad input."""
import pytest
import torch

import keel
from conftest import OPCHECK_UTILS, TOL, DispatchedOps, devices, dtypes_for, make


def ref_neox(x, cos, sin):
    """Rotate halves of the first rotary_dim dims (what Llama's apply_rotary_pos_emb does)."""
    half = cos.shape[-1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], -1)


def ref_gptj(x, cos, sin):
    """Rotate interleaved pairs (2i, 2i+1) of the first rotary_dim dims."""
    half = cos.shape[-1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    rot = torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
    return torch.cat([rot, x[..., 2 * half :]], -1)


def angles(seq, half, device, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    return torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq).to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 16), (1, 7, 2, 130), (0, 3, 2, 8)])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_forward_and_gradient_match_reference(device, shape, partial, interleaved):
    b, s, h, d = shape
    half = max(1, d // 4) if partial else d // 2
    a = angles(s, half, device)
    ref = ref_gptj if interleaved else ref_neox
    for dtype in dtypes_for(device):
        x = make(shape, dtype, device, 0, 2.0)
        cos, sin = a.cos().to(dtype), a.sin().to(dtype)
        xk = x.clone().requires_grad_()
        y = keel.rotary_embedding(xk, cos, sin, interleaved)
        xr = x.double().requires_grad_()
        want = ref(xr, cos.double(), sin.double())
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(y.double(), want, atol=2 * atol, rtol=rtol)
        dy = make(shape, dtype, device, 1)
        y.backward(dy)
        want.backward(dy.double())
        torch.testing.assert_close(xk.grad.double(), xr.grad, atol=2 * atol, rtol=rtol)


def strided_layouts(b, s, h, d, dtype, device):
    """(name, leaf, x): x a [b, s, h, d] view of the leaf tensor whose last dim is
    contiguous but which is not: q and k sliced from a fused qkv projection, a
    [b, h, s, d] tensor transposed, heads padded by one element (no 16-byte
    vectors), and a batch broadcast from one sequence (stride 0)."""
    qkv = make((b, s, 3 * h * d), dtype, device, 2)
    bhsd = make((b, h, s, d), dtype, device, 3)
    padded = make((b, s, h, d + 1), dtype, device, 4)
    one = make((1, s, h, d), dtype, device, 5)
    return [
        ("q of qkv", qkv, lambda t: t[..., : h * d].view(b, s, h, d)),
        ("k of qkv", qkv, lambda t: t[..., h * d : 2 * h * d].view(b, s, h, d)),
        ("transposed", bhsd, lambda t: t.transpose(1, 2)),
        ("padded heads", padded, lambda t: t[..., :d]),
        ("broadcast batch", one, lambda t: t.expand(b, s, h, d)),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("interleaved", [False, True])
def test_strided_x_is_read_in_place(device, interleaved):
    b, s, h, d = 2, 5, 3, 16
    a = angles(s, 6, device)
    for dtype in dtypes_for(device):
        cos, sin = a.cos().to(dtype), a.sin().to(dtype)
        for name, leaf, view in strided_layouts(b, s, h, d, dtype, device):
            x = view(leaf)
            assert not x.is_contiguous() and x.stride(-1) == 1, name
            want = torch.ops.keel.rotary_embedding(x.contiguous(), cos, sin, interleaved)
            # The bare op takes the view as it is, and gives the same bits.
            assert torch.equal(torch.ops.keel.rotary_embedding(x, cos, sin, interleaved), want), name
            # The typed API passes it on with no copy.
            with DispatchedOps() as calls:
                got = keel.rotary_embedding(x, cos, sin, interleaved)
            # Nothing requires a gradient: the op's _nograd twin (its kernels, no autograd kernel).
            assert calls.ops == ["keel._rotary_embedding_nograd.default"], (name, calls.ops)
            assert torch.equal(got, want) and got.is_contiguous(), name
            # Gradients reach the leaf through the view; the output gradient
            # is itself strided (transposed), read in place by the backward.
            leaf_k, leaf_r = leaf.clone().requires_grad_(), leaf.clone().requires_grad_()
            dy = make((b, h, s, d), dtype, device, 6).transpose(1, 2)
            keel.rotary_embedding(view(leaf_k), cos, sin, interleaved).backward(dy)
            keel.rotary_embedding(view(leaf_r).contiguous(), cos, sin, interleaved).backward(dy.contiguous())
            assert torch.equal(leaf_k.grad, leaf_r.grad), name


def test_opcheck_and_compile_with_a_strided_x():
    from torch.library import opcheck

    a = torch.randn(3, 3)
    x = torch.randn(2, 2, 3, 8, requires_grad=True).transpose(1, 2)
    opcheck(torch.ops.keel.rotary_embedding.default, (x, a.cos(), a.sin(), False), test_utils=OPCHECK_UTILS)
    torch._dynamo.reset()

    def f(q_bhsd, cos, sin):
        return keel.rotary_embedding(q_bhsd.transpose(1, 2), cos, sin).transpose(1, 2) * 2.0

    q = torch.randn(2, 4, 3, 8)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, a.cos(), a.sin()), f(q, a.cos(), a.sin()))


def llama_rope(q, position_ids, head_dim, base=10000.0):
    """Llama's rotary embedding (transformers' LlamaRotaryEmbedding and
    apply_rotary_pos_emb), on q laid out [batch, heads, seq, head_dim]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, emb


def test_matches_llama_with_its_cos_and_sin():
    torch.manual_seed(0)
    b, s, h, d = 2, 12, 4, 64
    positions = torch.arange(s)[None].expand(b, s)
    q = torch.randn(b, h, s, d)
    want, emb = llama_rope(q, positions, d)
    # Keel takes [batch, seq, heads, head_dim] (q transposed: read in place) and
    # the first half of Llama's cos/sin.
    cos, sin = emb[0, :, : d // 2].cos(), emb[0, :, : d // 2].sin()
    got = keel.rotary_embedding(q.transpose(1, 2), cos, sin)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


def test_per_sequence_positions_through_one_flattened_batch():
    """Positions that differ per sequence (left padding, packed sequences): batch
    and seq flattened into one seq of tokens, each with its own cos/sin row
    gathered from a table, as vLLM's positions index its cos/sin cache."""
    torch.manual_seed(0)
    b, s, h, d = 3, 10, 4, 64
    positions = torch.stack([torch.arange(s), torch.arange(s) + 7, (torch.arange(s) - 3).clamp(min=0)])
    q = torch.randn(b, h, s, d)
    want, _ = llama_rope(q, positions, d)
    table = llama_rope(torch.zeros(1, 1, 64, d), torch.arange(64)[None], d)[1][0, :, : d // 2]  # [max_pos, d/2]
    cos, sin = table.cos()[positions.flatten()], table.sin()[positions.flatten()]  # [b * s, d/2]
    got = keel.rotary_embedding(q.transpose(1, 2).reshape(1, b * s, h, d), cos, sin)
    torch.testing.assert_close(got.view(b, s, h, d).transpose(1, 2), want, atol=1e-5, rtol=1e-5)


def test_gradcheck_f64_including_cos_and_sin():
    x = torch.randn(2, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, 3, dtype=torch.float64)
    cos, sin = a.cos().requires_grad_(), a.sin().requires_grad_()
    for interleaved in (False, True):
        assert torch.autograd.gradcheck(lambda *t: keel.rotary_embedding(*t, interleaved), (x, cos, sin))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    from torch.library import opcheck

    x = torch.randn(2, 3, 2, 8, device=device, requires_grad=True)
    a = torch.randn(3, 3, device=device)
    for interleaved in (False, True):
        opcheck(torch.ops.keel.rotary_embedding.default, (x, a.cos(), a.sin(), interleaved), test_utils=OPCHECK_UTILS)
        opcheck(torch.ops.keel.rotary_embedding_backward.default, (x.detach(), a.cos(), a.sin(), interleaved), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def f(x, cos, sin):
        return keel.rotary_embedding(x * 2.0, cos, sin).pow(2).sum()

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(2, 5, 3, 16, device=device, requires_grad=True)
    a = angles(5, 8, device).float()
    out = compiled(x, a.cos(), a.sin())
    torch.testing.assert_close(out, f(x, a.cos(), a.sin()))
    out.backward()
    g = x.grad.clone()
    x.grad = None
    f(x, a.cos(), a.sin()).backward()
    torch.testing.assert_close(g, x.grad)


def _cs(seq=3, half=4, dtype=torch.float32):
    a = torch.randn(seq, half)
    return a.cos().to(dtype), a.sin().to(dtype)


BAD = [
    ("3-d x", lambda: keel.rotary_embedding(torch.randn(3, 2, 8), *_cs()), r"keel::rotary_embedding: argument 'x' must have 4 dims \[batch, seq, heads, head_dim\]"),
    # No last dim to read the stride of (the typed API raised IndexError, session 60).
    ("0-dim x", lambda: keel.rotary_embedding(torch.tensor(1.0), *_cs()), r"keel::rotary_embedding: argument 'x' must have at least 1 dimension, got a 0-dim tensor"),
    ("0-dim x needing a gradient", lambda: keel.rotary_embedding(torch.tensor(1.0, requires_grad=True), *_cs()), r"keel::rotary_embedding: argument 'x' must have at least 1 dimension, got a 0-dim tensor"),
    ("cos seq", lambda: keel.rotary_embedding(torch.randn(1, 4, 2, 8), *_cs()), r"keel::rotary_embedding: argument 'cos' must have shape \[seq, rotary_dim / 2\] with seq = 4"),
    ("rotary_dim too big", lambda: keel.rotary_embedding(torch.randn(1, 3, 2, 6), *_cs()), r"keel::rotary_embedding: argument 'cos' gives rotary_dim = 8 \(2 x its last dim\), more than head_dim = 6"),
    ("sin shape", lambda: keel.rotary_embedding(torch.randn(1, 3, 2, 8), _cs()[0], _cs(half=2)[1]), r"keel::rotary_embedding: argument 'sin' has shape \[3, 2\] but 'cos' has \[3, 4\]"),
    ("cos dtype", lambda: keel.rotary_embedding(torch.randn(1, 3, 2, 8), *_cs(dtype=torch.float64)), r"keel::rotary_embedding: argument 'cos' has dtype torch.float64 but 'x' has torch.float32"),
    ("integer", lambda: keel.rotary_embedding(torch.ones(1, 3, 2, 8, dtype=torch.int32), *_cs()), r"keel::rotary_embedding: argument 'x' must be float32"),
]


@pytest.mark.parametrize("name,call,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, call, msg):
    with pytest.raises(RuntimeError, match=msg):
        call()


def test_meta_and_nan():
    y = torch.ops.keel.rotary_embedding(torch.empty(2, 3, 4, 8, device="meta"), *(t.to("meta") for t in _cs()), True)
    assert y.shape == (2, 3, 4, 8) and y.device.type == "meta"
    x = torch.randn(1, 3, 1, 8)
    x[0, 1, 0, 0] = float("nan")
    y = keel.rotary_embedding(x, *_cs())
    assert torch.isnan(y[0, 1, 0, [0, 4]]).all() and not torch.isnan(y[0, [0, 2]]).any()
