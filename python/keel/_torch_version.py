"""Where torch's autograd machinery does not serve a custom op, the ops'
torch-op versions: forward-mode AD and ``torch.func`` through bare
``torch.ops.keel``.

- Forward-mode AD: torch runs a custom op's kernels on the primals of dual
  tensors and drops their tangents without a word (a jvp of zero).
- ``torch.func`` transforms (grad, vjp, jacrev, hessian ...): torch runs no
  custom op's Python autograd inside them (an ``autograd.Function`` without
  ``setup_context``, as the formulas are, raises there).

The typed API (``keel.rms_norm`` ...) has long taken the op's torch-op version
in both (``_twice.through_torch``); the ops' own autograd kernels
(``_autograd._autograd_kernel``) now do the same. With tangents
(:func:`with_tangents`), Keel's kernel runs on the primals first (its checks,
so errors are Keel's, and the empty stand-ins of the outputs that have no
torch-op version), then the torch-op version (:data:`REFS`) gives the values
and the tangents; where grad mode is on and an argument requires a gradient,
that also records a reverse graph (forward-over-reverse works), else no graph
is kept. Inside a transform (:func:`in_transform`), Keel's checks run on meta
stand-ins, as the typed API's do.
"""
import torch
from torch.autograd import forward_ad as _fwad

from . import _backward_grad, _fake, _twice


def _first(fn):
    def first(*args):
        return fn(*args)[0]

    return first


REFS = {
    "rms_norm": _twice.rms_norm,
    "layer_norm": _twice.layer_norm,
    "fused_add_rms_norm": _twice.fused_add_rms_norm,
    "silu_and_mul": _twice.gated,
    "gelu_and_mul": _twice.gated,
    "softmax": _twice.softmax,
    "cross_entropy": _first(_twice.cross_entropy),
    "cross_entropy_with_lse": _twice.cross_entropy,
    "rotary_embedding": _twice.rotary,
    **_backward_grad.REFS,
}
"""Each op with an autograd kernel in torch's differentiable ops, called with
all of the op's arguments (defaults filled in); None for an output that is an
empty stand-in (``_backward_grad.REFS``)."""


def on() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level()`` (one attribute read:
    every call through an op's autograd kernel asks)."""
    return _fwad._current_level >= 0


def has_tangent(args) -> bool:
    """Whether a tensor among `args` is dual (carries a tangent)."""
    return any(isinstance(a, torch.Tensor) and _fwad.unpack_dual(a).tangent is not None for a in args)


def _primal(a):
    return _fwad.unpack_dual(a).primal.detach() if isinstance(a, torch.Tensor) else a


def _without_graph(t):
    """`t` with its tangent and no reverse graph."""
    primal, tangent = _fwad.unpack_dual(t)
    return primal.detach() if tangent is None else _fwad.make_dual(primal.detach(), tangent.detach())


def with_tangents(twin, name, args):
    """Op `name` on `args` (all given) where one carries a tangent: `twin` (the op's
    ``_nograd`` twin) on the primals, then the torch-op version with the tangents."""
    with torch.no_grad():
        plain = twin(*[_primal(a) for a in args])
    graph = torch.is_grad_enabled() and torch._C._any_requires_grad(*args)
    # The backward ops' versions take gradients of the forward's: a graph is needed.
    with torch.enable_grad():
        out = REFS[name](*args)
    single = not isinstance(plain, tuple)
    plain = (plain,) if single else plain
    out = out if isinstance(out, tuple) else (out,)
    # In the kernel's dtypes (a weight's gradient is in the input's, not the weight's).
    out = [None if o is None else o.to(p.dtype) for o, p in zip(out, plain)]
    result = tuple(p if o is None else o if graph else _without_graph(o) for o, p in zip(out, plain))
    return result[0] if single else result


def in_transform(op, twin, name, args):
    """Op `name` (overload `op`) on `args` (all given) inside a ``torch.func``
    transform: Keel's checks (its `twin`'s Meta kernel; errors name `op`) on meta
    stand-ins, then the torch-op version."""
    _twice._check_on_meta(lambda _, *a: twin(*a), op, args)
    out = REFS[name](*args)
    if not isinstance(out, tuple):
        return out
    if len(twin._schema.returns) == 1:
        return out[0]
    if all(o is not None for o in out):
        return out
    # A missing weight's empty stand-in, as the kernel gives it: [0], of the input's dtype.
    meta = _fake.meta_outputs(twin, args, {})
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    return tuple(torch.empty(m.shape, dtype=m.dtype, device=device) if o is None else o for o, m in zip(out, meta))
