"""Conventions of Keel's ops that its Python layers share: the accumulation
dtype, one device for all tensor arguments, the layouts the ops read, and an
error of one op named as another that ran in its place."""
from typing import Optional

import torch

INPLACE = ("fused_add_rms_norm_", "rotary_embedding_")
"""Keel's ops that write their arguments (``Tensor(a!)`` in the schema), in place
of returning new tensors; see ``_inplace``."""


def nograd(name: str) -> str:
    """The name of op `name`'s ``_nograd`` twin (``keel::_{name}_nograd``): its
    schema and kernels under another name, with no autograd kernel (torch's own
    C++ fallback passes it through). Each op with an autograd formula has one
    (the backward ops too, ``_backward_grad``): the formulas call it, and the
    typed API calls it where no gradient can be needed. See ``WITH_AUTOGRAD``
    in ``ops/src/registry.rs``."""
    return f"_{name}_nograd"


def schema_defaults(op) -> tuple:
    """Each argument's default value in op overload `op`'s schema (None where it
    has none): what the dispatcher leaves out of a call where trailing
    arguments equal their defaults."""
    return tuple(a.default_value if a.has_default_value() else None for a in op._schema.arguments)


_ADD_SCALAR = torch.ops.aten.add.Scalar
_MUL_SCALAR = torch.ops.aten.mul.Scalar


def plus(t: torch.Tensor, c) -> torch.Tensor:
    """``t + c`` for a number `c`, through ``aten.add.Scalar``. The written-out
    versions of the ops use it: in forward mode (``jvp``, ``forward_ad``)
    ``t + c`` is ``add.Tensor``, whose formula meets the number's missing
    tangent as an efficient zero tensor, and torch sizes the zero tensor's op
    through the op's Python meta (``prims::add``): about 0.2 ms a call under
    ``forward_ad`` on the CPU and more under ``jvp``, where ``add.Scalar``'s
    tangent is the input's (torch 2.15, measured; docs/BENCHMARKS.md session
    111). The same values."""
    return _ADD_SCALAR(t, c)


def times(t: torch.Tensor, c) -> torch.Tensor:
    """``t * c`` for a number `c`, through ``aten.mul.Scalar``: as :func:`plus`."""
    return _MUL_SCALAR(t, c)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Keel's accumulation dtype for `t`: float64 for float64, else float32."""
    return acc_of(t.dtype)


def acc_of(dtype: torch.dtype) -> torch.dtype:
    """Keel's accumulation dtype for a tensor of `dtype` (:func:`acc_dtype`); also
    torch's "opmath" dtype for Keel's float dtypes."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ce_weight_dtype(logits: torch.Tensor, target: torch.Tensor) -> torch.dtype:
    """The dtype of the class weights that Keel's cross_entropy ops take: the
    target's for probabilities, else the logits'."""
    return target.dtype if target.dtype.is_floating_point else logits.dtype


def ce_loss_dtype(logits: torch.Tensor, target: torch.Tensor) -> torch.dtype:
    """The dtype of the loss (and its gradient) of Keel's cross_entropy ops:
    the logits', or float32 for probabilities of another dtype (torch's
    promotion of the pairs the ops take: two of float32, float16 and
    bfloat16)."""
    if target.dtype.is_floating_point and target.dtype != logits.dtype:
        return torch.float32
    return logits.dtype


def class_weighted(d, smooth, w, target, ignore_index, label_smoothing, reduction):
    """torch's class-weighted cross-entropy with class indices, from each row's
    ``d = lse - x[t]`` and ``smooth = sum_c w_c (lse - x_c)`` (anything on an
    ignored row; `smooth` unread without label smoothing): row loss ``(1 - s)
    w[t] d + s / C smooth``, 0 where `target` is `ignore_index`; ``"mean"``
    divides the sum by that of ``w[t]`` over the rows not ignored
    (:func:`mean_over`). ``_autocast`` (the float32 value), ``_autograd`` (the
    "mean" term of the weights' gradient), ``_twice`` (differentiable twice)
    and ``_ce_forms`` (weights needing a gradient) each give their own ``d``
    and ``smooth``. The numbers scale through :func:`times` (forward mode:
    see :func:`plus`)."""
    live = target != ignore_index
    w_t = torch.where(live, w[torch.where(live, target, 0)], 0.0)
    rows = times(w_t, 1.0 - label_smoothing) * d
    if label_smoothing != 0:
        rows = rows + times(smooth, label_smoothing / w.shape[0])
    rows = torch.where(live, rows, 0.0)
    if reduction == "none":
        return rows
    total = rows.sum()
    return mean_over(total, w_t.sum()) if reduction == "mean" else total


def mean_over(total, over):
    """``total / over``, NaN where `over` is 0 (every row ignored, or every
    target's class weight 0), as torch's cross-entropy mean: its loss is NaN
    there even where label smoothing leaves `total` above 0, and so is the
    gradient of each row not ignored (the ignored ones take 0: their terms are
    masked, not multiplied by 0)."""
    return total / torch.where(over == 0, torch.nan, over)


def one_device(name, named):
    """The device of the tensor arguments (`named`: (name, value) pairs); raises,
    as the real kernels do, where they differ (used where the Meta kernel sees
    only meta stand-ins)."""
    tensors = [(n, v) for n, v in named if isinstance(v, torch.Tensor)]
    first, device = tensors[0][0], tensors[0][1].device
    for n, t in tensors[1:]:
        if t.device != device:
            raise RuntimeError(f"keel::{name}: argument '{n}' is on {t.device} but '{first}' is on {device}")
    return device


def heads_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` where an op that reads its leading dims through their strides takes
    it as it is (last dim contiguous: stride 1, or at most one element), else a
    contiguous copy. rotary_embedding reads `x` so. A 0-dim `t` (no last dim) as
    it is: the op refuses it, naming the argument."""
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def rows_in_place(t: torch.Tensor) -> torch.Tensor:
    """`t` where an op that reads its rows through their strides takes it as it
    is, else a contiguous copy: its last dim contiguous, and at most three
    leading dims once those contiguous with each other merge (Rust's
    ``RowLayout``). rms_norm's forward reads `input` so."""
    if t.is_contiguous() or t.dim() == 0:
        return t
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return t.contiguous()
    dims, inner = 0, None
    for n, s in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if n == 1:
            continue
        if inner is not None and inner[0] * inner[1] == s:
            inner = (inner[0] * n, inner[1])
            continue
        dims, inner = dims + 1, (n, s)
    return t if dims <= 3 else t.contiguous()


def as_called(err: BaseException, other_name: str, name: str) -> Optional[RuntimeError]:
    """`err` as a RuntimeError naming op `name` (``keel::...``) where op `other_name`,
    which ran in its place, raised it (torch's parser error ``other_name()``, or a
    kernel's check ``other_name:``); None for any other error."""
    if isinstance(err, RuntimeError) and str(err).startswith((other_name + "()", other_name + ":")):
        return RuntimeError(str(err).replace(other_name, name))
    return None
