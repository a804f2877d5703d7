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
(:func:`with_tangents`), in forward mode alone rms_norm, fused_add_rms_norm,
softmax and cross-entropy run torch's own op after Keel's checks on meta
stand-ins, as the typed API's do; else Keel's kernel runs on the primals first (its checks,
so errors are Keel's, and the empty stand-ins of the outputs that have no
torch-op version), then the torch-op version (:data:`REFS`) gives the values
and the tangents (and a reverse graph, where grad mode is on and an argument
requires a gradient: forward-over-reverse works). Inside a transform
(:func:`in_transform`), Keel's checks run on meta stand-ins, as the typed
API's do, and the norms, softmax and cross-entropy run torch's own op where the
typed API's would.
"""
import torch

from . import _backward_grad, _func, _twice


REFS = {
    "rms_norm": _twice.rms_norm,
    "layer_norm": _twice.layer_norm,
    "fused_add_rms_norm": _twice.fused_add_rms_norm,
    "silu_and_mul": _twice.gated,
    "gelu_and_mul": _twice.gated,
    "softmax": _twice.softmax,
    "cross_entropy": _twice.cross_entropy_loss,
    "cross_entropy_with_lse": _twice.cross_entropy,
    "rotary_embedding": _twice.rotary,
    **_backward_grad.REFS,
}
"""Each op with an autograd kernel in torch's differentiable ops, called with
all of the op's arguments (defaults filled in); None for an output that is an
empty stand-in (``_backward_grad.REFS``)."""


def _returned(out, single, stand_ins):
    """`out` (a torch-op version's result) as the op returns it: one tensor
    where `single`, else a tuple with `stand_ins()`'s tensors where `out` has None."""
    if single:
        return out[0] if isinstance(out, tuple) else out
    if all(o is not None for o in out):
        return out
    return tuple(s if o is None else o for o, s in zip(out, stand_ins()))


def with_tangents(op, twin, name, args):
    """Op `name` (overload `op`) on `args` (all given) where one carries a
    tangent: torch's own op where ``_func.route`` gives one (forward mode alone:
    rms_norm, fused_add_rms_norm, softmax, cross-entropy), after Keel's checks on meta stand-ins
    (`twin`'s, the op's ``_nograd`` twin); else `twin` on the primals, then the
    torch-op version with the tangents."""
    native = _func.route(op, args, functions=False)[1]
    if native is not None:
        _twice._check_on_meta(_direct, twin, op, args)
        return native(*args)
    with torch.no_grad():
        plain = twin(*[_twice.primal(a) for a in args])
    return _returned(REFS[name](*args), not isinstance(plain, tuple), lambda: plain)


def _direct(op, *args):
    """`op(*args)`: the caller :func:`in_transform` and :func:`with_tangents` give
    ``_twice._check_on_meta``."""
    return op(*args)


def in_transform(op, twin, name, args):
    """Op `name` (overload `op`) on `args` (all given) inside a ``torch.func``
    transform: Keel's checks (its `twin`'s Meta kernel; errors name `op`) on meta
    stand-ins, then torch's own op where ``_func.route`` gives one (the norms,
    softmax and cross-entropy, at every size: torch.func runs no Function
    here, and torch's ``F.layer_norm`` beats the torch-op version, 5.6-6.3
    against 28-33 ms for ``vjp`` on ``[4096, 1024]`` f32, measured), else the
    torch-op version."""
    meta = _twice._check_on_meta(_direct, twin, op, args)
    native = _func.route(op, args, functions=False)[1]
    if native is not None:
        return native(*args)

    def stand_ins():
        # A missing weight's gradient as the kernel gives it: [0], of the input's dtype.
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return [torch.empty(m.shape, dtype=m.dtype, device=device) for m in meta]

    return _returned(REFS[name](*args), len(twin._schema.returns) == 1, stand_ins)
