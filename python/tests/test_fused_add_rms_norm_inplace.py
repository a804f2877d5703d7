"""keel.fused_add_rms_norm_ (in place, vLLM's form) against the out-of-place op:
the same bits in the same tensors, version counters, the refusal of gradients,
opcheck, torch.compile, bad input."""
import pytest
import torch

import keel
from conftest import LEADING, OPCHECK_UTILS, devices, dtypes_for, make

op = torch.ops.keel.fused_add_rms_norm_.default


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("n", [1, 7, 129, 4096])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("call", ["typed", "op"])
def test_same_bits_as_out_of_place(device, lead, n, with_weight, call):
    for dtype in dtypes_for(device):
        shape = (*lead, n)
        x, r = make(shape, dtype, device, 0), make(shape, dtype, device, 1)
        w = make(n, dtype, device, 2) if with_weight else None
        y, s = keel.fused_add_rms_norm(x, r, w, 1e-5)
        xi, ri = x.clone(), r.clone()
        ptrs = (xi.data_ptr(), ri.data_ptr())
        out = keel.fused_add_rms_norm_(xi, ri, w, 1e-5) if call == "typed" else op(xi, ri, w, 1e-5)
        assert out is None
        assert (xi.data_ptr(), ri.data_ptr()) == ptrs
        torch.testing.assert_close(xi, y, atol=0, rtol=0)
        torch.testing.assert_close(ri, s, atol=0, rtol=0)


@pytest.mark.parametrize("call", ["typed", "op"])
def test_bumps_versions_so_saved_tensors_are_checked(call):
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    f = keel.fused_add_rms_norm_ if call == "typed" else op
    f(x, r, None, 1e-6)
    assert (x._version, r._version) == (1, 1)
    # A tensor saved for a backward, then overwritten: torch must notice.
    a = torch.randn(3, 16, requires_grad=True)
    b = a * 1
    out = b.sin()
    with torch.no_grad():
        f(b, torch.randn(3, 16), None, 1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("call", ["typed", "op"])
@pytest.mark.parametrize("arg", ["input", "residual", "weight"])
def test_refuses_an_argument_requiring_grad(call, arg):
    t = {"input": torch.randn(2, 8), "residual": torch.randn(2, 8), "weight": torch.randn(8)}
    t[arg].requires_grad_()
    x, r = t["input"].clone(), t["residual"]
    f = keel.fused_add_rms_norm_ if call == "typed" else op
    with pytest.raises(RuntimeError, match=rf"keel::fused_add_rms_norm_: argument '{arg}' requires grad, and this in-place op has no backward; use keel.fused_add_rms_norm"):
        f(t["input"] if arg == "input" else x, r, t["weight"], 1e-6)
    # Under no_grad the same call is an ordinary in-place update.
    xs, rs, ws = (v.detach().clone() for v in (t["input"], t["residual"], t["weight"]))
    y, s = keel.fused_add_rms_norm(xs, rs, ws)
    with torch.no_grad():
        f(xs, rs, t["weight"], 1e-6)
    torch.testing.assert_close(xs, y, atol=0, rtol=0)


def test_inference_mode():
    with torch.inference_mode():
        x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
        y, s = keel.fused_add_rms_norm(x, r, w)
        keel.fused_add_rms_norm_(x, r, w)
        torch.testing.assert_close(x, y, atol=0, rtol=0)
        torch.testing.assert_close(r, s, atol=0, rtol=0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("with_weight", [True, False])
def test_opcheck(device, with_weight):
    from torch.library import opcheck

    for dtype in (torch.float32, torch.bfloat16):
        x, r = (torch.randn(3, 17, device=device, dtype=dtype) for _ in range(2))
        w = torch.randn(17, device=device, dtype=dtype) if with_weight else None
        opcheck(op, (x, r, w, 1e-6), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_fullgraph_dynamic(device):
    torch._dynamo.reset()

    def block(x, r, w):
        keel.fused_add_rms_norm_(x, r, w, 1e-6)
        return x * 2 + r

    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    w = torch.randn(64, device=device)
    for rows in (4, 9):
        x, r = torch.randn(rows, 64, device=device), torch.randn(rows, 64, device=device)
        xe, re = x.clone(), r.clone()
        want = block(xe, re, w)
        got = compiled(x, r, w)
        # The compiled function writes its inputs as eager does.
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(x, xe, atol=0, rtol=0)
        torch.testing.assert_close(r, re, atol=0, rtol=0)


BAD = [
    ("residual shape", lambda: (torch.randn(2, 4), torch.randn(2, 5), None), r"argument 'residual' has shape \[2, 5\]"),
    ("residual dtype", lambda: (torch.randn(2, 4), torch.randn(2, 4).bfloat16(), None), r"argument 'residual' has dtype torch.bfloat16"),
    ("weight shape", lambda: (torch.randn(2, 4), torch.randn(2, 4), torch.randn(3)), r"argument 'weight' must have shape \[4\]"),
    ("integer input", lambda: (torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64), None), r"argument 'input' must be float32"),
    ("expanded input", lambda: (torch.randn(1, 4).expand(3, 4), torch.randn(3, 4), None), r"argument 'input' has elements that share memory \(sizes \[3, 4\], strides \[0, 1\]\): the op writes it in place"),
    ("expanded residual", lambda: (torch.randn(3, 4), torch.randn(3, 1).expand(3, 4), None), r"argument 'residual' has elements that share memory \(sizes \[3, 4\], strides \[1, 0\]\)"),
    ("transposed residual overlaps transposed input", lambda: (lambda t: (t.t()[:3], t.t()[2:5], None))(torch.randn(4, 6)), r"argument 'residual' shares memory with 'input'"),
    ("residual is input", lambda: (lambda t: (t, t, None))(torch.randn(2, 4)), r"argument 'residual' shares memory with 'input'"),
    ("residual overlaps input", lambda: (lambda t: (t[:2], t[1:], None))(torch.randn(3, 4)), r"argument 'residual' shares memory with 'input'"),
    ("weight inside input", lambda: (lambda t: (t, torch.randn(2, 4), t[1]))(torch.randn(2, 4)), r"argument 'weight' shares memory with 'input'"),
    ("weight inside residual", lambda: (lambda t: (torch.randn(2, 4), t, t[0]))(torch.randn(2, 4)), r"argument 'weight' shares memory with 'residual'"),
]


@pytest.mark.parametrize("name,make_args,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_runtime_error_naming_op_and_argument(name, make_args, msg):
    args = make_args()
    before = [None if a is None else a.clone() for a in args]
    with pytest.raises(RuntimeError, match=r"keel::fused_add_rms_norm_: " + msg):
        op(*args, 1e-6)
    # A refused call writes nothing.
    for a, b in zip(args, before):
        if a is not None:
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_adjacent_rows_of_one_buffer_are_distinct():
    buf = torch.randn(2, 3, 8)
    x, r = buf[0], buf[1]
    y, s = keel.fused_add_rms_norm(x, r)
    keel.fused_add_rms_norm_(x, r)
    torch.testing.assert_close(x, y, atol=0, rtol=0)
    torch.testing.assert_close(r, s, atol=0, rtol=0)


def test_meta_and_empty():
    x, r = torch.empty(2, 8, device="meta"), torch.empty(2, 8, device="meta")
    assert op(x, r, None, 1e-6) is None
    x, r = torch.empty(0, 3), torch.empty(0, 3)
    keel.fused_add_rms_norm_(x, r)
    assert x.shape == r.shape == (0, 3)


def test_every_dispatch_path_bumps_versions_once():
    """Through the Autograd kernel (grad mode, no_grad), through the
    ADInplaceOrView kernel alone (below autograd), and through the typed API's
    own path: one bump per call, of each written argument only."""
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    calls = [
        lambda: op(x, r, w, 1e-6),
        lambda: keel.fused_add_rms_norm_(x, r, w),
    ]
    with torch.no_grad():
        calls[0]()
    assert (x._version, r._version, w._version) == (1, 1, 0)
    for i, call in enumerate(calls):
        call()
        assert (x._version, r._version, w._version) == (2 + i, 2 + i, 0), i
    with torch._C._AutoDispatchBelowAutograd():
        op(x, r, w, 1e-6)
    assert (x._version, r._version, w._version) == (4, 4, 0)


MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "below autograd": torch._C._AutoDispatchBelowAutograd}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", ["typed", "op"])
def test_strided_arguments_are_bumped_once(mode, call):
    """A strided argument is worked on in a copy that the kernel writes back
    with torch's copy_, which must not bump its version again: below autograd,
    the ADInplaceOrView kernel let it (two bumps a call, until session 93)."""
    x, r = torch.randn(2, 16)[:, ::2], torch.randn(2, 16)[:, ::2]
    want_x, want_r = keel.fused_add_rms_norm(x, r, None, 1e-6)
    with MODES[mode]():
        (keel.fused_add_rms_norm_ if call == "typed" else op)(x, r, None, 1e-6)
    assert (x._version, r._version) == (1, 1)
    assert torch.equal(x, want_x) and torch.equal(r, want_r)


def test_torch_func_grad_raises_rather_than_write_wrongly():
    """torch.func.grad meets the refusal (the op has no backward) and writes
    nothing. (vmap writes each example in place: test_vmap.py.)"""
    x, r = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    xs, rs = x.clone(), r.clone()
    with pytest.raises(RuntimeError, match="keel::fused_add_rms_norm_: argument 'input' requires grad"):
        torch.func.grad(lambda a: (keel.fused_add_rms_norm_(a, r), a.sum())[1])(x)
    assert torch.equal(x, xs) and torch.equal(r, rs)
