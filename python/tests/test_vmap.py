"""``torch.vmap`` over Keel's ops (``keel._vmap``): each op with a batching rule
runs its kernel once on all the examples' rows, and gives the bits of the
per-example calls; where one call would not keep an example's meaning (a
batched weight, a reduced cross-entropy) it calls the op once an example.
Gradients through vmap, vmap of gradients, batched gradients and errors too."""
import warnings

import pytest
import torch

import keel
from conftest import devices
from keel import _vmap
from keel._common import nograd
from test_torch_version import CASES

ops = torch.ops.keel
B = 3


def _op_name(op):
    return op._qualified_op_name.split("::")[1]


def _example(a, k):
    """Example `k` of argument `a`: distinct values, the same shape and dtype."""
    if not isinstance(a, torch.Tensor):
        return a
    if a.is_floating_point():
        return a.detach() * (1 + 0.25 * k) + 0.125 * k
    return a.roll(k)  # class targets: the ignored ones move too


def _batch(args, positions, dim=0):
    """`args` with the tensors at `positions` stacked from B examples along `dim`;
    the in_dims to vmap them."""
    batched, in_dims = list(args), [None] * len(args)
    for i in positions:
        if i < len(args) and isinstance(args[i], torch.Tensor):
            d = min(dim, args[i].dim())  # a 0-dim one (a reduced loss's gradient) at 0
            batched[i] = torch.stack([_example(args[i], k) for k in range(B)], d)
            in_dims[i] = d
    return batched, tuple(in_dims)


def _loop(op, args, in_dims):
    """The per-example calls, stacked."""
    outs = [op(*[a if d is None else a.select(d, k) for a, d in zip(args, in_dims)]) for k in range(B)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs))
    return torch.stack(outs)


def _assert_equal(got, want):
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w), (g - w).abs().max()


RULED = [n for n in CASES if _op_name(CASES[n][0]) in _vmap.SPECS]


def test_every_op_has_a_rule():
    assert RULED == list(CASES)


def _assert_matches(op_name, got, want):
    """`got` as the per-example calls' `want`: bit for bit, but for the per-feature
    gradients of the norms' backward ops, which the rule sums again over each
    example's rows (the norm's forward op times the gradient, summed in another
    order than the kernel's; float64 cases: to 1e-12)."""
    if op_name not in _vmap.PER_EXAMPLE_SUMS:
        return _assert_equal(got, want)
    _assert_equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _folded(op_name, args):
    """Whether the rule folds these (unbatched-weight) arguments into one call."""
    if op_name not in _vmap._REDUCTION:
        return True
    at = _vmap._REDUCTION[op_name]
    return (args[at] if at < len(args) else "mean") == "none"


@pytest.mark.parametrize("twin", [False, True], ids=["op", "twin"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("name", RULED)
def test_rows_batched_give_the_per_example_bits_in_one_call(name, dim, twin, monkeypatch):
    op, args = CASES[name]
    op_name = _op_name(op)
    if twin:
        op = getattr(ops, nograd(op_name))
    rows = _vmap.SPECS[op_name][1]
    batched, in_dims = _batch(args, rows, dim)
    want = _loop(op, batched, in_dims)
    if _folded(op_name, args):

        def no_loop(*a):
            raise AssertionError("the rule called the op once an example")

        monkeypatch.setattr(_vmap, "_loop", no_loop)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        got = torch.vmap(op, in_dims=in_dims)(*batched)
    _assert_matches(op_name, got, want)


@pytest.mark.parametrize("name", RULED)
def test_every_tensor_batched_gives_the_per_example_bits(name, monkeypatch):
    """Weights, biases, cos and sin batched too: one call an example."""
    op, args = CASES[name]
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    batched, in_dims = _batch(args, positions)
    params = _vmap.SPECS[_op_name(op)][2]
    calls = []
    loop = _vmap._loop
    monkeypatch.setattr(_vmap, "_loop", lambda *a: calls.append(1) or loop(*a))
    got = torch.vmap(op, in_dims=in_dims)(*batched)
    _assert_matches(_op_name(op), got, _loop(op, batched, in_dims))
    per_example = any(i < len(args) and args[i] is not None for i in params) or not _folded(_op_name(op), args)
    assert len(calls) == per_example


def test_no_examples_give_empty_outputs_after_the_checks():
    x, w = torch.randn(0, 4, 8), torch.randn(8)
    y = torch.vmap(ops.rms_norm, in_dims=(0, None))(x, w)
    assert y.shape == (0, 4, 8)
    loss, lse = torch.vmap(ops.cross_entropy_with_lse, in_dims=(0, 0, None, None, None))(
        torch.randn(0, 4, 8), torch.zeros(0, 4, dtype=torch.long), -100, 0.0, "none"
    )
    assert loss.shape == (0, 4) and lse.shape == (0, 4)
    with pytest.raises(RuntimeError, match=r"keel::rms_norm: argument 'weight' must have shape \[8\]"):
        torch.vmap(ops.rms_norm, in_dims=(0, None))(x, torch.randn(7))


def test_nested_vmap_folds_both_levels(monkeypatch):
    x = torch.randn(4, 3, 5, 8)
    monkeypatch.setattr(_vmap, "_loop", None)  # any per-example call fails
    got = torch.vmap(torch.vmap(ops.softmax, in_dims=(1, None)), in_dims=(2, None))(x, 0.5)
    want = ops.softmax(x.permute(2, 1, 0, 3).contiguous(), 0.5)
    _assert_equal(got, want)


def test_typed_api_under_vmap_calls_the_op(monkeypatch):
    """Inside vmap the typed API calls the op (one call, Keel's kernel), no longer
    its torch-op version."""
    x, w = torch.randn(3, 4, 8), torch.randn(8)
    monkeypatch.setattr(_vmap, "_loop", None)
    got = torch.vmap(keel.rms_norm, in_dims=(0, None))(x, w)
    _assert_equal(got, ops.rms_norm(x, w))
    got = torch.vmap(lambda z, t: keel.cross_entropy(z, t, reduction="none"))(x, torch.randint(0, 8, (3, 4)))
    assert got.shape == (3, 4)


def test_gradients_through_vmap_use_keels_backward():
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    y = torch.vmap(keel.rms_norm, in_dims=(0, None))(x, w)
    names = set()
    todo = [y.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None:
            names.add(type(f).__name__)
            todo.extend(n for n, _ in f.next_functions)
    assert any("Keel" in n for n in names), names
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
    rx, rw = torch.autograd.grad(yr, (xr, wr), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_vmap_of_grad_and_grad_of_vmap():
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)

    def loss(f):
        return lambda a: f(a).pow(3).sum()

    keel_fn = lambda a: keel.rms_norm(a, w)  # noqa: E731
    ref_fn = lambda a: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    want = torch.vmap(torch.func.grad(loss(ref_fn)))(x)
    torch.testing.assert_close(torch.vmap(torch.func.grad(loss(keel_fn)))(x), want)
    torch.testing.assert_close(torch.func.grad(loss(torch.vmap(keel_fn)))(x), want)
    jac = torch.func.jacrev(torch.vmap(lambda a: ops.softmax(a, 0.5)))(x[:, 0])
    torch.testing.assert_close(jac, torch.func.jacrev(torch.vmap(lambda a: torch.softmax(0.5 * a, -1)))(x[:, 0]))


_NORM_BACKWARDS = {
    # op, arguments of one example (grad, rows, weight...), the row arguments' positions
    "rms_norm": (ops.rms_norm_backward, lambda g, x, w: (g, x, w, 1e-5), (0, 1)),
    "layer_norm": (ops.layer_norm_backward, lambda g, x, w: (g, x, w, w * 0.5, 1e-5), (0, 1)),
    "fused_add_rms_norm": (ops.fused_add_rms_norm_backward, lambda g, x, w: (g, g * 0.5, x, w, 1e-5), (0, 1, 2)),
}


def _norm_backward_args(name, batched, device, dtype):
    """Norm `name`'s backward op, its arguments over B examples of [5, 64] rows
    and their in_dims; "grad only": the rows unbatched and the gradient
    batched, as jacrev and ``is_grads_batched`` call it."""
    op, make, rows = _NORM_BACKWARDS[name]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(B, 5, 64, generator=gen) * 3 + 1).to(device, dtype)
    g = torch.randn(B, 5, 64, generator=gen).to(device, dtype)
    w = torch.randn(64, generator=gen).to(device, dtype)
    if batched == "grad only":
        x = x[0]
    args = make(g, x, w)
    return op, args, tuple(0 if i in rows and args[i].dim() == 3 else None for i in range(len(args)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("batched", ["all rows", "grad only"])
@pytest.mark.parametrize("name", list(_NORM_BACKWARDS))
def test_norm_backwards_give_per_example_weight_gradients_in_one_call(name, batched, device, dtype, monkeypatch):
    """The norms' backward ops under vmap: the input's gradient is the per-example
    calls' bits; the weight's and bias's are each example's own sums (one call:
    no per-example loop), as the loop gives them, within the rounding of a sum
    in another order (f32: 1e-5; bf16: one rounding of the result, 2^-8)."""
    op, args, in_dims = _norm_backward_args(name, batched, device, dtype)
    monkeypatch.setattr(_vmap, "_loop", None)  # any per-example call fails
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        got = torch.vmap(op, in_dims=in_dims)(*args)
    want = _loop(op, args, in_dims)
    _assert_equal(got[0], want[0])
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    for a, b in zip(got[1:], want[1:]):
        assert a.shape == b.shape == (B, 64) and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("batched", ["all rows", "grad only"])
@pytest.mark.parametrize("name", list(_NORM_BACKWARDS))
def test_norm_backwards_on_large_cpu_examples_run_once_an_example(name, batched, device, dtype, monkeypatch):
    """Where an example's gradient holds ``_vmap.LOOP_MIN`` elements or more
    (here lowered to 1), the norms' backward ops on the CPU run once an example:
    every output is the per-example calls' bits, the weight's and bias's too. On
    CUDA the one call and the sums serve at every size."""
    op, args, in_dims = _norm_backward_args(name, batched, device, dtype)
    monkeypatch.setattr(_vmap, "LOOP_MIN", 1)
    if device == "cpu":
        monkeypatch.setattr(_vmap, "_per_example_sums", None)  # the sums would fail
    else:
        monkeypatch.setattr(_vmap, "_loop", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        got = torch.vmap(op, in_dims=in_dims)(*args)
    want = _loop(op, args, in_dims)
    if device == "cpu":
        _assert_equal(got, want)
    else:
        _assert_equal(got[0], want[0])


@pytest.mark.parametrize("name", list(_NORM_BACKWARDS))
def test_norm_backwards_loop_from_loop_min_elements_an_example(name, monkeypatch):
    """The threshold itself: an example's gradient of ``LOOP_MIN`` elements runs
    once an example, one row fewer folds and sums."""
    op, make, rows = _NORM_BACKWARDS[name]
    features = 64
    summed = []
    real = _vmap._per_example_sums
    monkeypatch.setattr(_vmap, "_per_example_sums", lambda *a: summed.append(1) or real(*a))
    for count, sums in ((_vmap.LOOP_MIN // features, 0), (_vmap.LOOP_MIN // features - 1, 1)):
        g, x, w = torch.randn(B, count, features), torch.randn(B, count, features), torch.randn(features)
        args = make(g, x, w)
        in_dims = tuple(0 if i in rows else None for i in range(len(args)))
        got = torch.vmap(op, in_dims=in_dims)(*args)
        assert len(summed) == sums, count
        want = _loop(op, args, in_dims)
        _assert_equal(got if not sums else got[0], want if not sums else want[0])
        for a, b in zip(got[1:], want[1:]):  # summed in another order where folded (float32)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("loop", [False, True], ids=["sums", "loop"])
@pytest.mark.parametrize("name", list(_NORM_BACKWARDS))
def test_gradients_through_the_norm_backwards_rule(name, loop, monkeypatch):
    """gradcheck (float64) of the batched backward op, weight gradients summed
    per example included: the rule's sums are differentiable, as the op is, and
    so are its per-example calls (``LOOP_MIN`` lowered to 1)."""
    if loop:
        monkeypatch.setattr(_vmap, "LOOP_MIN", 1)
    op, make, rows = _NORM_BACKWARDS[name]
    gen = torch.Generator().manual_seed(2)
    g, x, w = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 3, 8), (2, 3, 8), (8,)))
    in_dims = tuple(0 if i in rows else None for i in range(len(make(g, x, w))))

    def batched(g, x, w):
        return torch.vmap(op, in_dims=in_dims)(*make(g, x, w))

    leaves = [t.requires_grad_() for t in (g, x, w)]
    assert torch.autograd.gradcheck(batched, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_norm_backwards_keep_a_missing_weights_empty_gradient():
    g, x = torch.randn(B, 4, 8), torch.randn(B, 4, 8)
    gx, gw = torch.vmap(ops.rms_norm_backward, in_dims=(0, 0, None, None))(g, x, None, 1e-5)
    want = _loop(ops.rms_norm_backward, (g, x, None, 1e-5), (0, 0, None, None))
    _assert_equal((gx, gw), want)
    assert gw.shape == (B, 0)
    gx, gw, gb = torch.vmap(ops.layer_norm_backward, in_dims=(0, 0, None, None, None))(g, x, None, x[0, 0], 1e-5)
    assert gw.shape == (B, 0)
    torch.testing.assert_close(gb, g.sum(1))


@pytest.mark.parametrize("device", devices())
def test_batched_gradients_of_a_norm_give_each_gradients_weight_gradient(device):
    """``is_grads_batched`` through rms_norm with a weight: each gradient's own
    weight gradient, from the backward op's rule (no fallback)."""
    x = torch.randn(4, 8, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, device=device, dtype=torch.float64, requires_grad=True)
    y = keel.rms_norm(x, w)
    grads = torch.randn(5, 4, 8, device=device, dtype=torch.float64)
    want = [torch.autograd.grad(y, (x, w), g, retain_graph=True) for g in grads]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        gx, gw = torch.autograd.grad(y, (x, w), grads, is_grads_batched=True)
    torch.testing.assert_close(gx, torch.stack([a for a, _ in want]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, torch.stack([b for _, b in want]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", devices())
def test_batched_gradients_reach_the_backward_rules(device):
    """``is_grads_batched`` runs the backward under vmap: softmax's backward op
    has a rule; the result is each gradient's own."""
    x = torch.randn(4, 8, device=device, requires_grad=True)
    y = keel.softmax(x, 0.5)
    grads = torch.randn(5, 4, 8, device=device)
    want = torch.stack([torch.autograd.grad(y, x, g, retain_graph=True)[0] for g in grads])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        (got,) = torch.autograd.grad(y, x, grads, is_grads_batched=True)
    _assert_equal(got, want)


@pytest.mark.parametrize("device", devices())
def test_folded_results_match_the_loop_on_each_device(device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, 5, 6, 16, generator=gen).to(device)
    w = torch.randn(16, generator=gen).to(device)
    cs, sn = torch.randn(6, 4, generator=gen).to(device), torch.randn(6, 4, generator=gen).to(device)
    cases = [
        (ops.rms_norm, (x, w), (0, None)),
        (ops.layer_norm, (x, w, w), (0, None, None)),
        (ops.silu_and_mul, (x,), (0,)),
        (ops.softmax, (x, 0.5), (0, None)),
        (ops.rotary_embedding, (x.unsqueeze(1).expand(B, 2, 5, 6, 16).transpose(2, 3), cs, sn), (0, None, None)),
    ]
    for op, args, in_dims in cases:
        got = torch.vmap(op, in_dims=in_dims)(*args)
        torch.testing.assert_close(got, _loop(op, args, in_dims), rtol=1e-6, atol=1e-6)


def test_bad_arguments_raise_the_per_example_error():
    x = torch.randn(3, 4, 8)
    with pytest.raises(RuntimeError, match=r"keel::layer_norm: argument 'bias' must have shape \[8\]"):
        torch.vmap(ops.layer_norm, in_dims=(0, None, None))(x, torch.randn(8), torch.randn(9))
    with pytest.raises(RuntimeError, match="keel::softmax: argument 'input' must have at least 1 dimension"):
        torch.vmap(ops.softmax)(torch.randn(3))
    with pytest.raises(RuntimeError, match=r"keel::rotary_embedding: argument 'x'"):
        torch.vmap(ops.rotary_embedding, in_dims=(0, None, None))(x, torch.randn(4, 2), torch.randn(4, 2))
    ce = torch.vmap(ops.cross_entropy, in_dims=(0, 0, None, None, None))
    with pytest.raises(RuntimeError, match=r"keel::cross_entropy: argument 'logits' must have 2 dims"):
        ce(x[:, 0], torch.zeros(3, dtype=torch.long), -100, 0.0, "none")
    with pytest.raises(RuntimeError, match="keel::rms_norm: argument 'weight' is on meta but 'input' is on cpu"):
        torch.vmap(ops.rms_norm, in_dims=(0, None))(x, torch.empty(8, device="meta"))
    with pytest.raises(RuntimeError, match="keel::softmax: argument 'input' must be float32"):
        torch.vmap(ops._softmax_nograd)(x.long())


def test_compiled_vmap_matches_eager():
    x, w = torch.randn(3, 4, 8), torch.randn(8)
    batched = torch.vmap(ops.rms_norm, in_dims=(0, None))
    f = torch.compile(lambda a: batched(a, w) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), ops.rms_norm(x, w) * 2)


def test_nested_levels_batch_rows_and_weights_apart():
    """The outer vmap batches the weight, the inner one the rows: the inner rule
    folds the rows, the outer one calls the op once a weight."""
    x, w = torch.randn(4, 5, 8), torch.randn(3, 8)
    got = torch.vmap(lambda wi: torch.vmap(ops.rms_norm, in_dims=(0, None))(x, wi))(w)
    want = torch.stack([ops.rms_norm(x, wi) for wi in w])
    _assert_equal(got, want)


def test_model_ensemble_with_stacked_parameters():
    """``torch.func.stack_module_state`` + vmap (model ensembling): each model's
    own weight, no fallback warning, its own gradients."""
    from torch.func import functional_call, stack_module_state

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), keel.nn.RMSNorm(8), torch.nn.Linear(8, 4)) for _ in range(3)]
    for m in models:
        with torch.no_grad():
            m[1].weight.uniform_(0.5, 1.5)
    params, buffers = stack_module_state(models)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), keel.nn.RMSNorm(8), torch.nn.Linear(8, 4)).to("meta")

    def run(p, b, x):
        return functional_call(base, (p, b), (x,))

    x = torch.randn(5, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        got = torch.vmap(run, in_dims=(0, 0, None))(params, buffers, x)
        grads = torch.vmap(torch.func.grad(lambda p, b, x: run(p, b, x).pow(2).sum()), in_dims=(0, 0, None))(
            params, buffers, x
        )
    torch.testing.assert_close(got, torch.stack([m(x) for m in models]).detach())
    for i, m in enumerate(models):
        m.zero_grad()
        m(x).pow(2).sum().backward()
        torch.testing.assert_close(grads["1.weight"][i], m[1].weight.grad)


def _fused_add_(x, r, w, eps=1e-6, round_before_weight=False):
    keel.fused_add_rms_norm_(x, r, w, eps, round_before_weight=round_before_weight)
    return x, r


def _rotary_(q, cos, sin, interleaved=False):
    keel.rotary_embedding_(q, cos, sin, interleaved)
    return q


def _in_place_cases(device):
    """(fn, args, in_dims, one call): the in-place ops through the typed API,
    the tensors they write batched on dim 0 or on another dim."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x, r, w = rand(B, 4, 16), rand(B, 4, 16), rand(16)
    q, cs, sn = rand(B, 2, 5, 3, 16), rand(5, 4), rand(5, 4)
    return {
        "fused_add_rms_norm_": (_fused_add_, (x, r, w), (0, 0, None), True),
        "fused_add_rms_norm_-no-weight-dims-1-and-0": (_fused_add_, (x.transpose(0, 1).contiguous(), r, None), (1, 0, None), True),
        "fused_add_rms_norm_-round-before-weight": (
            lambda a, b, c: _fused_add_(a, b, c, round_before_weight=True),
            (x.bfloat16(), r.bfloat16(), w.bfloat16()),
            (0, 0, None),
            True,
        ),
        "fused_add_rms_norm_-batched-weight": (_fused_add_, (x, r, rand(B, 16)), (0, 0, 0), False),
        "rotary_embedding_": (_rotary_, (q, cs, sn), (0, None, None), True),
        "rotary_embedding_-interleaved": (lambda a, c, s: _rotary_(a, c, s, True), (q, cs, sn), (0, None, None), True),
        # The batch dim inside: no view merges it into the batch, so one call an example.
        "rotary_embedding_-batch-dim-2": (_rotary_, (q.movedim(0, 2).contiguous(), cs, sn), (2, None, None), False),
        "rotary_embedding_-batched-cos": (_rotary_, (q, rand(B, 5, 4), sn), (0, 0, None), False),
    }


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", sorted(_in_place_cases("cpu")))
def test_in_place_ops_write_the_per_example_bits(name, device, monkeypatch):
    """vmap over the in-place ops (torch's fallback refuses ops that write their
    arguments): the tensors written hold the per-example calls' bits, in one
    call where the per-feature tensors are shared and a view folds the batch."""
    fn, args, in_dims, one_call = _in_place_cases(device)[name]
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for k in range(B):
        fn(*[a if d is None else a.select(d, k) for a, d in zip(want, in_dims)])
    got = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    calls = []
    each = _vmap._each_example
    monkeypatch.setattr(_vmap, "_each_example", lambda *a: calls.append(1) or each(*a))
    out = torch.vmap(fn, in_dims=in_dims)(*got)
    assert len(calls) == (not one_call)
    for g, w in zip(got, want):
        if isinstance(g, torch.Tensor):
            _assert_equal(g, w)
    # vmap returns the written tensor with the batch dim first.
    _assert_equal(out[0] if isinstance(out, tuple) else out, want[0].movedim(in_dims[0], 0))


def test_in_place_ops_under_vmap_refuse_an_unbatched_tensor_they_write():
    x, r, w = torch.randn(B, 4, 16), torch.randn(4, 16), torch.randn(16)
    written = r.clone()
    with pytest.raises(RuntimeError, match="keel::fused_add_rms_norm_: argument 'residual' is written in place, so under vmap it must be batched"):
        torch.vmap(_fused_add_, in_dims=(0, None, None))(x, r, w)
    _assert_equal(r, written)
    q, cs = torch.randn(2, 5, 3, 16), torch.randn(B, 5, 4)
    with pytest.raises(RuntimeError, match="keel::rotary_embedding_: argument 'x' is written in place"):
        torch.vmap(_rotary_, in_dims=(None, 0, None))(q, cs, torch.randn(5, 4))


def test_in_place_ops_under_vmap_check_first_and_take_no_examples():
    x, r = torch.randn(B, 4, 16), torch.randn(B, 4, 16)
    with pytest.raises(RuntimeError, match=r"keel::fused_add_rms_norm_: argument 'weight' must have shape \[16\]"):
        torch.vmap(_fused_add_, in_dims=(0, 0, None))(x, r, torch.randn(15))
    with pytest.raises(RuntimeError, match=r"keel::rotary_embedding_: argument 'x' must have 4 dims"):
        torch.vmap(_rotary_, in_dims=(0, None, None))(torch.randn(B, 5, 3, 16), torch.randn(5, 4), torch.randn(5, 4))
    e = torch.randn(0, 4, 16)
    got = torch.vmap(_fused_add_, in_dims=(0, 0, None))(e, e.clone(), torch.randn(16))
    assert got[0].shape == (0, 4, 16)


def test_nested_vmap_of_an_in_place_op(monkeypatch):
    x, r, w = torch.randn(2, B, 4, 16), torch.randn(2, B, 4, 16), torch.randn(16)
    want_x, want_r = x.clone(), r.clone()
    for i in range(2):
        for k in range(B):
            keel.fused_add_rms_norm_(want_x[i, k], want_r[i, k], w)
    monkeypatch.setattr(_vmap, "_each_example", None)  # any per-example call fails
    torch.vmap(torch.vmap(_fused_add_, in_dims=(0, 0, None)), in_dims=(0, 0, None))(x, r, w)
    _assert_equal(x, want_x)
    _assert_equal(r, want_r)


def test_compiled_vmap_of_an_in_place_op():
    """``torch.compile(fullgraph=True)`` of vmap over an in-place op writes what
    eager vmap writes (aot_eager; Inductor gave the same on 2.15, by hand)."""
    x, r, w = torch.randn(B, 4, 16), torch.randn(B, 4, 16), torch.randn(16)
    want_x, want_r = x.clone(), r.clone()
    torch.vmap(_fused_add_, in_dims=(0, 0, None))(want_x, want_r, w)
    f = torch.compile(torch.vmap(_fused_add_, in_dims=(0, 0, None)), fullgraph=True, backend="aot_eager")
    f(x, r, w)
    _assert_equal(x, want_x)
    _assert_equal(r, want_r)
