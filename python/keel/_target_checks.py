"""``keel.set_cuda_target_checks`` and ``keel.cuda_target_checks``: cross_entropy's
CUDA check of class targets, on or off; :func:`checking`, where the Python side
checks them as the kernels would, and :func:`out_of_range` and
:func:`raise_first`, how."""
import ctypes

import torch

from . import _load


def _call(path: str, name: str, *args) -> bool:
    """The library's ``keel_<name>`` on ``args`` (ints): 1 on, 0 off, -1 failed."""
    fn = _load.c_function(path, f"keel_{name}", (ctypes.c_int,) * len(args), ctypes.c_int)
    v = fn(*args)
    if v < 0:
        raise RuntimeError(f"keel.{name}: the library could not tell the check's state")
    return bool(v)


def set_checks(path: str, enabled: bool) -> bool:
    """Sets the check of the library at ``path``; returns whether it was on."""
    if not isinstance(enabled, bool):
        raise TypeError(f"keel.set_cuda_target_checks: enabled must be a bool, got {type(enabled).__name__}")
    return _call(path, "set_cuda_target_checks", int(enabled))


def checks(path: str) -> bool:
    """Whether the check of the library at ``path`` is on."""
    return _call(path, "cuda_target_checks")


def checking(x) -> bool:
    """Whether out-of-range class targets of logits `x` raise (else their rows'
    losses are NaN): as the kernels check, not while compiling, nor on CUDA
    where the check is off (``keel.set_cuda_target_checks``) or a graph is
    being captured."""
    if torch.compiler.is_compiling():
        return False
    if x.is_cuda:
        import keel

        return keel.cuda_target_checks() and not torch.cuda.is_current_stream_capturing()
    return True


def out_of_range(t, classes: int, ignore_index: int):
    """Where class-index target `t` holds a value out of range for `classes`
    classes that is not `ignore_index` (a bool tensor shaped as `t`)."""
    return (t != ignore_index) & ((t < 0) | (t >= classes))


def raise_first(op: str, t, bad, classes: int, ignore_index: int, first_row=0):
    """Raises the kernels' error, naming `op` and the argument, for the first
    value of 1-D target `t` that mask `bad` (:func:`out_of_range`) marks, at
    its row plus `first_row` (None: no row named); returns where none is
    marked."""
    found = bad.nonzero()
    if not found.numel():
        return
    i = int(found[0, 0])
    at = "" if first_row is None else f" at row {i + first_row}"
    raise RuntimeError(
        f"{op}: argument 'target' holds {int(t[i])}{at}, out of range for {classes} classes "
        f"(and not ignore_index = {ignore_index})"
    )
