"""Every out-of-place op, forward and backward, takes each tensor argument in any
strided layout: rows padded (a padded matmul's output sliced back, as
torch.compile's Inductor makes on a GPU), the last dim strided (a transpose),
a broadcast. The result equals, bit for bit, the op on contiguous copies: an op
copies what its kernels cannot read in place, and reads the rest through its
strides. Before, most ops refused such a tensor ("must be contiguous"), so a
compiled graph whose matmul Inductor chose to pad failed on an H200 (session 36,
docs/GPU.md). The in-place ops write such a tensor too, through a contiguous copy
written back, and refuse only one whose elements share memory (see
test_fused_add_rms_norm_inplace.py and test_rotary_inplace.py)."""
import pytest
import torch

from conftest import devices

import keel

K = torch.ops.keel
N, C = 6, 40


def padded(t):
    """The same values, each row padded by 8 elements: the last dim contiguous,
    the row stride larger than the row."""
    big = torch.zeros(*t.shape[:-1], t.shape[-1] + 8, dtype=t.dtype, device=t.device)
    big[..., : t.shape[-1]] = t
    return big[..., : t.shape[-1]]


def column_major(t):
    """The same values with the first and last dims' strides swapped: the last
    dim strided (for a 1-dim tensor, every other element of a larger one)."""
    if t.dim() == 1:
        big = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
        big[::2] = t
        return big[::2]
    return t.transpose(0, -1).contiguous().transpose(0, -1)


def broadcast(t):
    """The same values where they are all equal along the rows: a stride-0 view."""
    return t[:1].expand(t.shape) if t.dim() > 1 else t


LAYOUTS = {"padded rows": padded, "last dim strided": column_major}


def calls(device):
    """(name, op, args): one call of every out-of-place op, contiguous args."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    x, w, b, dy = r(N, C), r(C), r(C), r(N, C)
    x2 = r(N, 2 * C)
    t = torch.randint(0, C, (N,), generator=g).to(device)
    xr, cs = r(2, 5, 3, 16), r(5, 6)
    y = torch.softmax(x, -1)
    return [
        ("rms_norm", K.rms_norm, [x, w, 1e-6]),
        ("rms_norm_backward", K.rms_norm_backward, [dy, x, w, 1e-6]),
        ("layer_norm", K.layer_norm, [x, w, b, 1e-5]),
        ("layer_norm_backward", K.layer_norm_backward, [dy, x, w, b, 1e-5]),
        ("fused_add_rms_norm", K.fused_add_rms_norm, [x, dy, w, 1e-6]),
        ("fused_add_rms_norm_backward", K.fused_add_rms_norm_backward, [dy, r(N, C), x, w, 1e-6]),
        ("silu_and_mul", K.silu_and_mul, [x2]),
        ("silu_and_mul_backward", K.silu_and_mul_backward, [dy, x2]),
        ("gelu_and_mul", K.gelu_and_mul, [x2, "tanh"]),
        ("gelu_and_mul_backward", K.gelu_and_mul_backward, [dy, x2, "none"]),
        ("softmax", K.softmax, [x, 0.5]),
        ("softmax_backward", K.softmax_backward, [dy, y, 0.5]),
        ("cross_entropy", K.cross_entropy, [x, t, -100, 0.1, "mean"]),
        ("cross_entropy_with_lse", K.cross_entropy_with_lse, [x, t, -100, 0.0, "none"]),
        ("cross_entropy_backward", K.cross_entropy_backward, [r(N), x, t, -100, 0.0, "none", None]),
        ("rotary_embedding", K.rotary_embedding, [xr, cs.cos(), cs.sin(), False]),
        ("rotary_embedding_backward", K.rotary_embedding_backward, [xr, cs.cos(), cs.sin(), True]),
    ]


def outputs(out):
    return out if isinstance(out, tuple) else (out,)


def cases():
    for name, _, args in calls("cpu"):
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.numel() > 1:
                yield name, i


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", list(LAYOUTS) + ["broadcast"])
@pytest.mark.parametrize("name,i", list(cases()))
def test_any_layout_gives_the_contiguous_result(device, layout, name, i):
    op, args = next((op, args) for n, op, args in calls(device) if n == name)
    arg = args[i]
    if layout == "broadcast":
        if arg.dim() < 2 or arg.dtype != torch.float32:
            pytest.skip("a broadcast needs 2 dims of floats")
        arg = arg[:1].expand(arg.shape).contiguous()  # equal rows, contiguous
        args = list(args)
        args[i] = arg
        view = broadcast(arg)
    else:
        view = LAYOUTS[layout](arg)
        if view.is_contiguous():
            pytest.skip("padding the rows of a 1-dim tensor leaves it contiguous")
    assert not view.is_contiguous() and torch.equal(view, arg)
    want = outputs(op(*args))
    got = outputs(op(*args[:i], view, *args[i + 1 :]))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.is_contiguous()
        # The same kernel on the same values: the same bits. A weight gradient
        # sums per block of rows, in an order set by the row count alone.
        assert torch.equal(g, w), (name, i, layout, (g - w).abs().max())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("which", ["input", "residual", "both"])
def test_fused_add_rms_norm_inplace_writes_any_layout(device, layout, which):
    """The in-place op on views: the same bits as the out-of-place op, written
    into the views' own memory (the base tensors change, nothing else)."""
    g = torch.Generator().manual_seed(1)
    x, r, w = (torch.randn(*s, generator=g).to(device) for s in ((N, C), (N, C), (C,)))
    want_out, want_sum = K.fused_add_rms_norm(x, r, w, 1e-6)
    xv = LAYOUTS[layout](x) if which in ("input", "both") else x.clone()
    rv = LAYOUTS[layout](r) if which in ("residual", "both") else r.clone()
    K.fused_add_rms_norm_(xv, rv, w, 1e-6)
    assert torch.equal(xv, want_out) and torch.equal(rv, want_sum)
    if which != "residual":
        assert not xv.is_contiguous() and torch.equal(xv._base[..., : xv.shape[-1]] if layout == "padded rows" else xv, want_out)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_inplace_writes_heads_with_a_strided_last_dim(device, interleaved):
    """rotary_embedding_ on heads whose last dim is strided: rotated in a copy
    and written back, the same bits as the out-of-place op."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 3, 16, generator=g).to(device)
    a = torch.randn(5, 6, generator=g).to(device)
    cos, sin = a.cos(), a.sin()
    want = K.rotary_embedding(x, cos, sin, interleaved)
    xv = column_major(x)
    assert xv.stride(-1) != 1
    K.rotary_embedding_(xv, cos, sin, interleaved)
    assert torch.equal(xv, want)


@pytest.mark.parametrize("device", devices())
def test_rms_norm_copies_leading_dims_it_cannot_merge(device):
    """rms_norm reads up to three leading dims through their strides; four that
    do not merge into one another are copied first."""
    x = torch.randn(2000, device=device).as_strided((2, 2, 2, 2, 4), (1000, 300, 50, 8, 1))
    w = torch.randn(4, device=device)
    assert torch.equal(K.rms_norm(x, w, 1e-6), K.rms_norm(x.contiguous(), w, 1e-6))
    dy = torch.randn(x.shape, device=device)
    for g, e in zip(K.rms_norm_backward(dy, x, w, 1e-6), K.rms_norm_backward(dy, x.contiguous(), w, 1e-6)):
        assert torch.equal(g, e)


@pytest.mark.parametrize("device", devices())
def test_compiled_graph_may_hand_over_a_view(device):
    """torch.compile passes the Keel op the view the graph makes (here a slice of
    a wider input; on a GPU also a padded matmul's output, below): its fake
    kernel and its real one both take it."""
    torch._dynamo.reset()
    x = torch.randn(N, C + 8, device=device)
    w = torch.randn(C, device=device)
    t = torch.randint(0, C, (N,), device=device)

    def f(x, w, t):
        v = x[:, :C]
        return (
            K.softmax(v, 1.0),
            K.rms_norm(v, w, 1e-6),
            K.layer_norm(v, w, None, 1e-5),
            K.cross_entropy(v, t, -100, 0.0, "mean"),
            K.silu_and_mul(x[:, : 2 * (C // 2)]),
        )

    got = torch.compile(f, fullgraph=True)(x, w, t)
    want = f(x.clone(), w, t)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", [d for d in devices() if d != "cpu"] or ["cuda"])
def test_compiled_padded_matmul_feeds_cross_entropy(device):
    """Inductor pads a matmul whose dims are not multiples of 8 where its
    benchmark finds that faster, and hands on the padded output sliced back:
    the case that failed on the H200. force_shape_pad makes it pad every time."""
    if not torch.cuda.is_available():
        pytest.skip("Inductor pads matmuls on a GPU only")
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    h = torch.randn(8, 16, device=device, requires_grad=True)
    w = torch.randn(16, 50, device=device)
    t = torch.randint(0, 50, (8,), device=device)

    def head(h, w, t):
        return keel.cross_entropy(h @ w, t, label_smoothing=0.05)

    with inductor_config.patch(force_shape_pad=True):
        loss = torch.compile(head, fullgraph=True)(h, w, t)
        loss.backward()
    h2 = h.detach().clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(h2 @ w, t, label_smoothing=0.05)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)  # TF32 where the GPU has it
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-4)
