"""The norms, gates, softmax and rotary embedding on random inputs, against their
definitions in float64, seeded so that a failure repeats.

The grid tests (test_rms_norm.py, test_softmax.py, ...) take one form at a time.
Here they come together at random: every dtype, any rank, any layout (dims
permuted in memory, a strided last dim, a broadcast leading dim), values far from
0 or tiny, offsets that a one-pass variance would lose, rows of zeros, ``-inf``
entries in softmax rows, every option (eps, scale, approximate, interleaved,
partial rotary dims), and a gradient asked of any differentiable input, with a
random cotangent; then second derivatives (double backward) and forward-mode
products (dual tensors, ``torch.func.jvp``) on more such calls. The in-place forms
must give the out-of-place bits, and leave the rest of their storage alone.

Each result is held against the op's definition run in float64 by torch's
autograd, within a few units in the last place of the dtype relative to the
result's size, plus twice the error of that same definition computed by torch in
the accumulation dtype (float32 for 16-bit inputs) and rounded: where an input is
ill-conditioned (a variance far below its mean's square), Keel may be as far off
as torch's own arithmetic, but no further.
"""
import math
import random

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import keel
from conftest import devices, dtypes_for, finite_max, rotary_ref

# A few units in the last place of a dtype, relative to the result's scale.
TOL = {torch.float64: 1e-12, torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _layout(rng, g, shape, dtype, device, scale, offset=0.0):
    """A tensor of `shape` whose memory is laid out at random: dims permuted, the last
    strided (every other element of a wider tensor), or a leading dim broadcast."""
    shape = list(shape)
    kind = rng.choice(["contiguous", "contiguous", "permuted", "strided", "broadcast"])
    if kind == "broadcast" and len(shape) > 1 and shape[0] > 1:
        row = torch.randn([1] + shape[1:], generator=g, dtype=torch.float64) * scale + offset
        return row.to(dtype).to(device).expand(shape)
    if kind == "strided" and shape:
        wide = torch.randn(shape[:-1] + [2 * shape[-1]], generator=g, dtype=torch.float64) * scale + offset
        return wide.to(dtype).to(device)[..., ::2]
    if kind == "permuted" and len(shape) > 1:
        order = list(range(len(shape)))
        rng.shuffle(order)
        stored = torch.randn([shape[d] for d in order], generator=g, dtype=torch.float64) * scale + offset
        return stored.to(dtype).to(device).permute([order.index(d) for d in range(len(shape))])
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype).to(device)


def _norm_terms(x, w, eps, centred):
    """Gradient term sizes of a norm over x's last dim: ``rstd max|w|`` in x, ``rows
    max|x_hat|`` in the weight and ``rows`` in the bias."""
    x = x.detach().double().cpu()
    xc = x - x.mean(-1, keepdim=True) if centred else x
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    rows = x.numel() // max(x.shape[-1], 1)
    wmax = 1.0 if w is None else finite_max(w)
    return finite_max(rstd) * wmax, rows * finite_max(xc * rstd), float(rows)


def _rows(rng):
    return [rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(rng.choice([0, 1, 1, 2, 3]))]


def _width(rng, even=False):
    n = rng.choice([1, 2, 3, 7, 8, 16, 33, 64, 130, 257, 1000])
    return 2 * n if even else n


def _zero_rows(rng, x):
    """x with a random row set to zeros in a fifth of the cases (rms 0 with eps 0: NaN in torch)."""
    if x.dim() < 2 or x.shape[0] == 0 or rng.random() > 0.2:
        return x
    x = x.clone()
    x[rng.randrange(x.shape[0])] = 0
    return x


def _round_to(s, dtype):
    """s, rounded to dtype as Keel stores it, with the gradient passing straight through."""
    return s + (s.to(dtype).to(s.dtype) - s).detach()


class Case:
    """An op's call: `keel(*args)`, the definition `ref(*args)` for any dtype, which of
    the args are differentiable, and a description for failures."""

    def __init__(self, name, keel_fn, ref, args, grads, opts, inplace=None, terms=None):
        self.name, self.keel, self.ref, self.args, self.grads, self.opts = name, keel_fn, ref, args, grads, opts
        self.inplace = inplace
        # The size of the terms each input's gradient is a sum or difference of, per unit
        # of the cotangent: a gradient that cancels to about 0 (layer_norm's over two
        # elements) is held to the rounding of its terms, not of itself.
        self.terms = terms or (lambda: [0.0] * len(args))
        # An absolute error the op documents, per unit of the cotangent in a gradient.
        self.slack = 0.0
        # The size of the terms of a second derivative, per unit of the cotangent and v.
        self.terms2 = 0.0

    def __str__(self):
        shapes = ", ".join(f"{a.dtype} {tuple(a.shape)} stride {a.stride()}" for a in self.args if a is not None)
        return f"{self.name}({shapes}; {self.opts}), grads {self.grads}"


def _rms_norm(rng, g, dtype, device):
    n = _width(rng)
    x = _zero_rows(rng, _layout(rng, g, _rows(rng) + [n], dtype, device, rng.choice([1e-3, 1.0, 1.0, 30.0])))
    w = _layout(rng, g, [n], dtype, device, 1.0, 1.0) if rng.random() < 0.7 else None
    eps = rng.choice([1e-6, 1e-5, 0.0, 0.1])

    def ref(x, w):
        return F.rms_norm(x, (n,), w, eps)

    terms = _norm_terms(x, w, eps, False)
    return Case("rms_norm", lambda x, w: keel.rms_norm(x, w, eps), ref, [x, w], [True, True], {"eps": eps}, terms=lambda: terms[:2])


def _layer_norm(rng, g, dtype, device):
    n = _width(rng)
    offset = rng.choice([0.0, 0.0, 30.0, -1000.0])
    x = _zero_rows(rng, _layout(rng, g, _rows(rng) + [n], dtype, device, rng.choice([1e-2, 1.0, 1.0, 30.0]), offset))
    w = _layout(rng, g, [n], dtype, device, 1.0, 1.0) if rng.random() < 0.7 else None
    b = _layout(rng, g, [n], dtype, device, 1.0) if rng.random() < 0.6 else None
    eps = rng.choice([1e-5, 1e-6, 0.0, 0.1])

    def ref(x, w, b):
        # Centred twice: torch's own float64 layer_norm loses digits on rows far from 0
        # (1.5e-10 of the result at an offset of 1000, three elements), Keel's does not.
        xc = x - x.mean(-1, keepdim=True)
        xc = xc - xc.mean(-1, keepdim=True)
        y = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
        y = y if w is None else y * w
        return y if b is None else y + b

    terms = _norm_terms(x, w, eps, True)
    opts = {"eps": eps, "offset": offset}
    return Case("layer_norm", lambda x, w, b: keel.layer_norm(x, w, b, eps), ref, [x, w, b], [True] * 3, opts, terms=lambda: terms)


def _fused_add_rms_norm(rng, g, dtype, device):
    n = _width(rng)
    shape = _rows(rng) + [n]
    scale = rng.choice([1e-3, 1.0, 1.0, 30.0])
    x = _layout(rng, g, shape, dtype, device, scale)
    r = _layout(rng, g, shape, dtype, device, scale)
    if rng.random() < 0.15:
        r = -x  # s = 0 exactly: rms 0
    w = _layout(rng, g, [n], dtype, device, 1.0, 1.0) if rng.random() < 0.7 else None
    eps = rng.choice([1e-6, 1e-5, 0.0, 0.1])

    def ref(x, r, w):
        s = _round_to(x + r, dtype)
        return F.rms_norm(s, (n,), w, eps), s

    def inplace(x, r, w):
        keel.fused_add_rms_norm_(x, r, w, eps)
        return x, r

    t = _norm_terms((x.double() + r.double()).to(dtype), w, eps, False)
    # x and r reach the output through s and through the sum output (cotangent 1 each).
    terms = [t[0] + 1, t[0] + 1, t[1]]
    return Case(
        "fused_add_rms_norm",
        lambda x, r, w: keel.fused_add_rms_norm(x, r, w, eps),
        ref,
        [x, r, w],
        [True] * 3,
        {"eps": eps},
        inplace,
        lambda: terms,
    )


def _softmax(rng, g, dtype, device):
    n = _width(rng)
    x = _layout(rng, g, _rows(rng) + [n], dtype, device, rng.choice([1e-3, 1.0, 1.0, 10.0, 100.0]), rng.choice([0.0, 0.0, 50.0]))
    if rng.random() < 0.3 and x.numel():
        x = x.masked_fill(torch.rand(x.shape, generator=g).to(device) < rng.choice([0.3, 1.0]), float("-inf"))
    scale = rng.choice([1.0, 1.0, 0.125, 2.0, 0.0])

    def ref(x):
        return torch.softmax(x * scale, -1)

    case = Case("softmax", lambda x: keel.softmax(x, scale), ref, [x], [True], {"scale": scale}, terms=lambda: [abs(scale)])
    case.terms2 = 3 * scale**2  # products of three probabilities, summed to at most 1
    return case


def _gated(rng, g, dtype, device):
    d2 = _width(rng, even=True)
    x = _layout(rng, g, _rows(rng) + [d2], dtype, device, rng.choice([1e-3, 1.0, 1.0, 5.0, 100.0]))
    kind = rng.choice(["silu", "none", "tanh"])
    half = d2 // 2

    def ref(x):
        a = x[..., :half]
        if kind == "tanh":
            # a sigmoid(2z) = a (1 + tanh z) / 2: torch's float64 F.gelu adds 1 to tanh z
            # and loses the digits of a result near 0 (6e-5 of it at a = -6.9), Keel does not.
            gate = a * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))
        else:
            # torch's definition, 1 + erf: Keel's too (its float64 loses the same digits of
            # results near 0 for a below -5, where erfc would keep them).
            gate = F.silu(a) if kind == "silu" else F.gelu(a)
        return gate * x[..., half:]

    if kind == "silu":
        case = Case("silu_and_mul", keel.silu_and_mul, ref, [x], [True], {})
        case.terms2 = 2 * (1 + finite_max(x))  # act' (at most 1.1) and act'' b (at most 0.5 |b|)
        return case
    case = Case("gelu_and_mul", lambda x: keel.gelu_and_mul(x, kind), ref, [x], [True], {"approximate": kind})
    case.terms2 = 2 * (1 + finite_max(x))
    if kind == "none" and dtype != torch.float64:
        # The float32 erf is within 5e-7 absolute (kernels-cpu/src/math.rs), so gelu(a) b
        # within 2.5e-7 |a b| and its gradients alike: all of a result near 0 at a < -4.
        case.slack = 1e-6 * finite_max(x[..., :half]) * max(finite_max(x[..., half:]), 1.0)
    return case


def _rotary(rng, g, dtype, device):
    b, s, h = rng.choice([0, 1, 2]), rng.choice([1, 3, 7]), rng.choice([1, 2, 5])
    d = _width(rng, even=True) if rng.random() < 0.3 else rng.choice([2, 4, 8, 64, 128])
    half = rng.choice([d // 2, d // 2, max(1, d // 4)])
    x = _layout(rng, g, [b, s, h, d], dtype, device, rng.choice([1.0, 1.0, 30.0]))
    angles = torch.rand([s, half], generator=g, dtype=torch.float64) * rng.choice([6.3, 1000.0])
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    interleaved = rng.random() < 0.5

    def ref(x, cos, sin):
        return rotary_ref(x, cos, sin, interleaved)

    def inplace(x, cos, sin):
        keel.rotary_embedding_(x, cos, sin, interleaved)
        return x

    return Case(
        "rotary_embedding",
        lambda x, cos, sin: keel.rotary_embedding(x, cos, sin, interleaved),
        ref,
        [x, cos, sin],
        [True, rng.random() < 0.3, rng.random() < 0.3],
        {"interleaved": interleaved, "rotary_dim": 2 * half},
        inplace,
        lambda: [1.0, b * h * finite_max(x), b * h * finite_max(x)],
    )


KINDS = [_rms_norm, _layer_norm, _fused_add_rms_norm, _softmax, _gated, _rotary]


def _outs(y):
    return list(y) if isinstance(y, (tuple, list)) else [y]


def _spread(got, leaves):
    """`got`, the gradients of the leaves that require one, as a list over all `leaves`."""
    it = iter(got)
    return [next(it) if a is not None and a.requires_grad else None for a in leaves]


def _grads(outs, leaves, cots, vs=None):
    """The gradients of `outs` against the cotangents `cots` in each leaf that requires
    one (None in the others) and, given `vs` (one per leaf), the gradients of
    ``sum(first gradient * v)``: second derivatives, through the first's graph."""
    none = [None] * len(leaves)
    needs = [a for a in leaves if a is not None and a.requires_grad]
    pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if not needs or not pairs or not any(o.numel() for o in outs):
        return none, none
    outs_used, cots_used = zip(*pairs)
    first = _spread(torch.autograd.grad(outs_used, needs, cots_used, allow_unused=True, create_graph=vs is not None), leaves)
    if vs is None:
        return first, none
    terms = [(f * v).sum() for f, v in zip(first, vs) if f is not None and f.requires_grad]
    if not terms:
        return first, none
    return first, _spread(torch.autograd.grad(sum(terms), needs, allow_unused=True), leaves)


def _ref_run(case, dtype, grads, cots, vs=None):
    """The definition's outputs, gradients and (given `vs`) second derivatives, computed
    by torch in `dtype` (from the inputs as Keel sees them), on the CPU."""
    leaves = [None if a is None else a.detach().cpu().to(dtype).requires_grad_(r) for a, r in zip(case.args, grads)]
    outs = _outs(case.ref(*leaves))
    first, second = _grads(outs, leaves, [c.cpu().to(dtype) for c in cots], vs and [None if v is None else v.cpu().to(dtype) for v in vs])
    return [o.detach() for o in outs], first, second


def _close(where, got, want, nears, tol, floor=0.0, slack=0.0):
    """|got - want| within tol times want's size, plus twice the largest |near - want| of
    `nears` (torch's own arithmetic, rounded to got's dtype); NaN and infinities where
    `want` rounded to that dtype has them. `floor`: a least size (of the terms that
    cancelled); `slack`: an error the op documents, in absolute terms."""
    dtype = got.dtype
    # The definition rounded to the dtype: a float16 result past 65504 is inf (and one
    # within the tolerance of that edge may be inf, or the largest finite value).
    exact = want.double()
    got, want = got.double().cpu(), want.to(dtype).double()
    assert got.shape == want.shape, where
    edge = exact.abs() >= torch.finfo(dtype).max * (1 - 2 * tol)
    got = torch.where(edge & got.isinf() & want.isfinite(), want, got)
    want = torch.where(edge & want.isinf() & got.isfinite(), got, want)
    same = (got.isnan() == want.isnan()).all() and (got.isinf() == want.isinf()).all()
    assert same, f"{where}: NaN or inf where the definition has none, or none where it has\n{got}\n{want}"
    finite = want.isfinite()
    if not finite.any():
        return
    assert (got[want.isinf()] == want[want.isinf()]).all(), f"{where}: infinities of the other sign"
    g, w = got[finite], want[finite]
    off = max(float((n.to(dtype).double()[finite].nan_to_num(0, 0, 0) - w).abs().max()) for n in nears)
    size = max(float(w.abs().max()), floor, 1e-300)
    err = float((g - w).abs().max())
    # Below the dtype's least normal number, only its spacing counts.
    allowed = tol * size + 2 * off + slack + torch.finfo(dtype).tiny
    assert err <= allowed, f"{where}: error {err:.3g} over {allowed:.3g} (result size {size:.3g})"


def _torch_dtypes(dtype):
    """The dtypes torch's own arithmetic is run in beside Keel's: the accumulation
    dtype (float32 for 16-bit inputs), then `dtype` itself where that differs."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return list(dict.fromkeys([acc, dtype]))


def _draw(rng, g, device, seed, i):
    """A random call and Keel's run of it: (dtype, case, the gradients asked of each
    argument, a description, Keel's leaves, its outputs, random cotangents of them)."""
    dtype = rng.choice(dtypes_for(device))
    case = rng.choice(KINDS)(rng, g, dtype, device)
    grads = [a is not None and r and rng.random() < 0.7 for a, r in zip(case.args, case.grads)]
    where = f"seed {seed} case {i}: {case}, asked {grads}"
    ours = [None if a is None else a.detach().requires_grad_(r) for a, r in zip(case.args, grads)]
    got = _outs(case.keel(*ours))
    cots = [(torch.rand(o.shape, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(device) for o in got]
    return dtype, case, grads, where, ours, got, cots


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(10))
def test_ops_at_random_agree_with_their_definitions(device, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for i in range(90):
        dtype, case, grads, where, ours, got, cots = _draw(rng, g, device, seed, i)
        want, want_grads, _ = _ref_run(case, torch.float64, grads, cots)
        # torch's own arithmetic: in the accumulation dtype, rounded, and in the dtype itself
        # (a 16-bit softmax's backward reads its rounded output, as Keel's does).
        nears = [_ref_run(case, d, grads, cots) for d in _torch_dtypes(dtype)]
        assert len(got) == len(want), where
        for k, (o, w) in enumerate(zip(got, want)):
            assert o.dtype == dtype and o.device.type == device, f"{where}: output {k}"
            _close(f"{where}: output {k}", o, w, [n[0][k] for n in nears], TOL[dtype], slack=case.slack)

        mine_grads, _ = _grads(got, ours, cots)
        if any(m is not None for m in mine_grads):
            cmax = max(finite_max(c) for c in cots)
            for name, a, mine, w, term, *nr in zip(range(len(ours)), ours, mine_grads, want_grads, case.terms(), *(n[1] for n in nears)):
                if a is None or not a.requires_grad:
                    continue
                if w is None:
                    assert mine is None or not mine.abs().any(), f"{where}: gradient {name}"
                    continue
                assert mine is not None and mine.dtype == dtype, f"{where}: gradient {name}"
                _close(f"{where}: gradient {name}", mine, w, nr, TOL[dtype], term * cmax, case.slack * cmax)

        if case.inplace is not None and not any(a is not None and a.stride().count(0) for a in case.args):
            _check_inplace(case, got, where)
        counts[case.name] = counts.get(case.name, 0) + 1
    assert len(counts) >= 5, counts  # the generator reaches (nearly) every op


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(5))
def test_second_derivatives_at_random_agree_with_their_definitions(device, seed):
    """Double backward (create_graph=True, as for a gradient penalty): the gradients of
    ``sum(first gradient * v)`` for a random v, on the same random calls. Found
    layer_norm's raising where a bias is given without a weight (torch's own
    F.layer_norm's double backward does)."""
    rng = random.Random(1000 + seed)
    g = torch.Generator().manual_seed(1000 + seed)
    checked = 0
    for i in range(60):
        dtype, case, grads, where, ours, got, cots = _draw(rng, g, device, 1000 + seed, i)
        vs = [None if a is None else (torch.rand(a.shape, generator=g, dtype=torch.float64) - 0.5).to(dtype).to(device) for a in case.args]
        _, mine = _grads(got, ours, cots, vs)
        floor = case.terms2 * max(finite_max(c) for c in cots) * max(finite_max(v) for v in vs if v is not None)
        _, _, want = _ref_run(case, torch.float64, grads, cots, vs)
        nears = [_ref_run(case, d, grads, cots, vs)[2] for d in _torch_dtypes(dtype)]
        for k, (m, w) in enumerate(zip(mine, want)):
            if w is None:
                # No second derivative in the definition: Keel's is absent, 0, or NaN where
                # the first derivative is (a zero row with eps 0).
                assert m is None or not m.nan_to_num(0).abs().any(), f"{where}: second derivative {k}"
                continue
            assert m is not None and m.dtype == dtype, f"{where}: second derivative {k}"
            _close(f"{where}: second derivative {k}", m, w, [n[k] for n in nears], TOL[dtype], floor, case.slack)
            checked += 1
    assert checked >= 20  # the generator reaches the comparisons


def _jvp(fn, args, tangents):
    """`fn(*args)`'s outputs and their tangents, by forward-mode AD (dual tensors)."""
    with fwAD.dual_level():
        duals = [a if t is None else fwAD.make_dual(a, t) for a, t in zip(args, tangents)]
        outs = [fwAD.unpack_dual(o) for o in _outs(fn(*duals))]
        return [o.primal.detach().clone() for o in outs], [o.tangent for o in outs]


def _func_jvp(fn, args, tangents):
    """As `_jvp`, through ``torch.func.jvp`` (a functorch transform) over the args with tangents."""
    which = [k for k, t in enumerate(tangents) if t is not None]

    def of(*xs):
        full = list(args)
        for k, x in zip(which, xs):
            full[k] = x
        return tuple(_outs(fn(*full)))

    outs, tans = torch.func.jvp(of, tuple(args[k] for k in which), tuple(tangents[k] for k in which))
    return list(outs), list(tans)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(5))
def test_forward_mode_at_random_agrees_with_the_definitions(device, seed):
    """Jacobian-vector products (dual tensors, and ``torch.func.jvp``) on the same random
    calls, against the float64 definition's."""
    rng = random.Random(2000 + seed)
    g = torch.Generator().manual_seed(2000 + seed)
    checked = 0
    for i in range(60):
        dtype = rng.choice(dtypes_for(device))
        case = rng.choice(KINDS)(rng, g, dtype, device)
        tans = [
            None if a is None or not r or rng.random() < 0.3 else (torch.rand(a.shape, generator=g, dtype=torch.float64) - 0.5).to(dtype).to(device)
            for a, r in zip(case.args, case.grads)
        ]
        if all(t is None for t in tans):
            continue
        # torch makes no dual of a broadcast (stride 0) primal, for its own ops either.
        case.args = [a.contiguous() if t is not None and 0 in a.stride() else a for a, t in zip(case.args, tans)]
        how = rng.choice([_jvp, _func_jvp])
        where = f"seed {2000 + seed} case {i} ({how.__name__}): {case}, tangents {[t is not None for t in tans]}"
        outs, got = how(case.keel, case.args, tans)

        def on_cpu(d):
            return [None if a is None else a.cpu().to(d) for a in case.args], [None if t is None else t.cpu().to(d) for t in tans]

        want, want_t = _jvp(case.ref, *on_cpu(torch.float64))
        nears = [_jvp(case.ref, *on_cpu(d)) for d in _torch_dtypes(dtype)]
        floor = max(case.terms()) * max(finite_max(t) for t in tans if t is not None)
        for k, (o, t, w, wt) in enumerate(zip(outs, got, want, want_t)):
            _close(f"{where}: output {k}", o, w, [n[0][k] for n in nears], TOL[dtype], slack=case.slack)
            if wt is None:
                assert t is None or not t.nan_to_num(0).abs().any(), f"{where}: tangent {k}"
                continue
            assert t is not None and t.dtype == dtype, f"{where}: tangent {k}"
            _close(f"{where}: tangent {k}", t, wt, [n[1][k] for n in nears], TOL[dtype], floor, case.slack)
            checked += 1
    assert checked >= 20  # the generator reaches the comparisons


def _check_inplace(case, got, where):
    """The in-place form, on copies of the inputs laid out as they are (a strided last dim
    keeps its gaps) inside a wider storage of 7s, gives the out-of-place bits and leaves
    every element its views do not reach alone."""
    held, views = [], []
    for a in case.args:
        if a is None:
            views.append(None)
            continue
        span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride())) if a.numel() else 0
        base = torch.full([span + 6], 7.0, dtype=a.dtype, device=a.device)
        view = base.as_strided(a.shape, a.stride(), 3)
        with torch.no_grad():
            view.copy_(a)
        reached = torch.zeros(base.shape, dtype=torch.bool)
        reached.as_strided(a.shape, a.stride(), 3).fill_(True)
        held.append((base, reached))
        views.append(view)
    with torch.no_grad():
        written = _outs(case.inplace(*views))
    for k, (o, w) in enumerate(zip(got, written)):
        same_nan = (o.isnan() == w.isnan()).all()
        assert same_nan and torch.equal(o.detach().nan_to_num(0), w.nan_to_num(0)), f"{where}: in-place output {k}"
    for base, reached in held:
        assert (base[~reached.to(base.device)] == 7.0).all(), f"{where}: in place wrote outside its view"
