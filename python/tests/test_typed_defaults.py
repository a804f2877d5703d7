"""The typed API leaves out trailing scalar arguments equal to the schema's
defaults (``functional._call``): torch's parser costs 0.4-0.7 us for each one
passed. Same values in every path, and the defaults are the schema's."""
import inspect

import pytest
import torch

import keel
from keel import functional as F

ops = torch.ops.keel

# Each typed function's scalar arguments, with a value other than the default
# that changes the result on `_inputs`.
_SCALARS = {
    "rms_norm": {"eps": 1e-3},
    "layer_norm": {"eps": 1e-3},
    "fused_add_rms_norm": {"eps": 1e-3},
    "fused_add_rms_norm_": {"eps": 1e-3},
    "gelu_and_mul": {"approximate": "tanh"},
    "softmax": {"scale": 0.5},
    "cross_entropy": {"ignore_index": 3, "label_smoothing": 0.1, "reduction": "sum"},
    "cross_entropy_with_lse": {"ignore_index": 3, "label_smoothing": 0.1, "reduction": "sum"},
    "rotary_embedding": {"interleaved": True},
    "rotary_embedding_": {"interleaved": True},
}


def _defaults(name):
    """`name`'s scalar arguments and their defaults, from the typed function's
    signature."""
    sig = inspect.signature(getattr(F, name)).parameters
    return {arg: sig[arg].default for arg in _SCALARS[name]}


@pytest.mark.parametrize("name", sorted(_SCALARS))
def test_the_typed_defaults_are_the_schemas(name):
    # Exactly the schema's (value and type): a call that leaves one out means
    # what the caller wrote.
    schema = {a.name: a for a in getattr(ops, name).default._schema.arguments}
    for arg, default in _defaults(name).items():
        assert schema[arg].has_default_value(), (name, arg)
        want = schema[arg].default_value
        assert type(default) is type(want) and default == want, (name, arg, default, want)


def _inputs(name, requires_grad):
    """The tensor arguments of `name` (small values, so that eps shows), fresh."""
    torch.manual_seed(0)
    g = requires_grad and not name.endswith("_")

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, dtype=torch.float64) * scale).requires_grad_(g)

    if name in ("rms_norm", "layer_norm"):
        return (t(4, 8, scale=1e-3), t(8)) + ((t(8),) if name == "layer_norm" else ())
    if name.startswith("fused_add_rms_norm"):
        return t(4, 8, scale=1e-3), t(4, 8, scale=1e-3), t(8)
    if name == "gelu_and_mul":
        return (t(4, 16),)
    if name == "softmax":
        return (t(4, 8),)
    if name.startswith("cross_entropy"):
        return t(4, 8), torch.tensor([0, 3, 1, 5])
    return t(1, 4, 2, 8), t(4, 4), t(4, 4)


def _tensors(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
@pytest.mark.parametrize("name", sorted(_SCALARS))
def test_left_out_defaults_give_the_values_of_the_op_called_with_all(name, mode):
    """The typed function with its scalars left out, given as the defaults, and
    each set to another value, against ``torch.ops.keel`` given every argument:
    the same bits, and in grad mode the same gradients (the formula's ``apply``
    fills in what was left out), within float64 rounding."""
    cm = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    defaults = _defaults(name)
    calls = [{}, dict(defaults)] + [{**defaults, arg: v} for arg, v in _SCALARS[name].items()]
    inplace = name.endswith("_")
    written = 2 if name.startswith("fused") else 1  # the in-place ops' written arguments
    for kw in calls:
        with cm():
            got_in, want_in = _inputs(name, mode == "grad"), _inputs(name, mode == "grad")
            got = getattr(F, name)(*got_in, **kw)
            want = getattr(ops, name)(*want_in, *{**defaults, **kw}.values())
            if inplace:
                got, want = got_in[:written], want_in[:written]
            for a, b in zip(_tensors(got), _tensors(want)):
                assert torch.equal(a, b), (name, mode, kw)
        if mode == "grad" and not inplace:
            leaves = [t for t in got_in if t.requires_grad]
            ga = torch.autograd.grad(sum(o.sum() for o in _tensors(got)), leaves)
            gb = torch.autograd.grad(sum(o.sum() for o in _tensors(want)), [t for t in want_in if t.requires_grad])
            # cross_entropy's typed form takes cross_entropy_with_lse's formula,
            # whose backward reads the saved log-sum-exp: float64 rounding apart.
            for a, b in zip(ga, gb):
                torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15, msg=f"{name} grad {kw}")


class _Recorder:
    """A C function standing in for one of `functional`'s, recording how many
    arguments each call passed."""

    def __init__(self, f):
        self.f, self.counts = f, []

    def __call__(self, *args):
        self.counts.append(len(args))
        return self.f(*args)


@pytest.mark.parametrize("mode", ["no_grad", "inference"])
def test_defaults_are_left_out_of_the_call(monkeypatch, mode):
    """What reaches the op's C function: trailing scalars equal to their
    defaults (of exactly the default's type; `1` for a float is passed) are
    not passed; the others are."""
    recorders = {}
    for attr in ("_SOFTMAX", "_CROSS_ENTROPY", "_GELU_AND_MUL", "_LAYER_NORM"):
        ops_ = getattr(F, attr)
        recorders[attr] = _Recorder(ops_[3])
        monkeypatch.setattr(F, attr, (*ops_[:3], recorders[attr], *ops_[4:]))
    ops_ = F._ROTARY_EMBEDDING_
    recorders["_ROTARY_EMBEDDING_"] = _Recorder(ops_[1])
    monkeypatch.setattr(F, "_ROTARY_EMBEDDING_", (ops_[0], recorders["_ROTARY_EMBEDDING_"]))
    x, lg, t = torch.randn(4, 8), torch.randn(4, 8), torch.tensor([0, 3, 1, 5])
    q, cos, sin = torch.randn(1, 4, 2, 8), torch.randn(4, 4), torch.randn(4, 4)
    cm = {"no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    with cm():
        for scale in (None, 1.0, 0.5, 1):
            F.softmax(x) if scale is None else F.softmax(x, scale)
        for kw in ({}, {"ignore_index": -100}, {"label_smoothing": 0.1}, {"reduction": "sum"}, {"ignore_index": 2}):
            F.cross_entropy(lg, t, **kw)
        F.gelu_and_mul(x, "none"), F.gelu_and_mul(x, "tanh")
        F.layer_norm(x, None, None, 1e-5), F.layer_norm(x, None, None, 1e-4)
        F.rotary_embedding_(q, cos, sin), F.rotary_embedding_(q, cos, sin, True)
    counts = {k: r.counts for k, r in recorders.items()}
    assert counts == {
        "_SOFTMAX": [1, 1, 2, 2],
        "_CROSS_ENTROPY": [2, 2, 4, 5, 3],
        "_GELU_AND_MUL": [1, 2],
        "_LAYER_NORM": [3, 4],
        "_ROTARY_EMBEDDING_": [3, 4],
    }, counts


def test_defaults_are_left_out_of_the_formulas_apply(monkeypatch):
    """In grad mode, with an argument requiring grad: the formula's ``apply``
    (which fills them in for its backward) gets the short form too, and the
    gradient is the one through ``torch.ops.keel`` given every argument."""
    ops_ = F._CROSS_ENTROPY_WITH_LSE
    recorder = _Recorder(ops_[2])
    monkeypatch.setattr(F, "_CROSS_ENTROPY_WITH_LSE", (*ops_[:2], recorder, *ops_[3:]))
    t = torch.tensor([0, 3, 1, 5])
    for kw in ({}, {"label_smoothing": 0.1}):
        lg = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        (got,) = torch.autograd.grad(F.cross_entropy(lg, t, **kw), lg)
        (want,) = torch.autograd.grad(ops.cross_entropy(lg, t, -100, kw.get("label_smoothing", 0.0), "mean"), lg)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    assert recorder.counts == [2, 4], recorder.counts
