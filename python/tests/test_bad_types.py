"""Arguments of the wrong Python type (a list or a numpy array for a tensor, a
string for a float) get a RuntimeError naming the op that was called and the
argument: through the typed API in every grad mode, and through ``keel.nn``.

Before, a value that is not a tensor failed in the typed API's own
preparation (``AttributeError: 'list' object has no attribute 'contiguous'``),
and torch's parser error for a scalar named the op's internal ``_nograd``
twin (``keel::_softmax_nograd() Expected a value of type 'float'...``)."""
import contextlib

import numpy as np
import pytest
import torch

import keel


def _x(requires_grad):
    return torch.randn(4, 8, requires_grad=requires_grad)


def _q(requires_grad):
    return torch.randn(1, 2, 2, 8, requires_grad=requires_grad)


_COS = torch.randn(2, 4)
_TARGET = torch.tensor([0, 1, 2, 3])

# (id, op name in the error, argument name, call given a function making the first tensor)
CASES = [
    ("rms_norm-input", "rms_norm", "input", lambda x: keel.rms_norm(np.ones((4, 8), np.float32))),
    ("rms_norm-weight", "rms_norm", "weight", lambda x: keel.rms_norm(x(), [1.0] * 8)),
    ("rms_norm-eps", "rms_norm", "eps", lambda x: keel.rms_norm(x(), None, "1e-6")),
    ("layer_norm-bias", "layer_norm", "bias", lambda x: keel.layer_norm(x(), None, [0.0])),
    ("layer_norm-eps", "layer_norm", "eps", lambda x: keel.layer_norm(x(), None, None, torch.ones(3))),
    ("fused_add_rms_norm-residual", "fused_add_rms_norm", "residual", lambda x: keel.fused_add_rms_norm(x(), [1])),
    ("silu_and_mul-input", "silu_and_mul", "input", lambda x: keel.silu_and_mul((1.0, 2.0))),
    ("gelu_and_mul-approximate", "gelu_and_mul", "approximate", lambda x: keel.gelu_and_mul(x(), None)),
    ("softmax-input", "softmax", "input", lambda x: keel.softmax([[1.0, 2.0]])),
    ("softmax-scale", "softmax", "scale", lambda x: keel.softmax(x(), "a")),
    # With class weights the typed API builds the weighted loss on the op: a target
    # that is no tensor raised AttributeError there ('NoneType' ... 'contiguous').
    ("cross_entropy-target-weighted", "cross_entropy", "target",
     lambda x: keel.cross_entropy(x(), None, weight=torch.ones(8))),
    ("cross_entropy-target-weighted-smoothed", "cross_entropy", "target",
     lambda x: keel.cross_entropy(x(), [0, 1, 2, 3], label_smoothing=0.1, weight=torch.ones(8))),
    ("cross_entropy-target", "cross_entropy", "target", lambda x: keel.cross_entropy(x(), [0, 1, 2, 3])),
    ("cross_entropy-reduction", "cross_entropy", "reduction", lambda x: keel.cross_entropy(x(), _TARGET, -100, 0.0, 3)),
    ("cross_entropy_with_lse-logits", "cross_entropy_with_lse", "logits",
     lambda x: keel.cross_entropy_with_lse(None, _TARGET)),
    ("rotary_embedding-cos", "rotary_embedding", "cos", lambda x: keel.rotary_embedding(x(True), [1.0], _COS)),
    ("rotary_embedding-interleaved", "rotary_embedding", "interleaved",
     lambda x: keel.rotary_embedding(x(True), _COS, _COS, "yes")),
    ("fused_add_rms_norm_-residual", "fused_add_rms_norm_", "residual",
     lambda x: keel.fused_add_rms_norm_(torch.randn(4, 8), [1])),
    ("fused_add_rms_norm_-eps", "fused_add_rms_norm_", "eps",
     lambda x: keel.fused_add_rms_norm_(torch.randn(4, 8), torch.randn(4, 8), None, "e")),
    ("rotary_embedding_-sin", "rotary_embedding_", "sin", lambda x: keel.rotary_embedding_(_q(False), _COS, [1.0])),
    ("nn.RMSNorm-input", "rms_norm", "input", lambda x: keel.nn.RMSNorm(8)([1.0] * 8)),
    ("nn.LayerNorm-input", "layer_norm", "input", lambda x: keel.nn.LayerNorm(8)(np.ones((2, 8)))),
    ("nn.CrossEntropyLoss-target", "cross_entropy", "target", lambda x: keel.nn.CrossEntropyLoss()(x(), [0, 1, 2, 3])),
]


@pytest.mark.parametrize("mode", ["no_grad", "grad", "requires_grad", "inference_mode"])
@pytest.mark.parametrize("name,op,arg,call", CASES, ids=[c[0] for c in CASES])
def test_wrong_type_names_op_and_argument(name, op, arg, call, mode):
    def make(four_dims=False):
        requires_grad = mode == "requires_grad" and not op.endswith("_")
        return _q(requires_grad) if four_dims else _x(requires_grad)

    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, contextlib.nullcontext)
    with ctx(), pytest.raises(RuntimeError) as e:
        call(make)
    message = str(e.value)
    assert message.startswith((f"keel::{op}:", f"keel::{op}()")), message
    assert f"'{arg}'" in message, message
    assert "_nograd" not in message, message


@pytest.mark.parametrize("target,arg", [
    (torch.zeros(4, dtype=torch.int32), "target"),
    (torch.tensor([0, 1, 2, 99]), "target"),
    (torch.zeros(3, dtype=torch.long), "target"),
], ids=["dtype", "out-of-range", "shape"])
def test_cross_entropy_names_itself_where_logits_require_grad(target, arg):
    """In grad mode keel.cross_entropy calls cross_entropy_with_lse (to keep the
    lse for its backward); its checks' errors named that op."""
    with pytest.raises(RuntimeError) as e:
        keel.cross_entropy(torch.randn(4, 8, requires_grad=True), target)
    assert str(e.value).startswith(f"keel::cross_entropy: argument '{arg}'"), str(e.value)


def _required_tensor_args():
    """(op, index, name) for every `Tensor` argument (not `Tensor?`) of every
    torch.ops.keel op."""
    out = []
    for name in dir(torch.ops.keel):
        try:
            schema = getattr(torch.ops.keel, name).default._schema
        except AttributeError:
            continue
        for i, a in enumerate(schema.arguments):
            if str(a.type) == "Tensor":
                out.append((name, i, a.name))
    return out


def _filler(a):
    """A value of argument `a`'s type (a tensor whatever its op wants: the call
    must stop at the None before looking at the others)."""
    t = str(a.type)
    if "Tensor" in t:
        return torch.randn(2, 4)
    return {"int": 0, "float": 1e-6, "bool": False, "str": "none", "int[]": [1], "ScalarType": torch.float32}[t]


@pytest.mark.parametrize("op,index,arg", _required_tensor_args(), ids=lambda v: str(v))
def test_none_for_a_tensor_names_op_and_argument(op, index, arg):
    """torch hands a kernel an undefined tensor where a `Tensor` argument is given
    None; every op refuses it naming itself and the argument (it said "keel: torch
    call aoti_torch_get_device_type failed: tensor does not have a device")."""
    overload = getattr(torch.ops.keel, op).default
    args = [_filler(a) for a in overload._schema.arguments]
    args[index] = None
    with pytest.raises(RuntimeError) as e:
        overload(*args)
    # A `_nograd` twin's errors name the op itself, as all of Keel's do.
    public = op.removeprefix("_").removesuffix("_nograd")
    if not any(isinstance(a, torch.Tensor) for a in args):
        # No tensor left to dispatch on: torch's dispatcher refuses the call itself
        # (NotImplementedError, a RuntimeError), naming the op (or its twin) that
        # it reached.
        assert "There were no tensor arguments" in str(e.value), str(e.value)
        assert public in str(e.value), str(e.value)
        return
    assert str(e.value).startswith(f"keel::{public}: argument '{arg}' is None"), str(e.value)
