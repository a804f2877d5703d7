"""Cross-entropy of DTensor logits sharded on their classes (``keel._vocab_parallel``):
two CPU processes (gloo) on a ``[2]`` mesh, as in ``test_dtensor.py``; each
case's whole loss, lse and logits' gradient must match the same Keel call on
the plain tensors in one process (``keel.cross_entropy`` there matches torch's
in ``test_cross_entropy.py``), with the loss ``Replicate`` and the gradient
sharded on the classes, and the collectives one all-gather (no logits
gathered).
"""
import functools
import os
import traceback

import pytest
import torch

import keel
from test_dtensor import WORLD, _check_placements, _compare, _placements, _run_case, _x, spawn_results

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available in this torch build",
    ),
    pytest.mark.skipif("KEEL_QEMU_PYTHON" in os.environ, reason="under qemu-user: the sharded path is Python, tested natively"),
]

CLASSES = 52  # 26 on each rank; UNEVEN gives them 26 and 25
UNEVEN = 51


def _autocast(fn, *args, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*args, **kwargs)


def _under_loss_parallel(fn, *args, **kwargs):
    """`fn` inside torch's ``loss_parallel()``, as a recipe written for torch's
    own vocabulary-parallel loss calls it (Keel's path needs none)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return fn(*args, **kwargs)


def _plain_target(fn):
    """`fn` with the target as a plain tensor (every rank's the same), as
    ``loss_parallel`` takes it."""
    from torch.distributed.tensor import DTensor

    def call(logits, target, **kw):
        return fn(logits, target.full_tensor() if isinstance(target, DTensor) else target, **kw)

    return call


@functools.lru_cache(maxsize=None)
def _cases():
    """Case name -> (fn, inputs, expected placements of the outputs and gradients)."""
    from torch.distributed.tensor import Replicate, Shard

    R, S = (Replicate(),), (Shard(1),)
    g = torch.Generator().manual_seed(7)
    logits, target = _x(12, CLASSES, seed=6) * 3, torch.randint(0, CLASSES, (12,), generator=g)
    target[3] = -100
    cw = torch.rand(CLASSES, generator=g) + 0.1
    inputs = {"logits": (logits, Shard(1), True), "target": (target, None, False)}
    weighted = {**inputs, "weight": (cw, None, False)}
    out = {}
    for reduction in ("none", "sum", "mean"):
        for ls in (0.0, 0.1):
            out[f"cross_entropy-{reduction}-ls{ls}"] = (
                lambda logits, target, r=reduction, ls=ls: keel.cross_entropy(logits, target, reduction=r, label_smoothing=ls),
                inputs,
                {"out0": R, "dlogits": S},
            )
            out[f"cross_entropy-{reduction}-ls{ls}-weight"] = (
                lambda logits, target, weight, r=reduction, ls=ls: keel.cross_entropy(
                    logits, target, reduction=r, label_smoothing=ls, weight=weight
                ),
                weighted,
                {"out0": R, "dlogits": S},
            )
        # The lse's gradient too (a z-loss).
        out[f"cross_entropy_with_lse-{reduction}"] = (
            lambda logits, target, weight, r=reduction: keel.cross_entropy_with_lse(logits, target, reduction=r, label_smoothing=0.1, weight=weight),
            weighted,
            {"out0": R, "out1": R, "dlogits": S},
        )
    for dtype in (torch.bfloat16, torch.float64):
        out[f"cross_entropy-mean-{dtype}"] = (
            lambda logits, target, weight: keel.cross_entropy(logits, target, label_smoothing=0.1, weight=weight),
            {**weighted, "logits": (logits.to(dtype), Shard(1), True), "weight": (cw.to(dtype), None, False)},
            {"out0": R, "dlogits": S},
        )
    out["cross_entropy-mean-autocast"] = (
        lambda logits, target: _autocast(keel.cross_entropy, logits, target, label_smoothing=0.1),
        {**inputs, "logits": (logits.bfloat16(), Shard(1), True)},
        {"out0": R, "dlogits": S},
    )
    # Classes split unevenly: torch 2.10's to_local backward gives the leaf
    # DTensor's gradient Replicate there (a DTensor with 51 columns sharded by
    # torch ops alone does the same); later torch keeps it sharded.
    uneven = _x(12, UNEVEN, seed=6) * 3
    out["cross_entropy-mean-uneven-classes"] = (
        lambda logits, target, weight: keel.cross_entropy(logits, target, label_smoothing=0.1, weight=weight),
        {"logits": (uneven, Shard(1), True), "target": (target.clamp(max=UNEVEN - 1), None, False), "weight": (cw[:UNEVEN], None, True)},
        {"out0": R, "dlogits": [S, R], "dweight": R},
    )
    out["cross_entropy_with_lse-none-uneven-classes"] = (
        lambda logits, target: keel.cross_entropy_with_lse(logits, target, reduction="none"),
        {"logits": (uneven, Shard(1), True), "target": (target.clamp(max=UNEVEN - 1), None, False)},
        {"out0": R, "out1": R, "dlogits": [S, R]},
    )
    out["keel.nn.CrossEntropyLoss-under-loss_parallel"] = (
        lambda logits, target, weight: _under_loss_parallel(keel.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1), logits, target),
        weighted,
        {"out0": R, "dlogits": S},
    )
    out["cross_entropy-mean-plain-target"] = (_plain_target(keel.cross_entropy), inputs, {"out0": R, "dlogits": S})
    out["keel.nn.CrossEntropyLoss"] = (
        lambda logits, target, weight: keel.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)(logits, target),
        weighted,
        {"out0": R, "dlogits": S},
    )
    out["cross_entropy-mean-all-ignored"] = (
        lambda logits, target: keel.cross_entropy(logits, target),
        {**inputs, "target": (torch.full_like(target, -100), None, False)},
        {"out0": R, "dlogits": S},
    )
    # The second rank's classes all -inf (masked): its share of each row's
    # probability is 0, and its gradient 0; with label smoothing the loss is
    # infinite, as torch's.
    masked = logits.clone()
    masked[:, 26:] = float("-inf")
    for ls in (0.0, 0.1):
        out[f"cross_entropy-none-masked-rank-ls{ls}"] = (
            lambda logits, target, ls=ls: keel.cross_entropy_with_lse(logits, target, reduction="none", label_smoothing=ls),
            {"logits": (masked, Shard(1), True), "target": (target.clamp(0, 25), None, False)},
            {"out0": R, "out1": R, "dlogits": S},
        )
    nan = logits.clone()
    nan[2, 40] = float("nan")
    out["cross_entropy-none-nan-logit"] = (
        lambda logits, target: keel.cross_entropy(logits, target, reduction="none"),
        {**inputs, "logits": (nan, Shard(1), True)},
        {"out0": R, "dlogits": S},
    )
    out["cross_entropy-mean-no-grad"] = (
        lambda logits, target: keel.cross_entropy(logits.detach(), target),
        {**inputs, "logits": (logits, Shard(1), False)},
        {"out0": R},
    )
    # Class weights that need a gradient: whole on every rank.
    for reduction in ("none", "sum", "mean"):
        for ls in (0.0, 0.1):
            out[f"cross_entropy-{reduction}-ls{ls}-weight-grad"] = (
                lambda logits, target, weight, r=reduction, ls=ls: keel.cross_entropy(
                    logits, target, weight=weight, reduction=r, label_smoothing=ls
                ),
                {**weighted, "weight": (cw, None, True)},
                {"out0": R, "dlogits": S, "dweight": R},
            )
    out["cross_entropy-mean-bfloat16-weight-grad"] = (
        lambda logits, target, weight: keel.cross_entropy(logits, target, weight=weight, label_smoothing=0.1),
        {**weighted, "logits": (logits.bfloat16(), Shard(1), True), "weight": (cw.bfloat16(), None, True)},
        {"out0": R, "dlogits": S, "dweight": R},
    )
    # [N, V, d] logits (classes in dim 1), taken as rows [N d, V] (keel.functional's other layouts).
    x3, t3 = _x(4, CLASSES, 3, seed=6) * 3, torch.randint(0, CLASSES, (4, 3), generator=g)
    t3[1, 2] = -100
    for reduction in ("none", "mean"):
        out[f"cross_entropy-{reduction}-N-V-d"] = (
            lambda logits, target, weight, r=reduction: keel.cross_entropy(logits, target, reduction=r, label_smoothing=0.1, weight=weight),
            {"logits": (x3, Shard(1), True), "target": (t3, None, False), "weight": (cw, None, True)},
            {"out0": R, "dlogits": S, "dweight": R},
        )
    # [N, V, d] sharded on d only: its rows (d moved first), the op's row rules;
    # d = 3 is split unevenly, which DTensor cannot flatten: gathered along d.
    x4, t4 = _x(4, CLASSES, 4, seed=6) * 3, torch.randint(0, CLASSES, (4, 4), generator=g)
    for d, (x_d, t_d) in ((4, (x4, t4)), (3, (x3, t3))):
        for reduction in ("none", "mean"):
            out[f"cross_entropy-{reduction}-N-V-d{d}-sharded-on-d"] = (
                lambda logits, target, r=reduction: keel.cross_entropy(logits, target, reduction=r, label_smoothing=0.1),
                {"logits": (x_d, Shard(2), True), "target": (t_d, Shard(1), False)},
                {
                    "out0": (Shard(1),) if reduction == "none" else R,
                    "dlogits": (Shard(2),),
                } if d == 4 else {"out0": [(Shard(1),), R], "dlogits": [(Shard(2),), R]},
            )
    # Not taken: the op itself runs whole (the logits gathered).
    out["ops.cross_entropy-mean"] = (lambda logits, target: torch.ops.keel.cross_entropy(logits, target), inputs, {"out0": R})
    return out


def _collectives(mesh):
    """What a cross-entropy "mean" of logits sharded on their classes (forward
    and backward) sends, by the typed API and by the op, as ``CommDebugMode``
    counts it: name -> count."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    found = {}
    target = torch.randint(0, CLASSES, (12,), generator=torch.Generator().manual_seed(7))
    for key, fn, shape in (
        ("typed", keel.cross_entropy, (12, CLASSES)),
        ("op", torch.ops.keel.cross_entropy, (12, CLASSES)),
        ("typed [N, V, d]", keel.cross_entropy, (4, CLASSES, 3)),
    ):
        logits = distribute_tensor(_x(*shape, seed=6), mesh, [Shard(1)]).requires_grad_()
        t = distribute_tensor(target.view(-1, *shape[2:]), mesh, [Replicate()])
        with CommDebugMode() as comms:
            fn(logits, t).backward()
        found[key] = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
    return found


def _bad_target(mesh):
    """The error of a target out of range for the whole rows' classes (each
    rank's own range would take it for another rank's)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    logits = distribute_tensor(_x(4, CLASSES, seed=6), mesh, [Shard(1)])
    try:
        keel.cross_entropy(logits, torch.tensor([0, CLASSES, 1, -100]))
    except RuntimeError as err:
        return str(err)
    return "no error"


def _two_dim_mesh(mesh):
    """A ``[1, 2]`` mesh, the classes sharded along its second dim and the rows
    replicated along the first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh2 = init_device_mesh("cpu", (1, WORLD))
    logits, target = _x(12, CLASSES, seed=6), torch.randint(0, CLASSES, (12,), generator=torch.Generator().manual_seed(7))
    dl = distribute_tensor(logits, mesh2, [Replicate(), Shard(1)]).requires_grad_()
    loss = keel.cross_entropy(dl, target, label_smoothing=0.1)
    loss.backward()
    pl = logits.clone().requires_grad_()
    want = keel.cross_entropy(pl, target, label_smoothing=0.1)
    want.backward()
    got = {"out0": loss.full_tensor(), "dlogits": dl.grad.full_tensor()}
    return got, {"out0": want, "dlogits": pl.grad}, {"out0": _placements(loss), "dlogits": _placements(dl.grad)}


def _compiled(mesh):
    """``torch.compile(fullgraph=True)`` (aot_eager) of the sharded path, with
    class weights that need a gradient and label smoothing (not on torch 2.11):
    on a 1-D mesh the classes sharded, on the ``ROWS_MESH`` the rows too."""
    from torch.distributed.tensor import Replicate, Shard

    from keel import _vocab_parallel

    if _vocab_parallel._TORCH == (2, 11):
        return "not run"

    def f(logits, target, weight):
        return keel.cross_entropy(logits, target, weight=weight, label_smoothing=0.1)

    target = torch.randint(0, CLASSES, (12,), generator=torch.Generator().manual_seed(7))
    x_p, t_p = (Shard(1), None) if mesh.ndim == 1 else ((Shard(0), Shard(1)), (Shard(0), Replicate()))
    return _run_case(
        mesh,
        torch.compile(f, backend="aot_eager", fullgraph=True),
        {"logits": (_x(12, CLASSES, seed=6), x_p, True), "target": (target, t_p, False), "weight": (_x(CLASSES, seed=8).abs(), None, True)},
    )


SPECIAL = {"collectives": _collectives, "bad-target": _bad_target, "two-dim-mesh": _two_dim_mesh, "compiled": _compiled}

# A (2, 2) mesh: the rows sharded along one mesh dim (data parallelism), the
# classes along the other, as torch 2.15's loss_parallel takes them.
ROWS_MESH = (2, 2)


@functools.lru_cache(maxsize=None)
def _row_cases():
    """Case name -> (fn, inputs, expected placements) on the ``ROWS_MESH``: logits
    ``(Shard(0), Shard(1))`` (or the mesh dims the other way round), the target
    a DTensor sharded as the rows."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    g = torch.Generator().manual_seed(7)
    logits, target = _x(12, CLASSES, seed=6) * 3, torch.randint(0, CLASSES, (12,), generator=g)
    target[3] = -100
    cw = torch.rand(CLASSES, generator=g) + 0.1
    out = {}
    for order in ("rows-classes", "classes-rows"):
        x_p, t_p = (Shard(0), Shard(1)), (Shard(0), Replicate())
        if order == "classes-rows":
            x_p, t_p = x_p[::-1], t_p[::-1]
        rows, whole = t_p, (Replicate(), Replicate())
        summed = tuple(Partial() if p.is_shard() else p for p in t_p)
        loss = {"none": rows, "sum": summed, "mean": whole}
        inputs = {"logits": (logits, x_p, True), "target": (target, t_p, False)}
        for reduction in ("none", "sum", "mean"):
            for ls in (0.0, 0.1):
                out[f"{order}-{reduction}-ls{ls}"] = (
                    lambda logits, target, r=reduction, ls=ls: keel.cross_entropy(logits, target, reduction=r, label_smoothing=ls),
                    inputs,
                    {"out0": loss[reduction], "dlogits": x_p},
                )
                # Class weights that need a gradient: Partial over the rows, as the norms' weights'.
                out[f"{order}-{reduction}-ls{ls}-weight-grad"] = (
                    lambda logits, target, weight, r=reduction, ls=ls: keel.cross_entropy(
                        logits, target, weight=weight, reduction=r, label_smoothing=ls
                    ),
                    {**inputs, "weight": (cw, None, True)},
                    {"out0": loss[reduction], "dlogits": x_p, "dweight": summed},
                )
            out[f"{order}-cross_entropy_with_lse-{reduction}"] = (
                lambda logits, target, weight, r=reduction: keel.cross_entropy_with_lse(
                    logits, target, reduction=r, label_smoothing=0.1, weight=weight
                ),
                {**inputs, "weight": (cw, None, False)},
                {"out0": loss[reduction], "out1": rows, "dlogits": x_p},
            )
        # A replicated target: each rank takes its rows' slice.
        out[f"{order}-mean-replicated-target"] = (
            lambda logits, target: keel.cross_entropy(logits, target, label_smoothing=0.1),
            {**inputs, "target": (target, None, False)},
            {"out0": whole, "dlogits": x_p},
        )
    R2, rows, x_p, P = (Replicate(), Replicate()), (Shard(0), Replicate()), (Shard(0), Shard(1)), (Partial(), Replicate())
    out["rows-classes-mean-bfloat16"] = (
        lambda logits, target, weight: keel.cross_entropy(logits, target, label_smoothing=0.1, weight=weight),
        {"logits": (logits.bfloat16(), x_p, True), "target": (target, rows, False), "weight": (cw.bfloat16(), None, True)},
        {"out0": R2, "dlogits": x_p, "dweight": P},
    )
    out["rows-classes-keel.nn.CrossEntropyLoss"] = (
        lambda logits, target: keel.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, target),
        {"logits": (logits, x_p, True), "target": (target, rows, False)},
        {"out0": R2, "dlogits": x_p},
    )
    # Rows split unevenly (6 and 5), and one row only (the second data-parallel
    # rank's share empty: there torch 2.10's DTensor gives the weights' gradient
    # of a "mean" Replicate, later torch Partial).
    for n in (11, 1):
        for reduction in ("none", "mean"):
            out[f"rows-classes-{reduction}-{n}-rows"] = (
                lambda logits, target, weight, r=reduction: keel.cross_entropy_with_lse(
                    logits, target, reduction=r, label_smoothing=0.1, weight=weight
                ),
                {"logits": (logits[:n], x_p, True), "target": (target[:n], rows, False), "weight": (cw, None, True)},
                {"out0": rows if reduction == "none" else R2, "out1": rows, "dlogits": x_p, "dweight": [P, R2] if n == 1 else P},
            )
    # [N, V, d] logits, taken as rows [N d, V], the rows sharded on N.
    x3, t3 = _x(4, CLASSES, 3, seed=6) * 3, torch.randint(0, CLASSES, (4, 3), generator=g)
    t3[1, 2] = -100
    x4, t4 = _x(4, CLASSES, 4, seed=6) * 3, torch.randint(0, CLASSES, (4, 4), generator=g)
    for reduction in ("none", "sum", "mean"):
        out[f"rows-classes-{reduction}-N-V-d"] = (
            lambda logits, target, r=reduction: keel.cross_entropy(logits, target, reduction=r, label_smoothing=0.1),
            {"logits": (x3, x_p, True), "target": (t3, rows, False)},
            {"out0": {"none": rows, "sum": P, "mean": R2}[reduction], "dlogits": x_p},
        )
        # N = 3, split unevenly (2 and 1), which DTensor does not flatten: gathered first
        # (the gradient then as DTensor gives it back: torch 2.10 whole).
        out[f"rows-classes-{reduction}-N-V-d-uneven-N"] = (
            lambda logits, target, r=reduction: keel.cross_entropy(logits, target, reduction=r, label_smoothing=0.1),
            {"logits": (x4[:3], x_p, True), "target": (t4[:3], rows, False)},
            {"out0": [rows, R2] if reduction == "none" else [P, R2] if reduction == "sum" else R2, "dlogits": [x_p, (Replicate(), Shard(1)), R2]},
        )
        # Sharded on d instead (torch's (batch, class, seq) layout): d moved first, then flattened.
        x4_p, t4_p = (Shard(2), Shard(1)), (Shard(1), Replicate())
        out[f"rows-classes-{reduction}-N-V-d-sharded-on-d"] = (
            lambda logits, target, r=reduction: keel.cross_entropy(logits, target, reduction=r, label_smoothing=0.1),
            {"logits": (x4, x4_p, True), "target": (t4, t4_p, False)},
            {"out0": {"none": t4_p, "sum": P, "mean": R2}[reduction], "dlogits": x4_p},
        )
    return out


def _rows_collectives(mesh):
    """What the typed API sends (forward and backward) for each reduction of
    logits sharded on their rows and classes: name -> count, by reduction."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    found = {}
    target = torch.randint(0, CLASSES, (12,), generator=torch.Generator().manual_seed(7))
    rows = ((12, CLASSES), [Shard(0), Shard(1)], [Shard(0), Replicate()])
    # [N, V, d] sharded on d (torch's (batch, class, seq) layout).
    spatial = ((3, CLASSES, 4), [Shard(2), Shard(1)], [Shard(1), Replicate()])
    for key, reduction, (shape, x_p, t_p) in (
        ("none", "none", rows), ("sum", "sum", rows), ("mean", "mean", rows), ("mean [N, V, d], d sharded", "mean", spatial)
    ):
        logits = distribute_tensor(_x(*shape, seed=6), mesh, x_p).requires_grad_()
        t = distribute_tensor(target.view(-1, *shape[2:]), mesh, t_p)
        with CommDebugMode() as comms:
            loss = keel.cross_entropy(logits, t, reduction=reduction, label_smoothing=0.1)
            loss.backward(torch.ones_like(loss))
        found[key] = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
    return found


def _rows_errors(mesh):
    """Each rank's error (or "no error") for a plain target, for a target on
    another mesh (the data-parallel dim's), and for a target out of range in
    the second data-parallel rank's rows (whole row 8)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    logits = distribute_tensor(_x(12, CLASSES, seed=6), mesh, [Shard(0), Shard(1)])
    target = torch.randint(0, CLASSES, (12,), generator=torch.Generator().manual_seed(7))
    bad = target.clone()
    bad[8] = CLASSES
    found = {}
    rows = init_device_mesh("cpu", ROWS_MESH, mesh_dim_names=("dp", "tp"))["dp"]
    for name, t in (
        ("plain", target),
        ("other-mesh", distribute_tensor(target, rows, [Shard(0)])),
        ("out-of-range", distribute_tensor(bad, mesh, [Shard(0), Replicate()])),
    ):
        try:
            keel.cross_entropy(logits, t, reduction="none")
            err = "no error"
        except RuntimeError as e:
            err = str(e)
        every = [None] * mesh.size()
        torch.distributed.all_gather_object(every, err)
        found[name] = every
    return found


def _rows_plain_weight(mesh):
    """Class weights as a plain tensor that needs a gradient, by reduction:
    (got, want, placements), the gradient whole on every rank (rank 0's here;
    ``rows_plain_weight_ranks`` compares the ranks')."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    logits = _x(12, CLASSES, seed=6) * 3
    target = torch.randint(0, CLASSES, (12,), generator=torch.Generator().manual_seed(7))
    cw = torch.rand(CLASSES, generator=torch.Generator().manual_seed(8)) + 0.1
    found = {}
    for reduction in ("none", "sum", "mean"):
        try:
            dl = distribute_tensor(logits, mesh, [Shard(0), Shard(1)]).requires_grad_()
            dt = distribute_tensor(target, mesh, [Shard(0), Replicate()])
            w = cw.clone().requires_grad_()
            loss = keel.cross_entropy(dl, dt, weight=w, reduction=reduction, label_smoothing=0.1)
            seed = torch.randn(loss.shape, generator=torch.Generator().manual_seed(9))
            loss.backward(distribute_tensor(seed, mesh, [Replicate() if p.is_partial() else p for p in loss.placements]))
            pl, pw = logits.clone().requires_grad_(), cw.clone().requires_grad_()
            want = keel.cross_entropy(pl, target, weight=pw, reduction=reduction, label_smoothing=0.1)
            want.backward(seed)
            every = [None] * mesh.size()
            torch.distributed.all_gather_object(every, w.grad)
            got = {"out0": loss.full_tensor(), "dlogits": dl.grad.full_tensor(), "dweight": w.grad}
            found[reduction] = ((got, {"out0": want, "dlogits": pl.grad, "dweight": pw.grad}, {}), every)
        except Exception:
            found[reduction] = traceback.format_exc()
    return found


ROW_SPECIAL = {"collectives": _rows_collectives, "errors": _rows_errors, "compiled": _compiled, "plain-weight": _rows_plain_weight}


@pytest.fixture(scope="module")
def results():
    return spawn_results(__name__)


@pytest.mark.parametrize("name", sorted(_cases().keys()) if torch.distributed.is_available() else [])
def test_sharded_call_matches_the_whole_call(results, name):
    _check_placements(_compare(results[name]), _cases()[name][2])


def test_one_all_gather_and_no_logits_gathered(results):
    """The typed API's forward and backward send one all-gather (of a few
    numbers a row); the op itself gathers the logits (more than one)."""
    found = results["collectives"]
    assert not isinstance(found, str), found
    assert found["typed"] == {"all_gather_into_tensor": 1}, found
    assert found["typed [N, V, d]"] == {"all_gather_into_tensor": 1}, found
    assert found["op"].get("all_gather_into_tensor", 0) > 1, found


def test_target_out_of_range_is_an_error_naming_it(results):
    assert results["bad-target"] == (
        f"keel::cross_entropy: argument 'target' holds {CLASSES} at row 1, out of range for {CLASSES} classes (and not ignore_index = -100)"
    )


def test_two_dim_mesh(results):
    from torch.distributed.tensor import Replicate, Shard

    placements = _compare(results["two-dim-mesh"])
    _check_placements(placements, {"out0": (Replicate(), Replicate()), "dlogits": (Replicate(), Shard(1))})


def test_compiled(results):
    from torch.distributed.tensor import Replicate, Shard

    from keel import _vocab_parallel

    if _vocab_parallel._TORCH == (2, 11):
        # torch 2.11 compiled the path with the logits' gradient 0, so there a
        # compiled call goes to the op (which gathers; its own compiled case is
        # in test_dtensor.py). 2.10 and 2.12 to 2.15 compile it right.
        pytest.skip(f"the class-sharded path is not compiled on torch 2.11; this is {torch.__version__}")

    placements = _compare(results["compiled"])
    _check_placements(placements, {"out0": (Replicate(),), "dlogits": (Shard(1),), "dweight": (Replicate(),)})


@pytest.fixture(scope="module")
def row_results():
    return spawn_results(__name__, shape=ROWS_MESH, cases="_row_cases", special="ROW_SPECIAL")


@pytest.mark.parametrize("name", sorted(_row_cases().keys()) if torch.distributed.is_available() else [])
def test_rows_sharded_too_matches_the_whole_call(row_results, name):
    """Logits sharded on their rows along one mesh dim and on their classes
    along the other: the whole results as the plain call's, the losses sharded
    as the rows (``"none"``), ``Partial`` there (``"sum"``) or whole (``"mean"``)."""
    _check_placements(_compare(row_results[name]), _row_cases()[name][2])


def test_rows_sharded_too_gathers_no_logits(row_results):
    """One all-gather a call, over the classes' mesh dim (of a few numbers a row);
    a ``"mean"`` adds one all-reduce (of two numbers), over the rows' mesh dim."""
    found = row_results["collectives"]
    assert not isinstance(found, str), found
    assert found == {
        "none": {"all_gather_into_tensor": 1},
        "sum": {"all_gather_into_tensor": 1},
        "mean": {"all_gather_into_tensor": 1, "all_reduce": 1},
        "mean [N, V, d], d sharded": {"all_gather_into_tensor": 1, "all_reduce": 1},
    }, found


def test_rows_sharded_too_errors(row_results):
    """A plain target is refused (which rows would it be?), naming the
    placements to give it, as is one on another mesh; a target out of range is reported by the ranks
    whose rows hold it, with its whole row's index."""
    found = row_results["errors"]
    assert not isinstance(found, str), found
    plain = (
        "keel::cross_entropy: argument 'target' must be a DTensor where the logits' rows are sharded "
        "(logits placements (Shard(dim=0), Shard(dim=1))), got a plain tensor: "
        "distribute it with placements (Shard(dim=0), Replicate()), as the rows are"
    )
    assert found["plain"] == [plain] * 4
    for err in found["other-mesh"]:
        assert err.startswith("keel::cross_entropy: argument 'target' is a DTensor on another mesh than the logits' ("), err
        assert err.endswith("give it the logits' mesh, with placements (Shard(dim=0), Replicate())"), err
    bad = f"keel::cross_entropy: argument 'target' holds {CLASSES} at row 8, out of range for {CLASSES} classes (and not ignore_index = -100)"
    # Ranks 0 and 1 hold rows 0 to 5; ranks 2 and 3 rows 6 to 11.
    assert found["out-of-range"] == ["no error", "no error", bad, bad], found


def test_rows_sharded_too_compiled(row_results):
    from torch.distributed.tensor import Partial, Replicate, Shard

    from keel import _vocab_parallel

    if _vocab_parallel._TORCH == (2, 11):
        pytest.skip(f"the class-sharded path is not compiled on torch 2.11; this is {torch.__version__}")
    placements = _compare(row_results["compiled"])
    _check_placements(placements, {"out0": (Replicate(), Replicate()), "dlogits": (Shard(0), Shard(1)), "dweight": (Partial(), Replicate())})


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_rows_sharded_too_plain_weight_gradient_is_whole(row_results, reduction):
    """Class weights as a plain tensor: each rank's gradient is the whole one
    (the rows' shares summed across the ranks), the same on every rank."""
    found = row_results["plain-weight"][reduction]
    assert not isinstance(found, str), found
    result, every = found
    _compare(result)
    for grad in every:
        assert torch.equal(grad, every[0])
