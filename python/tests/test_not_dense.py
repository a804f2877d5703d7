"""Sparse, MKL-DNN, quantized and nested tensors: every op refuses them with a
RuntimeError naming the op and the argument (``abi/src/refuse.rs``), through
``torch.ops.keel`` and the typed API alike, in every grad mode. Before, torch's
NotImplementedError named the backend and an internal twin op
(``keel::_softmax_nograd``), and the typed API failed in ``.contiguous()``."""
import re
import warnings

import pytest
import torch

import keel
from conftest import devices

ops = torch.ops.keel


def _csr(t):
    if t.dim() < 2:
        raise RuntimeError("a CSR tensor has at least 2 dims")
    return t.to_sparse_csr()


def _kinds():
    """(name, make) for each kind of tensor Keel's ops do not take; `make`
    turns a dense float32 tensor into one."""
    out = [
        ("sparse_coo", lambda t: t.to_sparse()),
        ("sparse_csr", _csr),
        ("quantized", lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.quint8)),
        ("nested", lambda t: torch.nested.nested_tensor(list(t.unbind(0)))),
        ("jagged", lambda t: torch.nested.nested_tensor(list(t.unbind(0)), layout=torch.jagged)),
    ]
    if torch.backends.mkldnn.is_available():
        out.append(("mkldnn", lambda t: t.to_mkldnn()))
    return out


KINDS = _kinds()
WHAT = {
    "sparse_coo": r"is a torch\.sparse_coo tensor; .* call \.to_dense\(\) first",
    "sparse_csr": r"is a torch\.sparse_csr tensor; .* call \.to_dense\(\) first",
    "mkldnn": r"is a torch\._mkldnn tensor; .* call \.to_dense\(\) first",
    "quantized": r"is a quantized tensor \(torch\.quint8\); .* call \.dequantize\(\) first",
    "nested": r"is a nested tensor; .* \.to_padded_tensor\(0\.0\)",
    "jagged": r"is a nested tensor \(layout torch\.jagged\); .* \.to_padded_tensor\(0\.0\)",
}

x = lambda *s: torch.randn(*s)  # noqa: E731

# (op, argument made non-dense, the arguments (the one named is replaced), the typed function or None).
CASES = [
    ("rms_norm", "input", lambda: [x(4, 8), None, 1e-6], keel.rms_norm),
    ("rms_norm", "weight", lambda: [x(4, 8), x(8), 1e-6], keel.rms_norm),
    ("layer_norm", "input", lambda: [x(4, 8), None, None, 1e-5], keel.layer_norm),
    ("layer_norm", "bias", lambda: [x(4, 8), x(8), x(8), 1e-5], keel.layer_norm),
    ("fused_add_rms_norm", "residual", lambda: [x(4, 8), x(4, 8), None, 1e-6], keel.fused_add_rms_norm),
    ("fused_add_rms_norm_", "input", lambda: [x(4, 8), x(4, 8), None, 1e-6], keel.fused_add_rms_norm_),
    ("fused_add_rms_norm_", "weight", lambda: [x(4, 8), x(4, 8), x(8), 1e-6], keel.fused_add_rms_norm_),
    ("silu_and_mul", "input", lambda: [x(4, 8)], keel.silu_and_mul),
    ("gelu_and_mul", "input", lambda: [x(4, 8), "tanh"], keel.gelu_and_mul),
    ("softmax", "input", lambda: [x(4, 8), 1.0], keel.softmax),
    ("cross_entropy", "logits", lambda: [x(4, 8), torch.tensor([1, 2, 3, 0]), -100, 0.0, "mean"], keel.cross_entropy),
    ("cross_entropy", "target", lambda: [x(4, 8), torch.tensor([1, 2, 3, 0]), -100, 0.0, "mean"], keel.cross_entropy),
    ("rotary_embedding", "cos", lambda: [x(1, 4, 2, 8), x(4, 4), x(4, 4), False], keel.rotary_embedding),
    ("rotary_embedding_", "x", lambda: [x(1, 4, 2, 8), x(4, 4), x(4, 4), False], keel.rotary_embedding_),
    ("softmax_backward", "output", lambda: [x(4, 8), x(4, 8), 1.0], None),
]


def _schema_names(op):
    return [a.name for a in getattr(ops, op).default._schema.arguments]


def _case(op, arg, make_args, kind, device):
    """The arguments of `op` on `device` with `arg` made a `kind` tensor; a skip
    where torch cannot make one of that argument (a quantized int64 target, a
    CSR tensor of one dim, an MKL-DNN tensor on CUDA)."""
    make = dict(KINDS)[kind]
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in make_args()]
    i = _schema_names(op).index(arg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and CSR tensors warn that they are prototype / beta
        try:
            args[i] = make(args[i])
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"torch makes no {kind} tensor of {args[i].dtype}: {str(e).splitlines()[0]}")
    return args


def _expect(op, arg, kind, mode):
    if kind == "jagged" and mode == "inference_mode":
        # Inference mode skips the autograd key, where Keel's kernel sees a jagged
        # tensor; its own Python dispatch then refuses the op by its name.
        return rf"^keel\.{op}\.default$"
    # A nested tensor cannot be told from a dense one by the stable ABI: where an
    # op has several tensor arguments, the message lists them.
    named = rf"(argument '{arg}'|one of the arguments '[^:]*\b{arg}\b[^:]*)"
    return rf"^keel::{op}: {named} {WHAT[kind]}"


@pytest.mark.parametrize("kind", [k for k, _ in KINDS])
@pytest.mark.parametrize("op,arg,make_args,typed", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("device", devices())
def test_refused_naming_op_and_argument(op, arg, make_args, typed, kind, mode, device):
    args = _case(op, arg, make_args, kind, device)
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    calls = [("torch.ops.keel", getattr(ops, op).default)] + ([("keel", typed)] if typed is not None else [])
    for how, f in calls:
        with ctx(), pytest.raises(RuntimeError) as e:
            f(*args)
        assert re.search(_expect(op, arg, kind, mode), str(e.value)), (how, str(e.value))
        # The message is Keel's alone: not torch's NotImplementedError naming a twin op.
        assert "_nograd" not in str(e.value) and "_autograd" not in str(e.value), (how, str(e.value))


@pytest.mark.parametrize("kind", ["sparse_coo", "nested", "quantized"])
@pytest.mark.parametrize("module,op", [(keel.nn.RMSNorm, "rms_norm"), (keel.nn.LayerNorm, "layer_norm")])
def test_modules_refuse_naming_their_op(module, op, kind):
    """keel.nn's norms reshape their input first, which fails on these tensors
    with torch's message about reshape or sizes; they raise their op's refusal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = dict(KINDS)[kind](torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=_expect(op, "input", kind, "grad")):
        module(8)(x)


def test_rms_norm_module_refuses_an_integer_input_naming_its_op():
    """eps=None takes torch.finfo of the input's dtype, which raised a TypeError
    for an integer input before the op could name the argument."""
    with pytest.raises(RuntimeError, match=r"^keel::rms_norm: argument 'input' must be float32"):
        keel.nn.RMSNorm(8)(torch.ones(4, 8, dtype=torch.int64))
