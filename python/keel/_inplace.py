"""Autograd and version counters for Keel's in-place ops (``_common.INPLACE``).

The stable C ABI registers only the backend kernels (CPU, CUDA, Meta). For an
op that writes its arguments, torch then neither bumps their version counters
(so a tensor saved for a backward and then overwritten would give a wrong
gradient, silently) nor knows the op has no derivative (an input requiring a
gradient would come out with the grad_fn it had before, silently wrong too).
``torch.library.register_autograd`` refuses mutating ops. So, as
``torch.library.custom_op`` does for its own mutating ops, two Python kernels:

- ``Autograd``: refuses, naming the op and the argument, where grad mode is on
  and an argument requires a gradient; else runs the op below
  ``ADInplaceOrView`` and bumps the version of every argument written.
- ``ADInplaceOrView``: the same bump, where that key is reached without the
  first (below autograd).

Under ``torch.inference_mode`` (inference tensors), neither key is dispatched
and neither kernel runs, as for torch's own in-place ops.
"""
from operator import itemgetter

import torch

from ._common import INPLACE

_LIB = None
_increment_version = torch.autograd.graph.increment_version


def _bump_of(written):
    """The version bump of an op whose written arguments are `written`
    (positions and names): one ``increment_version`` call on them, taken from
    the positional arguments. They are the leading, required ``Tensor(a!)``
    arguments of Keel's in-place ops, so a call always passes them by position
    (a Python kernel gets keywords only for keyword-only arguments, which Keel's
    ops do not have). 0.6 us less a call than a loop over them on [1, 64]
    (measured, with the bound names of the kernels below)."""
    positions = [i for i, _ in written]
    assert positions == list(range(len(positions))), written
    # itemgetter of one position gives that tensor, of several a tuple of
    # them; increment_version takes either.
    take = itemgetter(*positions)

    def bump(args):
        _increment_version(take(args))

    return bump


def _autograd_kernel(name, op, arg_names, written):
    """Refuses an argument requiring grad in grad mode; else runs the op below
    ADInplaceOrView too and bumps the versions itself (one Python kernel a
    call instead of two: 9.4 against 12.3 us on [1, 64], measured)."""
    after = torch._C._after_ADInplaceOrView_keyset
    any_requires_grad = torch._C._any_requires_grad
    grad_enabled = torch.is_grad_enabled
    below = torch._C._AutoDispatchBelowADInplaceOrView
    redispatch = op.redispatch
    bump = _bump_of(written)

    def kernel(keyset, *args, **kwargs):
        # One C call first: the argument is named only where one requires grad.
        if grad_enabled() and any_requires_grad(*args, *kwargs.values()):
            named = [*zip(arg_names, args), *kwargs.items()]
            for arg, value in named:
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    raise RuntimeError(
                        f"keel::{name}: argument '{arg}' requires grad, and this in-place op has no "
                        f"backward; use keel.{name.rstrip('_')} (out of place) where a gradient is "
                        "needed, or call it under torch.no_grad() or torch.inference_mode()"
                    )
        # The guard keeps the kernel's own dispatcher calls (the write-back of a
        # strided argument's copy) from bumping the versions again.
        with below():
            out = redispatch(keyset & after, *args, **kwargs)
        bump(args)
        return out

    return kernel


def _inplace_or_view_kernel(op, written):
    """Bumps the versions, then runs the op: where ADInplaceOrView is reached
    without the Autograd kernel (below autograd, e.g. inside an autograd.Function)."""
    after = torch._C._after_ADInplaceOrView_keyset
    below = torch._C._AutoDispatchBelowADInplaceOrView
    redispatch = op.redispatch
    bump = _bump_of(written)

    def kernel(keyset, *args, **kwargs):
        bump(args)
        with below():  # as in the Autograd kernel
            return redispatch(keyset & after, *args, **kwargs)

    return kernel


def written_args(op):
    """(position, name) of each argument `op`'s schema marks as written (``Tensor(a!)``)."""
    return [
        (i, a.name) for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    ]


def register() -> None:
    """Registers both kernels for every op in ``_common.INPLACE``."""
    global _LIB
    lib = torch.library.Library("keel", "IMPL")
    for name in INPLACE:
        op = getattr(torch.ops.keel, name).default
        arg_names = [a.name for a in op._schema.arguments]
        written = written_args(op)
        lib.impl(name, _autograd_kernel(name, op, arg_names, written), "Autograd", with_keyset=True)
        lib.impl(name, _inplace_or_view_kernel(op, written), "ADInplaceOrView", with_keyset=True)
    _LIB = lib  # kept alive: dropping the library would unregister the kernels
