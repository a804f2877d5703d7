"""Sharding rules: Keel's ops on ``torch.distributed.tensor.DTensor``.

Without a rule, DTensor refuses a custom op ("does not have a sharding strategy
registered"), so a Keel norm under tensor or sequence parallelism (torch's
``SequenceParallel`` shards the norm's input on the sequence dim) could not run.
Keel's ops work row by row, so each rank can run the kernel on its own rows:

- an op's row tensors (``input``, ``residual``, the gradients, softmax's
  ``output``, cross-entropy's ``logits``, ``target`` and ``lse``) sharded alike
  on any dim but the last (the one each row spans; cross-entropy's ``N`` only,
  rotary's batch, seq or heads), its per-feature tensors (``weight``, ``bias``;
  rotary's ``cos`` and ``sin``, which are sharded as ``x`` is on seq) whole on
  every rank: the outputs come out sharded as the rows were;
- the norms' backward ops return each rank's share of the weight and bias
  gradients, summed over its rows: ``Partial`` (DTensor adds them up where they
  are read, as for torch's own norms);
- cross-entropy with ``reduction="sum"`` gives each rank's share of the sum
  (``Partial``); ``"mean"`` divides by the weight of all ranks' rows, so the op
  runs it whole: every rank gathers the logits first. ``keel.cross_entropy``
  and ``keel.cross_entropy_with_lse`` (and so ``keel.nn.CrossEntropyLoss``) do
  not call the op for it (``keel._sharded_mean``): they add up the ``"none"``
  losses of each rank's rows, and reduce that sum and the rows' weight across
  the ranks, two numbers. Logits sharded on their classes (a tensor-parallel
  vocabulary) need whole rows for the op, so the typed functions run them in
  ``keel._vocab_parallel`` instead: each rank on its own classes (and rows,
  where another mesh dim shards them), one all-gather of a few numbers a row.

Every op also runs whole (every tensor replicated). DTensor picks among these
the one that moves the least data, and moves the arguments there first (a
``Partial`` input is reduced, a tensor sharded on its last dim resharded).
Registered for each op and its ``_nograd`` twin, which the autograd formulas
call. ``torch.distributed.tensor`` takes 0.46 s to import
(measured), so Keel does not import it: the rules are registered where it has
been imported, or else right after it is.
"""
import importlib.abc
import sys
import warnings

import torch

from ._common import INPLACE, nograd

_MODULE = "torch.distributed.tensor"

# The schema names of each kind of argument.
_ROWS = {"input", "residual", "grad_out", "grad_sum", "sum", "output", "x", "logits", "target", "lse", "grad"}
_SEQ = {"cos", "sin"}  # [seq, rotary_dim / 2]: sharded as x is on its seq dim (1)

# Op -> the output kinds: "rows" (sharded as the rows), or the name of the
# per-feature argument whose gradient (a sum over rows) it is.
OUTPUTS = {
    "rms_norm": ("rows",),
    "layer_norm": ("rows",),
    "fused_add_rms_norm": ("rows", "rows"),
    "fused_add_rms_norm_": (),
    "silu_and_mul": ("rows",),
    "gelu_and_mul": ("rows",),
    "softmax": ("rows",),
    "rotary_embedding": ("rows",),
    "rotary_embedding_": (),
    "cross_entropy": ("loss",),
    "cross_entropy_with_lse": ("loss", "rows"),
    "rms_norm_backward": ("rows", "weight"),
    "layer_norm_backward": ("rows", "weight", "bias"),
    "fused_add_rms_norm_backward": ("rows", "weight"),
    "silu_and_mul_backward": ("rows",),
    "gelu_and_mul_backward": ("rows",),
    "softmax_backward": ("rows",),
    "rotary_embedding_backward": ("rows",),
    "cross_entropy_backward": ("rows",),
}

# The ops whose rows are [batch, seq, heads, head_dim] (rotary): sharded on any
# of the first three, cos and sin along with seq.
_ROTARY = {"rotary_embedding", "rotary_embedding_", "rotary_embedding_backward"}


def _is_spec(a) -> bool:
    """Whether `a` stands for a tensor argument (DTensor's spec of it)."""
    return hasattr(a, "placements")


def strategies(name, names, args, kwargs):
    """The acceptable shardings of op `name` called with `args` and `kwargs`
    (tensors as DTensor's specs; `names` the schema's argument names), in
    ``register_sharding``'s form: (output placements, input placements) pairs,
    an input's None where it is not a tensor."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    given = list(zip(names, args)) + list(kwargs.items())
    values = dict(given)
    outputs = OUTPUTS[name]
    whole = ([Replicate()] * len(outputs), [Replicate() if _is_spec(a) else None for _, a in given])
    first = max((a for n, a in given if n in _ROWS and _is_spec(a)), key=lambda a: a.ndim)
    reduction = values.get("reduction", "mean")
    if name.startswith("cross_entropy"):
        if reduction == "mean" or first.ndim != 2:
            return [whole]
        dims = [0]  # N
    elif name in _ROTARY:
        dims = [0, 1, 2] if first.ndim == 4 else []
    else:
        dims = list(range(first.ndim - 1))
    found = [whole]
    for d in dims:
        inputs = []
        for n, a in given:
            if not _is_spec(a):
                inputs.append(None)
            elif n in _ROWS and a.ndim > 0:
                inputs.append(Shard(d))
            elif n in _SEQ and name in _ROTARY and d == 1:
                inputs.append(Shard(0))
            else:  # a per-feature tensor, or a reduced loss's 0-dim gradient
                inputs.append(Replicate())
        outs = []
        for kind in outputs:
            if kind == "rows":
                outs.append(Shard(d))
            elif kind == "loss":
                outs.append(Shard(d) if reduction == "none" else Partial())
            else:  # the gradient of a per-feature argument: an empty tensor without it
                outs.append(Partial() if _is_spec(values.get(kind)) else Replicate())
        found.append((outs, inputs))
    return found


def _rule(name, overload):
    names = [a.name for a in overload._schema.arguments]

    def rule(*args, **kwargs):
        return strategies(name, names, args, kwargs)

    return rule


# Whether the in-place ops got rules: not where DTensor cannot run an op that
# returns nothing (:func:`runs_ops_returning_nothing`).
INPLACE_RULES = False


def runs_ops_returning_nothing() -> bool:
    """Whether this torch's DTensor can run an op that returns nothing, as the
    in-place ops do. torch 2.10's cannot: its sharding propagation reads the
    first return's type (``OpSchema.return_type_tensor``: IndexError); 2.11's
    to 2.15's can (tested)."""
    from torch.distributed.tensor._op_schema import OpSchema

    try:
        return OpSchema(torch.ops.keel.rotary_embedding_.default, (), {}).return_type_tensor() is False
    except Exception:
        return False


def register_now() -> None:
    """Registers the sharding rules of every op in :data:`OUTPUTS` and its twin
    (the in-place ops' where :func:`runs_ops_returning_nothing`: elsewhere DTensor
    refuses them as ops without a rule, which names them)."""
    global INPLACE_RULES
    from torch.distributed.tensor.experimental import register_sharding

    INPLACE_RULES = runs_ops_returning_nothing()
    for name in OUTPUTS:
        inplace = name in INPLACE
        if inplace and not INPLACE_RULES:
            continue
        for target in [name] if inplace else [name, nograd(name)]:
            overload = getattr(torch.ops.keel, target).default
            register_sharding(overload)(_rule(name, overload))


def _register_or_warn() -> None:
    try:
        register_now()
    except Exception as err:  # never break the user's import of DTensor
        warnings.warn(f"keel: Keel's ops have no DTensor sharding rules in this torch: {err!r}", stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the rules once ``torch.distributed.tensor`` has been imported:
    its spec comes from the finders after this one, with the loader's
    ``exec_module`` wrapped. The finder stays in place until the module has run,
    so a spec that is only looked up (``importlib.util.find_spec``, to test
    whether it exists) and never executed does not use it up."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register_or_warn()

        spec.loader.exec_module = exec_module
        return spec


def register() -> None:
    """The rules now, if ``torch.distributed.tensor`` is imported; else once it is."""
    if not torch.distributed.is_available():
        return
    if _MODULE in sys.modules:
        _register_or_warn()
    else:
        sys.meta_path.insert(0, _AfterImport())
