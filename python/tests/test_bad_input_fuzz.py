"""Every ``torch.ops.keel`` op, and the typed API's function of each forward and
in-place op (``keel.rms_norm`` ...), called with random bad or odd arguments: a valid
call with one or two of its arguments spoiled (another dtype, a shape off by one
or empty, a 0-d tensor, None, the meta device beside the CPU, a layout that is
not contiguous, a broadcast view, NaN and infinities, scalars that are NaN,
infinite, negative or huge, unknown strings, one tensor passed twice).

Each call must end in one of two ways: a RuntimeError whose message names the op,
or a result that the op's definition (float64, torch's own ops) also gives on the
same arguments, within the dtype's tolerance (NaN where it has NaN). A third of
the typed calls have their float inputs need a gradient: their gradients (with
fixed cotangents) are held to the definition's by autograd the same way. A call that
succeeds where the definition refuses its arguments is a failure too: the input
was bad and the op did not say so. The calls run in a child process, one line
printed before each, so that a crash (an abort, a segfault) fails the test and
names the call that caused it. Seeded: a failure repeats.
"""
import math
import os
import random
import subprocess
import sys

import torch
import torch.nn.functional as F

import keel
from conftest import finite_max, rotary_ref

OPS = torch.ops.keel
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ODD_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64, *FLOATS]


# ---- the ops' definitions, in float64 -------------------------------------------------


# The dtype the definitions compute in: float64, or (the second reference) each
# input's accumulation dtype, as torch's own kernels compute.
_WORK = [torch.float64]


def _d(t):
    if t is None or not t.is_floating_point():
        return t
    return t.to(torch.float64 if _WORK[0] == torch.float64 or t.dtype == torch.float64 else torch.float32)


def _stored_sum(x, r):
    """``x + r`` as fused_add_rms_norm stores and then normalises it: the sum rounded
    once to the inputs' dtype (a float16 sum past 65504 is inf, as torch's ``x + r``),
    with the exact sum's gradient."""
    s = _d(x) + _d(r)
    exact = s.detach()
    rounded = exact.to(x.dtype).to(s.dtype)
    return s + torch.where(rounded == exact, 0.0, rounded - exact)


def _rms(x, w, eps):
    x = _d(x)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * _d(w)


def _ln(x, w, b, eps):
    return F.layer_norm(_d(x), x.shape[-1:], _d(w), _d(b), eps)


def _gate(x, approximate=None):
    a, b = _d(x).chunk(2, -1)
    if x.shape[-1] % 2:
        raise ValueError("odd width")
    return (F.silu(a) if approximate is None else F.gelu(a, approximate=approximate)) * b


def _rot(x, cos, sin, interleaved):
    x, c, s = _d(x), _d(cos), _d(sin)
    if x.dim() != 4 or c.dim() != 2 or c.shape != s.shape or c.shape[0] != x.shape[1] or 2 * c.shape[1] > x.shape[-1]:
        raise ValueError("rotary shapes")
    return rotary_ref(x, c, s, interleaved)


def _ce(logits, target, ignore_index, ls, reduction, weight):
    t = _d(target) if target.is_floating_point() else target
    # With class indices the weight detached: torch gives class weights no gradient
    # there (and refuses ones that need it); with probabilities it does.
    w = _d(weight)
    if w is not None and not target.is_floating_point():
        w = w.detach()
    return F.cross_entropy(_d(logits), t, weight=w, ignore_index=ignore_index, label_smoothing=ls, reduction=reduction)


def _vjp(fn, primals, cot):
    ps = [None if p is None else _d(p).requires_grad_() for p in primals]
    out = fn(*ps)
    grads = torch.autograd.grad(out, [p for p in ps if p is not None], _d(cot), allow_unused=True)
    it = iter(grads)
    return [None if p is None else next(it) for p in ps]


def _ce_bwd(grad, logits, target, ii, ls, red, lse, weight):
    return _vjp(lambda x: _ce(x, target, ii, ls, red, weight), [logits], grad)[0]


# Each op: its definition on the call's arguments (the outputs compared, in order);
# in-place ops give the tensors they write.
DEFS = {
    "rms_norm": lambda x, w, eps: [_rms(x, w, eps)],
    "layer_norm": lambda x, w, b, eps: [_ln(x, w, b, eps)],
    "fused_add_rms_norm": lambda x, r, w, eps: [_rms(_stored_sum(x, r), w, eps), _stored_sum(x, r)],
    "softmax": lambda x, scale: [torch.softmax(_d(x) * scale, -1)],
    "silu_and_mul": lambda x: [_gate(x)],
    "gelu_and_mul": lambda x, approximate: [_gate(x, approximate)],
    "rotary_embedding": lambda x, c, s, il: [_rot(x, c, s, il)],
    "cross_entropy": lambda *a: [_ce(*a)],
    "softmax_backward": lambda g, y, scale: [scale * _d(y) * (_d(g) - (_d(g) * _d(y)).sum(-1, keepdim=True))],
    "rms_norm_backward": lambda g, x, w, eps: _vjp(lambda x, w: _rms(x, w, eps), [x, w], g),
    "silu_and_mul_backward": lambda g, x: _vjp(_gate, [x], g),
    "rotary_embedding_backward": lambda g, c, s, il: [_rot(g, c, -_d(s), il)],
    "cross_entropy_backward": lambda *a: [_ce_bwd(*a)],
    "fused_add_rms_norm_": lambda x, r, w, eps: [_rms(_stored_sum(x, r), w, eps), _stored_sum(x, r)],
    "rotary_embedding_": lambda x, c, s, il: [_rot(x, c, s, il)],
}


# ---- valid calls ----------------------------------------------------------------------


def _t(g, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _valid(rng, g, name):
    dt = rng.choice(FLOATS)
    lead = [rng.choice([1, 2, 3]) for _ in range(rng.choice([1, 1, 2]))]
    n = rng.choice([1, 4, 7, 16, 33])
    x = _t(g, lead + [n], dt)
    if name in ("rms_norm", "rms_norm_backward"):
        args = [x, _t(g, [n], dt), 1e-6]
        return [_t(g, x.shape, dt), *args] if name.endswith("backward") else args
    if name == "layer_norm":
        return [x, _t(g, [n], dt), _t(g, [n], dt), 1e-5]
    if name in ("fused_add_rms_norm", "fused_add_rms_norm_"):
        return [x, _t(g, x.shape, dt), _t(g, [n], dt), 1e-6]
    if name == "softmax":
        return [x, rng.choice([1.0, 0.125])]
    if name == "softmax_backward":
        return [_t(g, x.shape, dt), torch.softmax(x.double(), -1).to(dt), 1.0]
    if name in ("silu_and_mul", "gelu_and_mul", "silu_and_mul_backward"):
        x = _t(g, lead + [2 * n], dt)
        if name == "gelu_and_mul":
            return [x, rng.choice(["none", "tanh"])]
        return [_t(g, lead + [n], dt), x] if name.endswith("backward") else [x]
    if name.startswith("rotary_embedding"):
        b, s, h, d = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([1, 2]), rng.choice([4, 8, 16])
        angles = torch.rand([s, d // 2], generator=g, dtype=torch.float64) * 6
        x = _t(g, [b, s, h, d], dt)
        return [x, angles.cos().to(dt), angles.sin().to(dt), rng.random() < 0.5]
    if name in ("cross_entropy", "cross_entropy_backward"):
        rows, v = rng.choice([1, 3, 5]), rng.choice([2, 7, 33])
        logits = _t(g, [rows, v], dt, 3.0)
        if rng.random() < 0.3:
            target = torch.softmax(_t(g, [rows, v], torch.float64), -1).to(dt)
        else:
            target = torch.randint(0, v, [rows], generator=g)
        red = rng.choice(["mean", "sum", "none"])
        weight = _t(g, [v], dt).abs() + 0.5 if rng.random() < 0.3 else None
        args = [logits, target, -100, rng.choice([0.0, 0.1]), red, weight]
        if name == "cross_entropy":
            return args
        return [_t(g, [rows] if red == "none" else [], dt), *args[:5], None, weight]
    raise AssertionError(name)


# ---- spoiling them ---------------------------------------------------------------------


def _same_values_other_layout(rng, t):
    """`t`'s values in a tensor laid out otherwise: permuted storage, a strided last
    dim, or a broadcast leading dim (where its rows agree, made so)."""
    kind = rng.choice(["permuted", "strided", "broadcast"])
    if kind == "strided" and t.dim() >= 1:
        wide = torch.zeros(list(t.shape[:-1]) + [2 * t.shape[-1]], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "broadcast" and t.dim() >= 2:
        return t[:1].expand(t.shape)
    if t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


def _spoil_tensor(rng, g, t):
    kind = rng.choice(
        ["dtype", "dtype", "layout", "layout", "last", "rank", "zero_d", "empty", "meta", "none", "nan", "big"]
    )
    if t is None:
        return kind, _t(g, [rng.choice([1, 3])], torch.float32)
    if t.device.type == "meta":
        return "kept", t
    if kind == "dtype":
        d = rng.choice(ODD_DTYPES)
        return kind, (t.real if t.is_complex() else t * 3).to(d)
    if kind == "layout":
        return kind, _same_values_other_layout(rng, t)
    if kind == "last" and t.dim() >= 1:
        shape = list(t.shape)
        shape[-1] = max(0, shape[-1] + rng.choice([-1, 1, 2]))
        return kind, _t(g, shape, t.dtype) if t.is_floating_point() else torch.zeros(shape, dtype=t.dtype)
    if kind == "rank":
        return kind, t.unsqueeze(0) if rng.random() < 0.5 or t.dim() == 0 else t.flatten()
    if kind == "zero_d":
        return kind, torch.tensor(1.5, dtype=t.dtype) if t.is_floating_point() else torch.tensor(1, dtype=t.dtype)
    if kind == "empty" and t.dim() >= 1:
        shape = list(t.shape)
        shape[rng.randrange(t.dim())] = 0
        return kind, torch.empty(shape, dtype=t.dtype)
    if kind == "meta":
        return kind, t.to("meta")
    if kind == "none":
        return kind, None
    if kind == "nan" and t.is_floating_point() and t.numel():
        t = t.clone(memory_format=torch.contiguous_format)
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([math.nan, math.inf, -math.inf])
        return kind, t
    if kind == "big" and t.is_floating_point():
        return kind, t * rng.choice([1e30, 1e-30, 6e4])
    return "kept", t


def _spoil_scalar(rng, v):
    if isinstance(v, bool):
        return rng.choice([not v, 2, 0.5, "yes"])
    if isinstance(v, int):
        return rng.choice([-1, 0, 2**40, -(2**62), 10**6, 1.5])
    if isinstance(v, float):
        return rng.choice([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e30, -1e-30, 3])
    if isinstance(v, str):
        return rng.choice(["", "bogus", "MEAN", "tanh", "sum", "none", "mean", "exact"])
    return v


def _spoil(rng, g, args):
    args = list(args)
    what = []
    for _ in range(rng.choice([1, 1, 2])):
        i = rng.randrange(len(args))
        if isinstance(args[i], torch.Tensor) or args[i] is None:
            kind, args[i] = _spoil_tensor(rng, g, args[i])
        else:
            kind, args[i] = "scalar", _spoil_scalar(rng, args[i])
        what.append(f"arg {i}: {kind}")
    if rng.random() < 0.08:
        tensors = [j for j, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if len(tensors) >= 2:
            a, b = rng.sample(tensors, 2)
            args[b] = args[a]
            what.append(f"arg {b} is arg {a}")
    return args, what


# ---- one call, judged ------------------------------------------------------------------


# The norms, whose rows of values past about 1e19 overflow float32's sum of squares.
_OVERFLOWING = {"rms_norm", "layer_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "rms_norm_backward"}


def _describe(a):
    if isinstance(a, torch.Tensor):
        return f"Tensor{list(a.shape)}:{str(a.dtype)[6:]}:{a.device.type}:{a.stride()}"
    return repr(a)


def _base(name):
    for suffix in ("_backward", "_"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _typed(name):
    """The typed API's function of op `name` (`keel.cross_entropy` takes the weight
    as a keyword)."""
    f = getattr(keel, name)
    if name == "cross_entropy":
        return lambda *a: f(*a[:5], weight=a[5]) if len(a) > 5 else f(*a)
    return f


def _dup(args):
    """Copies of `args`' tensors with their layouts (strides, broadcast dims) and
    aliasing (one tensor passed twice stays one); meta tensors as they are."""
    memo = {}

    def one(t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        if id(t) not in memo:
            if 0 in t.stride():
                row = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]
                memo[id(t)] = row.clone().expand(t.shape)
            else:
                memo[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)
        return memo[id(t)]

    return [one(a) for a in args]


def _judge(name, args, typed=False):
    """None where the call (through `torch.ops.keel`, or the typed API) ended well,
    else what went wrong."""
    op = _typed(name) if typed else getattr(OPS, name)
    inplace = name.endswith("_")
    keep = [a.clone() if isinstance(a, torch.Tensor) and a.device.type != "meta" else a for a in args]
    try:
        got = op(*args)
    except RuntimeError as e:
        msg = str(e)
        if _base(name) not in msg:
            return f"RuntimeError not naming {name}: {msg[:300]}"
        if "panicked" in msg:
            return f"a Rust panic, not a checked error: {msg[:300]}"
        return None
    except Exception as e:  # noqa: BLE001 (any other type is the finding)
        return f"{type(e).__name__}, not a RuntimeError: {str(e)[:300]}"
    if inplace:
        # What it wrote: fused_add_rms_norm_'s input then residual; rotary's x.
        got = [args[0], args[1]] if name == "fused_add_rms_norm_" else [args[0]]
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
        return None  # shapes only: the meta kernels' own tests hold them to the CPU's
    if name in _OVERFLOWING and any(
        isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel() and finite_max(a) > 1e18 for a in keep
    ):
        # Rows whose sum of squares overflows float32: documented (README, "Numerics
        # at the edges"), as torch's own.
        return None
    if name == "cross_entropy_backward" and args[6] is not None:
        # An lse is the forward's, trusted as softmax_backward trusts its output:
        # the backward's values follow from it, not from the logits.
        return None
    try:
        wants = [_definition(name, keep, torch.float64)]
    except Exception as e:  # noqa: BLE001
        return f"accepted, where the definition refuses: {type(e).__name__}: {str(e)[:200]}"
    try:
        wants.append(_definition(name, keep, torch.float32))
    except Exception:  # noqa: BLE001 (mixed float64 and float32 arguments torch does not mix)
        wants.append(wants[0])
    # Within the tolerance of the float64 definition plus twice the error of the
    # same computed as torch computes it (float32 for 16-bit and float32 inputs):
    # where the definition cancels (a norm's gradient over one value near eps),
    # Keel may be as far off as torch's own arithmetic, but not much further; or
    # within the tolerance of that float32 definition itself (where a float32 sum
    # overflows, Keel does what torch does).
    slack = [max(a, b) for a, b in zip(_spread(wants), _cancelling_floor(name, keep, len(got)))]
    verdicts = [_compare(keep, got, wants[0], slack), _compare(keep, got, wants[1], [0.0] * len(got))]
    if None in verdicts:
        return _judge_gradients(name, args, got) if typed else None
    return verdicts[0]


def _cancelling_floor(name, keep, outputs):
    """Per output, what float32 can lose where rms_norm's input gradient cancels:
    ``rstd (g - x rstd^2 mean(g x))`` subtracts terms of ``rstd max|g|`` a row (g =
    dy w), and a value near 0 keeps their rounding, not its own (one value a row,
    far above eps: Keel 0.0144 off and torch 0.0065 of terms of 8e4). 16 roundings
    of the largest row's terms (as tests/common's grad_floor); float64's for float64.
    The float32 definition's own gap (`_spread`) is a sample of one ordering of the
    arithmetic, not a bound."""
    floor = [0.0] * outputs
    if name != "rms_norm_backward" or not keep[1].numel():
        return floor
    dy, x, w, eps = keep
    g = dy.detach().double() * (w.detach().double() if w is not None else 1.0)
    rstd = torch.rsqrt(x.detach().double().pow(2).mean(-1, keepdim=True) + eps)
    terms = (rstd * g.abs().amax(-1, keepdim=True)).flatten()
    terms = terms[terms.isfinite()]
    unit = 2.0**-53 if torch.float64 in (dy.dtype, x.dtype) else 2.0**-24
    floor[0] = 16 * unit * float(terms.max()) if terms.numel() else 0.0
    return floor


def _judge_gradients(name, args, got):
    """Where a typed call's inputs need a gradient: the gradients of its outputs,
    with cotangents of cosines, against the definition's (float64, and float32 for
    the spread), judged as values are. None where they agree."""
    leaves = list({id(a): a for a in args if isinstance(a, torch.Tensor) and a.requires_grad}.values())
    if name == "cross_entropy" and args[5] is not None and args[5] is args[0] and not args[1].is_floating_point():
        return None  # the logits as the weights: the definition (torch) has no weight gradient there
    outs = [(k, y) for k, y in enumerate(got) if isinstance(y, torch.Tensor) and y.requires_grad]
    if not leaves or not outs:
        return None
    cots = [torch.cos(torch.arange(y.numel(), dtype=torch.float64)).reshape(y.shape).to(y.dtype) for _, y in outs]
    grads = torch.autograd.grad([y for _, y in outs], leaves, cots, allow_unused=True)
    refs = []
    for work in (torch.float64, torch.float32):
        twins = {id(a): a.detach().to(work if a.dtype != torch.float64 else a.dtype).requires_grad_() for a in leaves}
        ref_args = [twins.get(id(a), a.detach() if isinstance(a, torch.Tensor) else a) for a in args]
        try:
            want = _definition(name, ref_args, work)
            ref_outs = [want[k] for k, _ in outs]
            ref = torch.autograd.grad(ref_outs, [twins[id(a)] for a in leaves], [c.to(o.dtype) for c, o in zip(cots, ref_outs)], allow_unused=True)
        except Exception:  # noqa: BLE001 (the float32 definition may refuse mixed dtypes)
            ref = refs[0] if refs else None
        if ref is None:
            return None  # the definition has no gradient here: nothing to hold Keel's to
        refs.append(ref)
    keep = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    for i, (g, leaf) in enumerate(zip(grads, leaves)):
        r64, r32 = refs[0][i], refs[1][i]
        if r64 is None:
            continue  # cross_entropy's class weights: the definition detaches them
        g = torch.zeros_like(leaf) if g is None else g
        r32 = r64 if r32 is None else r32
        verdict = _compare(keep, [g], [r64], _spread([[r64], [r32]]))
        # Or as torch computes it, as for values (a float32 sum that overflows or
        # underflows: values past 1e19 or, with eps 0, under 1e-19).
        if verdict is not None and _compare(keep, [g], [r32], [0.0]) is not None:
            return f"gradient of input {i}: {verdict}"
    return None


def _spread(wants):
    """Twice the largest gap between the two definitions, per output, where both are finite."""
    out = []
    for a, b in zip(*wants):
        if a is None or b is None or a.shape != b.shape or not a.numel():
            out.append(0.0)
            continue
        a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
        both = a.isfinite() & b.isfinite()
        out.append(2 * float((a[both] - b[both]).abs().max()) if both.any() else 0.0)
    return out


def _definition(name, args, work):
    _WORK[0] = work
    try:
        return DEFS[name](*args)
    finally:
        _WORK[0] = torch.float64


def _compare(keep, got, want, slack):
    for k, (y, w) in enumerate(zip(got, want)):
        if w is None:
            continue
        if y.shape != w.shape:
            return f"output {k}: shape {list(y.shape)}, the definition's {list(w.shape)}"
        if not y.numel():
            continue
        yd = y.detach().to(torch.float64)
        # The definition rounded as the output is (a float64 value past bf16's
        # range is inf there, as in torch).
        w = w.detach().to(y.dtype).to(torch.float64) if y.is_floating_point() else w.detach().to(torch.float64)
        # Not a number where the definition is NaN (an infinity may stand there: an
        # infinite gradient's terms, which the definition's sums make NaN); where it
        # overflows, its infinity or NaN (an infinite gradient times a probability
        # of 0); finite and close where it is finite.
        fin, inf = w.isfinite(), w.isinf()
        if yd[w.isnan()].isfinite().any():
            return f"output {k}: a number where the definition is NaN"
        if not ((yd[inf] == w[inf]) | yd[inf].isnan()).all():
            return f"output {k}: a number or the other infinity where the definition is infinite"
        if not yd[fin].isfinite().all():
            return f"output {k}: NaN or infinite where the definition is finite"
        dts = [a.dtype for a in keep if isinstance(a, torch.Tensor) and a.is_floating_point()]
        tol = max(TOL.get(d, 1e-10) for d in dts + [y.dtype])
        scale = float(w[fin].abs().max()) if fin.any() else 0.0
        err = float((yd[fin] - w[fin]).abs().max()) if fin.any() else 0.0
        if err > tol * max(scale, 1.0) * 4 + slack[k]:
            return f"output {k}: off by {err:.3g} (scale {scale:.3g}, tolerance {tol:.1g})"
    return None


def fuzz(seed, calls):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    bad = []
    for i in range(calls):
        name = rng.choice(sorted(DEFS))
        args, what = _spoil(rng, g, _valid(rng, g, name))
        line = f"seed {seed} call {i}: {name}({', '.join(map(_describe, args))}) [{'; '.join(what)}]"
        print(line, flush=True)
        # The typed API (the forwards and in-place ops) on copies first: the in-place
        # ops write their arguments.
        if not name.endswith("_backward"):
            dup = _dup(args)
            if rng.random() < 0.3:
                # In grad mode with inputs that need a gradient: the formula's path
                # (the in-place ops refuse such inputs, naming themselves).
                for t in dup:
                    if isinstance(t, torch.Tensor) and t.is_leaf and t.dtype.is_floating_point and t.device.type == "cpu":
                        t.requires_grad_()
            verdict = _judge(name, dup, typed=True)
            if verdict is not None:
                bad.append(f"{line} (typed API)\n    {verdict}")
        verdict = _judge(name, args)
        if verdict is not None:
            bad.append(f"{line}\n    {verdict}")
    return bad


def test_bad_arguments_give_named_errors_or_the_definitions_values():
    seeds, calls = range(16), 400
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import keel, test_bad_input_fuzz as f\n"
    code += f"bad = [b for s in {list(seeds)} for b in f.fuzz(s, {calls})]\nprint('\\n'.join(['FOUND'] + bad))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    tail = "\n".join(run.stdout.splitlines()[-3:])
    assert run.returncode == 0, f"the child died ({run.returncode}) at:\n{tail}\n{run.stderr[-2000:]}"
    found = run.stdout.split("FOUND\n", 1)[1].strip() if "FOUND\n" in run.stdout else run.stdout
    assert not found, found[:6000]
