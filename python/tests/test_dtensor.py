"""Keel's ops on DTensors (``python/keel/_dtensor.py``): two CPU processes (gloo)
run each case on a ``[2]`` mesh; the whole results (``full_tensor()``) must
match the same Keel call on the plain tensors in one process, and the outputs'
placements must be the ones the rules give (rows sharded as the input was, the
norms' weight gradients ``Partial``).

The processes run every case once (a module fixture) and send back what each
gave; the tests compare here, one a case.
"""
import datetime
import functools
import importlib
import math
import os
import tempfile
import traceback
import warnings

import pytest
import torch

import keel
from conftest import assert_close
from keel._common import INPLACE

WORLD = 2
F32 = torch.float32

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available in this torch build",
    ),
    # scripts/test-aarch64-wheel.sh: two more emulated torch processes, each
    # importing torch under qemu, for rules that are Python (run on x86 here).
    pytest.mark.skipif("KEEL_QEMU_PYTHON" in os.environ, reason="under qemu-user: the sharding rules are tested natively"),
]


def _placements(t):
    return tuple(t.placements)


def _run_case(mesh, fn, inputs):
    """`fn` on DTensors of `inputs` (name -> (tensor, placement, requires_grad):
    the placement one (of a 1-D mesh), a tuple of them, or None for Replicate)
    and on the plain tensors.
    Returns (got, want, placements): each result and gradient, whole."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    plain, dist = {}, {}
    for name, (t, placement, grad) in inputs.items():
        plain[name] = t.clone().requires_grad_(grad)
        placement = placement or (Replicate(),) * mesh.ndim
        d = distribute_tensor(t, mesh, placement if isinstance(placement, tuple) else [placement])
        dist[name] = d.requires_grad_(grad)
    want_out = fn(**plain)
    got_out = fn(**dist)
    want_out = want_out if isinstance(want_out, tuple) else (want_out,)
    got_out = got_out if isinstance(got_out, tuple) else (got_out,)
    got, want, placements = {}, {}, {}
    for i, (g, w) in enumerate(zip(got_out, want_out)):
        placements[f"out{i}"] = _placements(g)
        got[f"out{i}"], want[f"out{i}"] = g.full_tensor(), w
    if any(grad for _, _, grad in inputs.values()):
        seed = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i)) for i, w in enumerate(want_out)]
        torch.autograd.backward(want_out, seed)
        # A Shard output's gradient is sharded alike; a Replicate or Partial one's, whole.
        placed = [[Replicate() if p.is_partial() else p for p in g.placements] for g in got_out]
        torch.autograd.backward(got_out, [distribute_tensor(s, mesh, p) for s, p in zip(seed, placed)])
        for name, (_, _, grad) in inputs.items():
            if grad:
                placements[f"d{name}"] = _placements(dist[name].grad)
                got[f"d{name}"], want[f"d{name}"] = dist[name].grad.full_tensor(), plain[name].grad
    return got, want, placements


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F32)


def _cos_sin(seq, half):
    angles = torch.arange(seq, dtype=F32)[:, None] * torch.linspace(0.1, 1.0, half)[None, :]
    return angles.cos(), angles.sin()


@functools.lru_cache(maxsize=None)
def _cases():
    """Case name -> (fn, inputs, expected placements of the outputs and gradients)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = {}
    P, R = (Partial(),), (Replicate(),)
    x3, w, b = _x(6, 8, 64), _x(64, seed=1), _x(64, seed=2)
    for d in (0, 1):
        S = (Shard(d),)
        rows = (x3, Shard(d), True)
        out[f"rms_norm-shard{d}"] = (
            lambda input, weight: keel.rms_norm(input, weight, 1e-5),
            {"input": rows, "weight": (w, None, True)},
            {"out0": S, "dinput": S, "dweight": P},
        )
        out[f"rms_norm-no-weight-shard{d}"] = (lambda input: keel.rms_norm(input), {"input": rows}, {"out0": S, "dinput": S})
        out[f"ops.rms_norm-shard{d}"] = (
            lambda input, weight: torch.ops.keel.rms_norm(input, weight),
            {"input": rows, "weight": (w, None, True)},
            {"out0": S, "dinput": S, "dweight": P},
        )
        out[f"layer_norm-shard{d}"] = (
            lambda input, weight, bias: keel.layer_norm(input, weight, bias),
            {"input": rows, "weight": (w, None, True), "bias": (b, None, True)},
            {"out0": S, "dinput": S, "dweight": P, "dbias": P},
        )
        out[f"layer_norm-no-weight-shard{d}"] = (lambda input: keel.layer_norm(input), {"input": rows}, {"out0": S, "dinput": S})
        out[f"fused_add_rms_norm-shard{d}"] = (
            lambda input, residual, weight: keel.fused_add_rms_norm(input, residual, weight),
            {"input": rows, "residual": (_x(6, 8, 64, seed=3), Shard(d), True), "weight": (w, None, True)},
            {"out0": S, "out1": S, "dinput": S, "dresidual": S, "dweight": P},
        )
        gated = (_x(6, 8, 128, seed=4), Shard(d), True)
        out[f"silu_and_mul-shard{d}"] = (lambda input: keel.silu_and_mul(input), {"input": gated}, {"out0": S, "dinput": S})
        out[f"gelu_and_mul-tanh-shard{d}"] = (
            lambda input: keel.gelu_and_mul(input, "tanh"),
            {"input": gated},
            {"out0": S, "dinput": S},
        )
        out[f"softmax-shard{d}"] = (lambda input: keel.softmax(input, 0.5), {"input": rows}, {"out0": S, "dinput": S})
    cos, sin = _cos_sin(8, 8)
    q = _x(2, 8, 4, 16, seed=5)
    for d in (0, 1, 2):
        S = (Shard(d),)
        out[f"rotary_embedding-shard{d}"] = (
            lambda x, cos, sin: keel.rotary_embedding(x, cos, sin),
            {"x": (q, Shard(d), True), "cos": (cos, None, False), "sin": (sin, None, False)},
            {"out0": S, "dx": S},
        )
    logits, target, cw = _x(12, 50, seed=6), torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(7)), _x(50, seed=8).abs()
    target[3] = -100
    rows = {"logits": (logits, Shard(0), True), "target": (target, Shard(0), False)}
    # "mean" by the typed API: the rows' losses summed on each rank, the logits not gathered.
    loss = {"none": (Shard(0),), "sum": P, "mean": R}
    for reduction, placed in loss.items():
        out[f"cross_entropy-{reduction}"] = (
            lambda logits, target, weight, r=reduction: keel.cross_entropy(logits, target, reduction=r, weight=weight, label_smoothing=0.1),
            {**rows, "weight": (cw, None, False)},
            {"out0": placed, "dlogits": (Shard(0),)},
        )
    out["cross_entropy-mean-no-weight"] = (lambda logits, target: keel.cross_entropy(logits, target), rows, {"out0": R, "dlogits": (Shard(0),)})
    out["keel.nn.CrossEntropyLoss-mean"] = (
        lambda logits, target: keel.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, target),
        rows,
        {"out0": R, "dlogits": (Shard(0),)},
    )
    out["cross_entropy-mean-weight-grad"] = (
        lambda logits, target, weight: keel.cross_entropy(logits, target, weight=weight, label_smoothing=0.1),
        {**rows, "weight": (cw, None, True)},
        {"out0": R, "dlogits": (Shard(0),), "dweight": P},
    )
    probs = torch.softmax(_x(12, 50, seed=9), -1)
    out["cross_entropy-mean-probabilities"] = (
        lambda logits, target, weight: keel.cross_entropy(logits, target, weight=weight, label_smoothing=0.1),
        {"logits": (logits, Shard(0), True), "target": (probs, Shard(0), True), "weight": (cw, None, False)},
        {"out0": R, "dlogits": (Shard(0),), "dtarget": (Shard(0),)},
    )
    # bfloat16: the rows' losses rounded before they are added up (the op adds them in float32).
    out["cross_entropy-mean-bfloat16"] = (
        lambda logits, target, weight: keel.cross_entropy(logits, target, weight=weight, label_smoothing=0.1),
        {"logits": (logits.bfloat16(), Shard(0), True), "target": (target, Shard(0), False), "weight": (cw, None, False)},
        {"out0": R, "dlogits": (Shard(0),)},
    )
    out["cross_entropy-mean-autocast"] = (
        lambda logits, target: _autocast(keel.cross_entropy, logits, target, label_smoothing=0.1),
        {"logits": (logits.bfloat16(), Shard(0), True), "target": (target, Shard(0), False)},
        {"out0": R, "dlogits": (Shard(0),)},
    )
    out["cross_entropy-mean-no-grad"] = (
        lambda logits, target: _no_grad(keel.cross_entropy, logits, target),
        {"logits": (logits, Shard(0), False), "target": (target, Shard(0), False)},
        {"out0": R},
    )
    ignored = torch.full_like(target, -100)
    out["cross_entropy-mean-all-ignored"] = (
        lambda logits, target: keel.cross_entropy(logits, target),
        {"logits": (logits, Shard(0), True), "target": (ignored, Shard(0), False)},
        {"out0": R, "dlogits": (Shard(0),)},
    )
    # [N, V, d] logits, classes in dim 1, sharded on N (the rows' order differs
    # from the [N d, V] rows the typed API runs them as).
    out["cross_entropy-mean-classes-in-dim-1"] = (
        lambda logits, target: keel.cross_entropy(logits, target),
        {"logits": (_x(4, 50, 3, seed=10), Shard(0), True), "target": (target.reshape(4, 3), Shard(0), False)},
        {"out0": R, "dlogits": (Shard(0),)},
    )
    for reduction in ("none", "mean"):
        out[f"cross_entropy_with_lse-{reduction}"] = (
            lambda logits, target, r=reduction: keel.cross_entropy_with_lse(logits, target, reduction=r),
            rows,
            {"out0": loss[reduction], "out1": (Shard(0),), "dlogits": (Shard(0),)},
        )
    # The op itself runs "mean" whole (the kernel divides by its rows' weight).
    out["ops.cross_entropy-mean"] = (
        lambda logits, target: torch.ops.keel.cross_entropy(logits, target),
        rows,
        {"out0": R, "dlogits": R},
    )
    # The backward ops called directly, and the in-place ops (no gradient).
    out["ops.rms_norm_backward-shard1"] = (
        lambda grad_out, input, weight: torch.ops.keel.rms_norm_backward(grad_out, input, weight, 1e-6),
        {"grad_out": (_x(6, 8, 64, seed=9), Shard(1), False), "input": (x3, Shard(1), False), "weight": (w, None, False)},
        {"out0": (Shard(1),), "out1": P},
    )
    out["ops.layer_norm_backward-no-weight-shard0"] = (
        lambda grad_out, input: torch.ops.keel.layer_norm_backward(grad_out, input, None, None, 1e-6),
        {"grad_out": (_x(6, 8, 64, seed=9), Shard(0), False), "input": (x3, Shard(0), False)},
        {"out0": (Shard(0),), "out1": R, "out2": R},
    )
    out["fused_add_rms_norm_-in-place-shard0"] = (
        lambda input, residual, weight: _in_place_norm(input, residual, weight),
        {"input": (x3, Shard(0), False), "residual": (_x(6, 8, 64, seed=3), Shard(0), False), "weight": (w, None, False)},
        {"out0": (Shard(0),), "out1": (Shard(0),)},
    )
    out["rotary_embedding_-in-place-shard2"] = (
        lambda x, cos, sin: _in_place_rotary(x, cos, sin),
        {"x": (q, Shard(2), False), "cos": (cos, None, False), "sin": (sin, None, False)},
        {"out0": (Shard(2),)},
    )
    # Placements the rules do not take: DTensor moves the data first, to one
    # that they take (its pick; a list gives the ones that they take).
    out["rms_norm-input-sharded-on-last-dim"] = (
        lambda input, weight: keel.rms_norm(input, weight),
        {"input": (x3, Shard(2), True), "weight": (w, None, True)},
        {"out0": [R, (Shard(0),), (Shard(1),)]},
    )
    return out


def _autocast(fn, *args, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*args, **kwargs)


def _no_grad(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def _in_place_norm(input, residual, weight):
    input, residual = input.clone(), residual.clone()
    keel.fused_add_rms_norm_(input, residual, weight)
    return input, residual


def _in_place_rotary(x, cos, sin):
    x = x.clone()
    keel.rotary_embedding_(x, cos, sin)
    return x


def _partial_input(mesh):
    """rms_norm of a Partial input (a row-parallel matmul's output before its
    reduction): DTensor reduces it first."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    rank = torch.distributed.get_rank()
    parts = [_x(6, 8, 64, seed=10 + r) for r in range(WORLD)]
    w = _x(64, seed=1)
    x = DTensor.from_local(parts[rank], mesh, [Partial()])
    y = keel.rms_norm(x, distribute_tensor(w, mesh, [Replicate()]))
    return {"out0": y.full_tensor()}, {"out0": keel.rms_norm(sum(parts), w)}, {"out0": _placements(y)}


def _sequence_parallel(mesh):
    """``keel.nn.RMSNorm`` under torch's ``SequenceParallel``, against
    ``torch.nn.RMSNorm`` under the same: output and weight gradient."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    x = _x(2, 8, 64, seed=11)
    got, want, placements = {}, {}, {}
    for key, module in (("keel", keel.nn.RMSNorm(64, eps=1e-6)), ("torch", torch.nn.RMSNorm(64, eps=1e-6))):
        with torch.no_grad():
            module.weight.copy_(_x(64, seed=1))
        parallelize_module(module, mesh, SequenceParallel(use_local_output=False))
        y = module(x)
        (y * y).sum().backward()
        result = {"out0": y.full_tensor(), "dweight": module.weight.grad.full_tensor()}
        placements[f"{key}-out0"] = _placements(y)
        placements[f"{key}-dweight"] = _placements(module.weight.grad)
        (got if key == "keel" else want).update(result)
    return got, want, placements


def _compiled(mesh):
    """``torch.compile(fullgraph=True)`` of Keel ops on DTensors (aot_eager:
    Inductor gave the same on 2.15, checked by hand), forward and backward."""
    from torch.distributed.tensor import Shard

    def f(x, w):
        y = keel.rms_norm(x, w) * 2
        return keel.softmax(y, 0.5)

    return _run_case(
        mesh,
        torch.compile(f, backend="aot_eager", fullgraph=True),
        {"x": (_x(6, 8, 64), Shard(1), True), "w": (_x(64, seed=1), None, True)},
    )


def _mean_collectives(mesh):
    """The collectives of a cross-entropy "mean" (forward and backward) of logits
    sharded on their rows, by the typed API and by the op itself, as
    ``CommDebugMode`` counts them: name -> count."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    found = {}
    target = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(7))
    for key, fn in (("typed", keel.cross_entropy), ("op", torch.ops.keel.cross_entropy)):
        logits = distribute_tensor(_x(12, 50, seed=6), mesh, [Shard(0)]).requires_grad_()
        t = distribute_tensor(target, mesh, [Shard(0)])
        with CommDebugMode() as comms:
            fn(logits, t).backward()
        found[key] = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
    return found


def _compiled_mean(mesh):
    """``torch.compile(fullgraph=True)`` of the typed API's cross-entropy "mean"
    of logits sharded on their rows (:func:`keel._sharded_mean.sharded_mean`)."""
    from torch.distributed.tensor import Shard

    def f(logits, target, weight):
        return keel.cross_entropy(logits, target, weight=weight, label_smoothing=0.1)

    target = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(7))
    return _run_case(
        mesh,
        torch.compile(f, backend="aot_eager", fullgraph=True),
        {"logits": (_x(12, 50, seed=6), Shard(0), True), "target": (target, Shard(0), False), "weight": (_x(50, seed=8).abs(), None, True)},
    )


def _two_dim_mesh(mesh):
    """A ``[1, 2]`` mesh (data x tensor parallel, the second dim over both
    ranks): rms_norm's rows sharded on two dims at once, and cross-entropy's
    "mean" of logits sharded on their rows along the second mesh dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh2 = init_device_mesh("cpu", (1, WORLD))
    got, want, placements = {}, {}, {}
    x, w = _x(6, 8, 64), _x(64, seed=1)
    dx = distribute_tensor(x, mesh2, [Shard(0), Shard(1)]).requires_grad_()
    dw = distribute_tensor(w, mesh2, [Replicate(), Replicate()]).requires_grad_()
    y = keel.rms_norm(dx, dw)
    (y * y).sum().backward()
    px, pw = x.clone().requires_grad_(), w.clone().requires_grad_()
    plain = keel.rms_norm(px, pw)
    (plain * plain).sum().backward()
    for key, d, p in (("rms_norm", y, plain), ("rms_norm-dinput", dx.grad, px.grad), ("rms_norm-dweight", dw.grad, pw.grad)):
        got[key], want[key], placements[key] = d.full_tensor(), p, _placements(d)
    logits, target = _x(12, 50, seed=6), torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(7))
    dl = distribute_tensor(logits, mesh2, [Replicate(), Shard(0)]).requires_grad_()
    loss = keel.cross_entropy(dl, distribute_tensor(target, mesh2, [Replicate(), Shard(0)]), label_smoothing=0.1)
    loss.backward()
    pl = logits.clone().requires_grad_()
    want_loss = keel.cross_entropy(pl, target, label_smoothing=0.1)
    want_loss.backward()
    for key, d, p in (("cross_entropy-mean", loss, want_loss), ("cross_entropy-mean-dlogits", dl.grad, pl.grad)):
        got[key], want[key], placements[key] = d.full_tensor(), p, _placements(d)
    return got, want, placements


def _fsdp2(mesh):
    """FSDP2 (``fully_shard``: parameters sharded as DTensors, gathered for each
    module's forward and backward, gradients reduce-scattered and averaged) of
    a small model with ``keel.nn.RMSNorm`` and ``keel.cross_entropy``, each
    rank on its half of the batch, against the plain model on the whole batch."""
    import copy

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), keel.nn.RMSNorm(32), torch.nn.Linear(32, 64))
    with torch.no_grad():
        model[1].weight.copy_(_x(32, seed=1))
    plain = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, target = _x(8, 16, seed=2), torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(3))
    half = slice(4 * torch.distributed.get_rank(), 4 * torch.distributed.get_rank() + 4)
    keel.cross_entropy(model(x[half]), target[half]).backward()
    keel.cross_entropy(plain(x), target).backward()  # the mean over all 8 rows: the ranks' means averaged
    got, want, placements = {}, {}, {}
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        got[name], want[name], placements[name] = p.grad.full_tensor(), q.grad, _placements(p.grad)
    return got, want, placements


SPECIAL = {
    "fsdp2": _fsdp2,
    "two-dim-mesh": _two_dim_mesh,
    "compiled-cross_entropy-mean": _compiled_mean,
    "cross_entropy-mean-collectives": _mean_collectives,
    "rms_norm-partial-input": _partial_input,
    "keel.nn.RMSNorm-SequenceParallel": _sequence_parallel,
    "compiled": _compiled,
}


def _worker(rank, tmp, module, shape, cases, special):
    """One rank of a mesh of `shape`: every case of test module `module` (its
    function `cases` and dict `special`), the results saved by rank 0."""
    found = importlib.import_module(module)
    torch.set_num_threads(1)
    # A file store, not a TCP port: no port to collide with another run's.
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=math.prod(shape), timeout=datetime.timedelta(seconds=120)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape)
    jobs = {name: functools.partial(_run_case, fn=fn, inputs=inputs) for name, (fn, inputs, _) in getattr(found, cases)().items()}
    jobs.update(getattr(found, special))
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = job(mesh)
        except Exception:  # both ranks raise alike: the error is reported by the case's test
            results[name] = traceback.format_exc()
    if rank == 0:
        torch.save(results, os.path.join(tmp, "results.pt"))
    # Without this barrier, a rank that tears gloo down while the other still
    # writes aborted now and then ("terminate called without an active
    # exception": 2 of 8 runs of a torch-only script, none with it).
    torch.distributed.barrier()
    mark_done(tmp, rank)
    torch.distributed.destroy_process_group()


def mark_done(tmp, rank):
    """Marks `rank` past its last barrier, for :func:`_spawn`."""
    open(os.path.join(tmp, f"done{rank}"), "w").close()


def _spawn(worker, tmp, nprocs, args):
    """`worker(rank, *args)` on `nprocs` spawned processes, each of which writes
    ``done<rank>`` in `tmp` once past its last barrier (:func:`mark_done`). gloo's
    teardown still aborts a rank now and then with "terminate called without
    an active exception" (once in a compat run of torch 2.11 under load, session
    109, after the barrier above): where every rank got past its last barrier,
    such a failure is reported as a warning and the results stand."""
    try:
        torch.multiprocessing.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn")
    except torch.multiprocessing.ProcessExitedException as err:
        if not all(os.path.exists(os.path.join(tmp, f"done{r}")) for r in range(nprocs)):
            raise
        warnings.warn(f"a rank failed in gloo's teardown, after every case had run: {err}")


def spawn_results(module, shape=(WORLD,), cases="_cases", special="SPECIAL"):
    """Each case of test module `module` (its function `cases`, name -> (fn,
    inputs, placements), and its dict `special`, name -> function of the mesh)
    run on processes of a mesh of `shape`: name -> result (or the traceback of
    its error)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = (tmp, module, tuple(shape), cases, special)
        _spawn(_worker, tmp, math.prod(shape), args)
        return torch.load(os.path.join(tmp, "results.pt"), weights_only=False)


@pytest.fixture(scope="module")
def results():
    return spawn_results(__name__)


def _compare(found, scale=4.0):
    """Each result as the plain call's (NaN where it is NaN); returns the placements."""
    assert not isinstance(found, str), found
    got, want, placements = found
    assert got.keys() == want.keys()
    for key in got:
        assert torch.equal(got[key].isnan(), want[key].isnan()), key
        assert_close(got[key].nan_to_num(), want[key].nan_to_num(), want[key].dtype, scale=scale)
    return placements


@pytest.mark.parametrize("name", sorted(_cases().keys()) if torch.distributed.is_available() else [])
def test_sharded_call_matches_the_whole_call(results, name):
    op = name.split("-")[0]
    if op in INPLACE and not _inplace_rules():
        # torch 2.10: DTensor cannot run an op that returns nothing; no rule, and its error names the op.
        assert isinstance(results[name], str) and f"keel.{op}.default does not have a sharding" in results[name]
        return
    _check_placements(_compare(results[name]), _cases()[name][2])


def _inplace_rules():
    import torch.distributed.tensor  # noqa: F401  (the rules are registered on its import)
    from keel import _dtensor

    return _dtensor.INPLACE_RULES


def _check_placements(placements, expected):
    """Each placement in `expected` (a list: one of those) is the one found."""
    for key, want in expected.items():
        assert placements[key] in (want if isinstance(want, list) else [want]), (key, placements[key])


def test_partial_input_is_reduced_first(results):
    from torch.distributed.tensor import Replicate, Shard

    found = _compare(results["rms_norm-partial-input"])
    _check_placements(found, {"out0": [(Replicate(),), (Shard(0),), (Shard(1),)]})


def test_sequence_parallel_norm_matches_torchs(results):
    from torch.distributed.tensor import Shard

    placements = _compare(results["keel.nn.RMSNorm-SequenceParallel"], scale=16.0)
    assert placements["keel-out0"] == placements["torch-out0"] == (Shard(1),)
    assert placements["keel-dweight"] == placements["torch-dweight"]


_REGISTERED = """
import sys, torch
{first}
from torch.distributed.tensor import DTensor
from keel import _dtensor
rules = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
ops = [torch.ops.keel.rms_norm.default, torch.ops.keel._softmax_nograd.default, torch.ops.keel.cross_entropy_backward.default]
ops += [torch.ops.keel.rotary_embedding_.default] if _dtensor.INPLACE_RULES else []
print(all(op in rules for op in ops))
"""


@pytest.mark.parametrize(
    "first",
    [
        "import keel",
        "import torch.distributed.tensor; import keel",
        "import keel; assert 'torch.distributed.tensor' not in sys.modules",
        # A spec looked up and not executed (a test of whether it exists) leaves the hook in place.
        "import keel, importlib.util; assert importlib.util.find_spec('torch.distributed.tensor')",
    ],
    ids=["keel-first", "dtensor-first", "keel-imports-no-dtensor", "spec-looked-up-first"],
)
def test_rules_registered_whichever_is_imported_first(first):
    """The rules are in place whether DTensor was imported before Keel or after
    it; Keel itself does not import DTensor (0.46 s)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _REGISTERED.format(first=first)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_compiled_graph_of_keel_ops_on_dtensors(results):
    from torch.distributed.tensor import Partial, Replicate, Shard

    placements = _compare(results["compiled"])
    _check_placements(placements, {"out0": (Shard(1),), "dx": (Shard(1),), "dw": (Partial(),)})
    placements = _compare(results["compiled-cross_entropy-mean"])
    _check_placements(placements, {"out0": (Replicate(),), "dlogits": (Shard(0),), "dweight": (Partial(),)})


def test_cross_entropy_mean_gathers_no_logits(results):
    """The typed API's "mean" of logits sharded on their rows reduces two
    numbers and gathers nothing; the op itself gathers the logits (a check that
    the count sees a gather)."""
    found = results["cross_entropy-mean-collectives"]
    assert not isinstance(found, str), found
    assert found["typed"] == {"all_reduce": 1}, found
    assert found["op"].get("all_gather_into_tensor", 0) > 0, found


def test_two_dim_mesh(results):
    """Rules and the sharded "mean" on a ``[1, 2]`` mesh: the rows sharded on
    dims 0 and 1 at once; the loss replicated, the logits' gradient sharded."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    placements = _compare(results["two-dim-mesh"])
    _check_placements(
        placements,
        {
            "rms_norm": (Shard(0), Shard(1)),
            "rms_norm-dinput": (Shard(0), Shard(1)),
            "rms_norm-dweight": (Partial(), Partial()),
            "cross_entropy-mean": (Replicate(), Replicate()),
            "cross_entropy-mean-dlogits": (Replicate(), Shard(0)),
        },
    )


def test_fsdp2_of_keel_modules_matches_the_plain_model(results):
    from torch.distributed.tensor import Shard

    placements = _compare(results["fsdp2"])
    assert placements and all(p == (Shard(0),) for p in placements.values()), placements
