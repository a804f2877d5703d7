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
(``_autograd._autograd_kernel``) do the same through :func:`run`: Keel's checks
on meta stand-ins (errors are Keel's; the empty stand-ins of the outputs that
have no torch-op version come from their shapes), then torch's own op where the
typed API's would take it, else the torch-op version (:data:`REFS`).
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


def run(op, twin, name, args):
    """Op `name` (overload `op`) on `args` (all given) where torch's autograd
    machinery does not serve it: inside a ``torch.func`` transform, or with an
    argument carrying a forward-mode tangent. Keel's checks (its `twin`'s Meta
    kernel, the op's ``_nograd`` twin; errors name `op`) on meta stand-ins, then
    torch's own op where ``_func.route`` gives one, else the torch-op version
    (:data:`REFS`). Inside a transform the norms, softmax and cross-entropy run
    torch's own op at every size (torch.func runs no Function here, and torch's
    ``F.layer_norm`` beats the torch-op version, 5.6-6.3 against 28-33 ms for
    ``vjp`` on ``[4096, 1024]`` f32, measured); in forward mode alone (nothing
    requiring a gradient) rms_norm, fused_add_rms_norm, softmax and
    cross-entropy do. The torch-op version carries the tangents and records a
    reverse graph where grad mode is on and an argument requires a gradient
    (forward-over-reverse works). Rotary embedding, the norms and softmax
    with a tangent on ``x`` alone (fused_add_rms_norm: on ``x`` or the
    residual), which ``forward_ad`` or one ``jvp`` alone tracks, are Keel's
    kernel on the primals and Keel's kernels for the tangent
    (``_twice.kernel_parts``; with a graph where a tensor requires a gradient,
    under plain ``forward_ad``: a graph under torch.func needs a Function,
    which torch.func does not run in an op's autograd kernel)."""
    meta = _twice._check_on_meta(_direct, twin, op, args)
    parts = _twice.kernel_parts(op, args, functions=False)
    if parts is not None:
        return _twice.kernel_dual(op, twin, parts, args, _direct)
    native = _func.route(op, args, functions=False)[1]
    args = _twice.zero_tangents(args)
    if native is not None:
        return native(*args)

    def stand_ins():
        # A missing weight's gradient as the kernel gives it: [0], of the input's dtype.
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return [torch.empty(m.shape, dtype=m.dtype, device=device) for m in meta]

    return _returned(REFS[name](*args), len(twin._schema.returns) == 1, stand_ins)


def _direct(op, *args):
    """`op(*args)`: the caller :func:`run` gives ``_twice._check_on_meta``."""
    return op(*args)
