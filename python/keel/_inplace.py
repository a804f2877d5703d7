"""Autograd and version counters for Keel's in-place ops (``fused_add_rms_norm_``).

The stable C ABI registers only the backend kernels (CPU, CUDA, Meta). For an
op that writes its arguments, torch then neither bumps their version counters
(so a tensor saved for a backward and then overwritten would give a wrong
gradient, silently) nor knows the op has no derivative (an input requiring a
gradient would come out with the grad_fn it had before, silently wrong too).
``torch.library.register_autograd`` refuses mutating ops. So, as
``torch.library.custom_op`` does for its own mutating ops, two Python kernels:

- ``Autograd``: refuses, naming the op and the argument, where grad mode is on
  and an argument requires a gradient; else goes on below autograd.
- ``ADInplaceOrView``: bumps the version of every argument written.

Under ``torch.inference_mode`` (inference tensors), neither key is dispatched
and neither kernel runs, as for torch's own in-place ops.
"""
import torch

from ._common import INPLACE

_LIB = None


def _autograd_kernel(name, op, arg_names):
    def kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled():
            named = [*zip(arg_names, args), *kwargs.items()]
            for arg, value in named:
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    raise RuntimeError(
                        f"keel::{name}: argument '{arg}' requires grad, and this in-place op has no "
                        f"backward; use keel.{name.rstrip('_')} (out of place) where a gradient is "
                        "needed, or call it under torch.no_grad() or torch.inference_mode()"
                    )
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    return kernel


def _inplace_or_view_kernel(op, written):
    """`written`: the positions and names of the arguments the op writes."""
    after = torch._C._after_ADInplaceOrView_keyset

    def kernel(keyset, *args, **kwargs):
        for i, arg in written:
            value = args[i] if i < len(args) else kwargs.get(arg)
            if isinstance(value, torch.Tensor):
                torch.autograd.graph.increment_version(value)
        return op.redispatch(keyset & after, *args, **kwargs)

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
        lib.impl(name, _autograd_kernel(name, op, arg_names), "Autograd", with_keyset=True)
        lib.impl(name, _inplace_or_view_kernel(op, written_args(op)), "ADInplaceOrView", with_keyset=True)
    _LIB = lib  # kept alive: dropping the library would unregister the kernels
