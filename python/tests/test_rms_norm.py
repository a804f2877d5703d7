"""keel.rms_norm against torch: values, gradients, opcheck, gradcheck,
torch.compile, bad input, the nn module and threads."""
import re

import pytest
import torch
import torch.nn.functional as F

import keel
from conftest import CPU_DTYPES, CUDA_DTYPES, OPCHECK_UTILS, DispatchedOps, assert_close, devices

SHAPES = [(1, 7), (3, 33), (2, 3, 129), (5, 4096), (4, 1), (0, 16), (2, 0, 8), (1, 8193)]


def reference(x, w, eps):
    """f64 reference from the already-rounded inputs."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


def dtypes_for(device):
    return CPU_DTYPES if device == "cpu" else CUDA_DTYPES


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_forward_matches_reference_and_torch(device, shape, with_weight):
    for dtype in dtypes_for(device):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=g).to(dtype).to(device)
        w = torch.randn(shape[-1], generator=g).to(dtype).to(device) if with_weight else None
        y = keel.rms_norm(x, w, 1e-6)
        assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
        assert_close(y, reference(x, w, 1e-6), dtype)
        # torch rounds to dtype before multiplying by the weight: allow two roundings.
        assert_close(y, F.rms_norm(x, (shape[-1],), w, 1e-6), dtype, scale=2.0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(3, 33), (2, 3, 129), (6, 1024), (0, 5)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_gradients_match_reference(device, shape, with_weight):
    for dtype in dtypes_for(device):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(shape, generator=g).to(dtype).to(device)
        w = torch.randn(shape[-1], generator=g).to(dtype).to(device) if with_weight else None
        dy = torch.randn(shape, generator=g).to(dtype).to(device)

        xk = x.clone().requires_grad_()
        wk = w.clone().requires_grad_() if with_weight else None
        keel.rms_norm(xk, wk, 1e-5).backward(dy)

        xr = x.double().requires_grad_()
        wr = w.double().requires_grad_() if with_weight else None
        reference(xr, wr, 1e-5).backward(dy.double())
        assert_close(xk.grad, xr.grad, dtype, scale=4.0)
        if with_weight:
            # grad_weight sums over every row: its rounding error grows with the row count.
            assert_close(wk.grad, wr.grad, dtype, scale=4.0 * max(1, x.numel() // shape[-1]) ** 0.5)


def test_gradcheck_f64():
    x = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: keel.rms_norm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda a: keel.rms_norm(a, None, 1e-5), (x,))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("with_weight", [True, False])
def test_opcheck(device, with_weight):
    from torch.library import opcheck

    x = torch.randn(3, 17, device=device, requires_grad=True)
    w = torch.randn(17, device=device, requires_grad=True) if with_weight else None
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    opcheck(torch.ops.keel.rms_norm.default, (x, w, 1e-6), test_utils=utils)
    dy = torch.randn(3, 17, device=device)
    opcheck(torch.ops.keel.rms_norm_backward.default, (dy, x.detach(), None if w is None else w.detach(), 1e-6), test_utils=utils)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def block(x, w):
        return keel.rms_norm(x * 2.0, w, 1e-6) + 1.0

    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(4, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    out = compiled(x, w)
    torch.testing.assert_close(out, block(x, w))
    out.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    block(x, w).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_meta_shapes_and_checks():
    x = torch.empty(2, 3, 8, device="meta")
    y = torch.ops.keel.rms_norm(x, torch.empty(8, device="meta"), 1e-6)
    assert y.shape == (2, 3, 8) and y.device.type == "meta"
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: argument 'weight' must have shape \[8\]"):
        torch.ops.keel.rms_norm(x, torch.empty(7, device="meta"), 1e-6)


BAD = [
    ("integer input", lambda: (torch.ones(2, 4, dtype=torch.int64), None, 1e-6), r"argument 'input' must be float32"),
    # dtypes Keel never computes with are named as torch names them, not by code
    ("complex input", lambda: (torch.ones(2, 4, dtype=torch.complex64), None, 1e-6), r"argument 'input' must be float32, float16, bfloat16 or float64, got torch.complex64$"),
    ("fp8 input", lambda: (torch.ones(2, 4).to(torch.float8_e4m3fn), None, 1e-6), r"argument 'input' must be .* got torch.float8_e4m3fn$"),
    ("int8 input", lambda: (torch.ones(2, 4, dtype=torch.int8), None, 1e-6), r"argument 'input' must be .* got torch.int8$"),
    ("uint8 weight", lambda: (torch.randn(2, 4), torch.ones(4, dtype=torch.uint8), 1e-6), r"argument 'weight' has dtype torch.uint8"),
    ("weight shape", lambda: (torch.randn(2, 4), torch.randn(5), 1e-6), r"argument 'weight' must have shape \[4\]"),
    ("weight 2-d", lambda: (torch.randn(2, 4), torch.randn(1, 4), 1e-6), r"argument 'weight' must have shape \[4\]"),
    ("weight dtype", lambda: (torch.randn(2, 4), torch.randn(4, dtype=torch.float64), 1e-6), r"argument 'weight' has dtype torch.float64"),
    ("devices differ", lambda: (torch.randn(2, 4), torch.randn(4, device="meta"), 1e-6), r"argument 'weight' is on meta but 'input' is on cpu"),
    ("0-dim", lambda: (torch.tensor(1.0), None, 1e-6), r"argument 'input' must have at least 1 dimension"),
    ("negative eps", lambda: (torch.randn(2, 4), None, -1.0), r"argument 'eps' must be finite and >= 0"),
    ("nan eps", lambda: (torch.randn(2, 4), None, float("nan")), r"argument 'eps' must be finite and >= 0"),
]


@pytest.mark.parametrize("name,make,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, make, msg):
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: " + msg):
        torch.ops.keel.rms_norm(*make())


def test_bad_input_to_backward():
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm_backward: argument 'grad_out' has shape \[2, 5\]"):
        torch.ops.keel.rms_norm_backward(torch.randn(2, 5), x, None, 1e-6)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm_backward: argument 'grad_out' has dtype torch.float16"):
        torch.ops.keel.rms_norm_backward(torch.randn(2, 4).half(), x, None, 1e-6)


def test_python_api_accepts_non_contiguous_input():
    x = torch.randn(6, 4).t()
    torch.testing.assert_close(keel.rms_norm(x), F.rms_norm(x, (6,), None, 1e-6))
    # Four leading dims that do not merge: the op refuses them, the typed API copies.
    x = torch.randn(2000).as_strided((2, 2, 2, 2, 4), (1000, 300, 50, 8, 1))
    torch.testing.assert_close(keel.rms_norm(x), F.rms_norm(x, (4,), None, 1e-6))


def strided_layouts(t, h, d, dtype, device):
    """(name, leaf, view): views whose rows are contiguous but not back to back:
    q and k of a fused qkv [t, 3 h d] viewed [t, h, d] (QK-norm), rows cut from
    wider ones (padded by one element: no 16-byte vectors), a [h, t, d] tensor
    transposed, and a broadcast batch (stride 0)."""
    g = torch.Generator().manual_seed(7)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return [
        ("q of qkv", mk(t, 3 * h * d), lambda a: a[:, : h * d].view(t, h, d)),
        ("k of qkv", mk(t, 3 * h * d), lambda a: a[:, h * d : 2 * h * d].view(t, h, d)),
        ("rows padded", mk(t, h, d + 1), lambda a: a[..., :d]),
        ("transposed", mk(h, t, d), lambda a: a.transpose(0, 1)),
        ("broadcast", mk(1, h, d), lambda a: a.expand(t, h, d)),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("with_weight", [True, False])
def test_strided_input_is_read_in_place(device, with_weight):
    t, h, d = 7, 3, 64
    for dtype in dtypes_for(device):
        w = torch.randn(d, dtype=torch.float64).to(dtype).to(device) if with_weight else None
        for name, leaf, view in strided_layouts(t, h, d, dtype, device):
            x = view(leaf)
            assert not x.is_contiguous() and x.stride(-1) == 1, name
            want = torch.ops.keel.rms_norm(x.contiguous(), w, 1e-6)
            # The bare op takes the view as it is, and gives the same bits.
            assert torch.equal(torch.ops.keel.rms_norm(x, w, 1e-6), want), name
            assert_close(want, reference(x, w, 1e-6), dtype)
            # The typed API passes it on with no copy, and so does keel.nn.RMSNorm.
            with DispatchedOps() as calls:
                got = keel.rms_norm(x, w)
            # Nothing requires a gradient: the op's _nograd twin (its kernels, no autograd kernel).
            assert calls.ops == ["keel._rms_norm_nograd.default"], (name, calls.ops)
            assert torch.equal(got, want) and got.is_contiguous(), name
            if with_weight:
                m = keel.nn.RMSNorm(d, eps=1e-6, device=device, dtype=dtype)
                with torch.no_grad():
                    m.weight.copy_(w)
                    assert torch.equal(m(x), want), name
            # Gradients reach the leaf through the view, and the backward reads
            # the saved view in place too (no copy of it).
            leaf_k, leaf_r = leaf.clone().requires_grad_(), leaf.clone().requires_grad_()
            dy = torch.randn(x.shape, dtype=torch.float64).to(dtype).to(device)
            y = keel.rms_norm(view(leaf_k), w)
            with DispatchedOps() as calls:
                y.backward(dy)
            assert "keel._rms_norm_backward_nograd.default" in calls.ops and "aten.clone.default" not in calls.ops, calls.ops
            keel.rms_norm(view(leaf_r).contiguous(), w).backward(dy)
            assert torch.equal(leaf_k.grad, leaf_r.grad), name
            # The backward op itself takes the view, with the same bits.
            g = torch.ops.keel.rms_norm_backward(dy, x, w, 1e-6)
            for a, b in zip(g, torch.ops.keel.rms_norm_backward(dy, x.contiguous(), w, 1e-6)):
                assert torch.equal(a, b), name


def test_rows_of_no_elements_give_empty_results_in_any_layout():
    # Rows of width 0 read nothing, wherever their (strided) starts would be:
    # a regression of the strided path, which first asked the input to hold
    # the span up to the last row's start.
    for x in (torch.empty(3, 2, 0), torch.empty(1, 2, 0).expand(3, 2, 0), torch.empty(4, 3, 0).transpose(0, 1)):
        y = torch.ops.keel.rms_norm(x, None, 1e-6)
        assert y.shape == x.shape and y.numel() == 0
        gx, gw = torch.ops.keel.rms_norm_backward(torch.empty(x.shape), x, torch.empty(0), 1e-6)
        assert gx.shape == x.shape and gw.shape == (0,)
        assert keel.rms_norm(x).shape == x.shape


def test_opcheck_and_compile_with_a_strided_input():
    from torch.library import opcheck

    qkv = torch.randn(5, 3 * 2 * 16, requires_grad=True)
    q = qkv[:, :32].view(5, 2, 16)
    w = torch.randn(16, requires_grad=True)
    opcheck(torch.ops.keel.rms_norm.default, (q, w, 1e-6), test_utils=OPCHECK_UTILS)
    torch._dynamo.reset()

    def qk_norm(qkv, w):
        q, k = qkv[:, :32].view(5, 2, 16), qkv[:, 32:64].view(5, 2, 16)
        return keel.rms_norm(q, w) * 2.0, keel.rms_norm(k, w)

    got = torch.compile(qk_norm, fullgraph=True)(qkv.detach(), w.detach())
    for a, b in zip(got, qk_norm(qkv.detach(), w.detach())):
        torch.testing.assert_close(a, b)


def test_nan_and_inf_propagate_like_torch():
    x = torch.tensor([[1.0, float("nan"), 2.0], [1.0, 2.0, 3.0], [float("inf"), 1.0, 1.0]])
    ours, theirs = keel.rms_norm(x), F.rms_norm(x, (3,), None, 1e-6)
    torch.testing.assert_close(ours, theirs, equal_nan=True)


def test_error_leaves_no_leak_of_inputs():
    import sys

    x = torch.randn(2, 4)
    w = torch.randn(5)
    # Against the counts before the calls, not a constant: CPython 3.14 counts
    # a local's references differently (getrefcount gives 1 where 3.13 gave 2).
    before = (sys.getrefcount(x), sys.getrefcount(w))
    for _ in range(100):
        with pytest.raises(RuntimeError):
            torch.ops.keel.rms_norm(x, w, 1e-6)
    # Every argument handle was released: only our own references remain.
    assert (sys.getrefcount(x), sys.getrefcount(w)) == before
    assert x._version == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape,eps", [(7, None), ((3, 5), 1e-5), (64, 1e-6)])
def test_nn_rmsnorm_is_a_drop_in_for_torch(device, shape, eps):
    torch.manual_seed(0)
    ours = keel.nn.RMSNorm(shape, eps=eps, device=device)
    theirs = torch.nn.RMSNorm(shape, eps=eps, device=device)
    with torch.no_grad():
        theirs.weight.normal_()
    ours.load_state_dict(theirs.state_dict())
    dims = (shape,) if isinstance(shape, int) else shape
    x = torch.randn(2, 3, *dims, device=device, requires_grad=True)
    torch.testing.assert_close(ours(x), theirs(x))
    ours(x).sum().backward()
    g_ours = (x.grad.clone(), ours.weight.grad.clone())
    x.grad = None
    theirs(x).sum().backward()
    torch.testing.assert_close(g_ours[0], x.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g_ours[1], theirs.weight.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", devices())
def test_nn_rmsnorm_default_eps_is_torchs_for_every_dtype(device):
    # eps=None: torch takes the epsilon of the dtype it computes in (float32's for
    # float16 and bfloat16), not the input dtype's; bfloat16's is 65536 times
    # float32's. On inputs near 1e-3 the mean square (1e-6) is of eps's order, so a
    # wrong eps moves every output: bfloat16's made them about 100 times smaller.
    for dtype in CPU_DTYPES if device == "cpu" else CUDA_DTYPES:
        torch.manual_seed(0)
        x = (torch.randn(4, 16, dtype=torch.float64) * 1e-3).to(dtype).to(device)
        ours, theirs = keel.nn.RMSNorm(16, device=device, dtype=dtype), torch.nn.RMSNorm(16, device=device, dtype=dtype)
        with torch.no_grad():
            want = theirs(x)
            got = ours(x)
        # Both round one f32 result to the dtype: within one unit in its last place.
        tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        torch.testing.assert_close(got, want, atol=0, rtol=tol)


@pytest.mark.parametrize("module", [keel.nn.RMSNorm, keel.nn.LayerNorm])
def test_nn_norms_refuse_an_empty_normalized_shape(module):
    # torch's refuse it too; each element would otherwise be normalised on its own.
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match=rf"^keel.nn.{module.__name__}: normalized_shape must have at least one dim"):
        module(())(x)
    with pytest.raises(RuntimeError):
        getattr(torch.nn, module.__name__)(())(x)


@pytest.mark.parametrize(
    "shape,bad",
    [((4, 8), (8, 4)), ((4, 8), (32,)), ((4, 8), (4, 7)), ((8,), (2, 4)), ((8,), (1, 8))],
    ids=["transposed", "flattened", "wrong-size", "one-dim-as-two", "one-dim-unsqueezed"],
)
def test_nn_rmsnorm_refuses_a_weight_not_of_normalized_shape(shape, bad):
    # torch.nn.RMSNorm refuses these too; a (8, 4) weight on (4, 8), or (2, 4) on (8,), has as
    # many elements and would otherwise be taken, silently, in the wrong order.
    m = keel.nn.RMSNorm(shape)
    m.weight = torch.nn.Parameter(torch.ones(bad))
    want = re.escape(f"keel.nn.RMSNorm: argument 'weight' must have shape {shape} (normalized_shape), got {bad}")
    with pytest.raises(RuntimeError, match=want):
        m(torch.randn(2, *shape))
    with pytest.raises(RuntimeError):
        torch.nn.functional.rms_norm(torch.randn(2, *shape), shape, torch.ones(bad))


def test_same_result_for_any_thread_count():
    x = torch.randn(300, 1000)
    w = torch.randn(1000, requires_grad=True)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            y = keel.rms_norm(x, w)
            (gw,) = torch.autograd.grad(y.sum(), w)
            results.append((y, gw))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-5)


def test_older_torch_is_refused_with_a_clear_message():
    from keel._load import check_torch_version

    with pytest.raises(ImportError, match=r"keel needs torch >= 2.10 .* this is torch 2.9.1"):
        check_torch_version("2.9.1")
    check_torch_version("2.10.0")
    check_torch_version("3.0.0a0+git")
