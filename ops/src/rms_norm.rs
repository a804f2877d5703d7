//! `keel::rms_norm` and `keel::rms_norm_backward`.
//!
//! `rms_norm(Tensor input, Tensor? weight=None, float eps=1e-06, bool
//! round_before_weight=False) -> Tensor` matches
//! `torch.nn.functional.rms_norm(input, (input.shape[-1],), weight, eps)`; with
//! `round_before_weight`, Hugging Face's `LlamaRMSNorm` (`x / rms` rounded to
//! the dtype before the weight multiplies it: [`Rounding::BeforeWeight`]).
//! `rms_norm_backward(grad_out, input, weight, eps) -> (grad_input, grad_weight)`;
//! `grad_weight` has shape `[0]` when `weight` is None.
//!
//! Both read `input` through its strides where its last dim is contiguous
//! (q or k of a fused qkv projection viewed per head, for QK-norm; a
//! transposed tensor): see [`checks::row_layout`]. Any other layout, and a
//! strided `grad_out` or `weight`, is copied to a contiguous tensor first.
use crate::checks::{self, invalid, with_float_type, Rows};
use crate::device::{kernel_err, ptr, CudaCall};
use crate::torch_pool::with_torch_par;
use keel::cpu::RowLayout;
use keel::ops::rms_norm::Rounding;
use keel_abi::{BoxedOp, DeviceType, Result, ScalarType, Tensor};

const OP: &str = "rms_norm";
const OP_BWD: &str = "rms_norm_backward";

/// The checked tensors and what the checks found: the normalised tensor,
/// the weight (contiguous), the rows.
pub(crate) type Checked = (Tensor, Option<Tensor>, Rows);

/// Checks the normalised tensor (named `arg` in the schema), `weight` and
/// `eps` the same way on every device, and returns the tensors contiguous
/// ([`checks::dense`]); shared with `fused_add_rms_norm`.
pub(crate) fn check(op: &str, arg: &'static str, x: Tensor, weight: Option<Tensor>, eps: f64) -> Result<Checked> {
    let (x, c) = checks::rows_of(op, arg, x)?;
    let weight = check_params(op, &c, weight, eps)?;
    Ok((x, weight, c))
}

/// [`check`] for an `input` read through its strides: also returns where its
/// rows lie. A layout its rows cannot be read in place from (the last dim
/// strided, or leading dims that do not merge) is copied to a contiguous one.
fn check_strided(
    op: &str,
    x: Tensor,
    weight: Option<Tensor>,
    eps: f64,
) -> Result<(Tensor, Option<Tensor>, Rows, RowLayout)> {
    let c = checks::strided_rows_of(op, "input", &x)?;
    let (x, layout) = match checks::row_layout(&x, &c)? {
        Some(layout) => (x, layout),
        None => (checks::dense(op, "input", x)?, RowLayout::contiguous(c.rows, c.cols)),
    };
    let weight = check_params(op, &c, weight, eps)?;
    Ok((x, weight, c, layout))
}

/// [`check`]'s checks of `weight` (returned contiguous) and `eps`.
fn check_params(op: &str, c: &Rows, weight: Option<Tensor>, eps: f64) -> Result<Option<Tensor>> {
    let weight = weight.map(|w| checks::param(op, "weight", w, c)).transpose()?;
    checks::eps(op, eps)?;
    Ok(weight)
}

/// The forward op.
pub(crate) struct RmsNorm;

impl BoxedOp for RmsNorm {
    const NAME: &'static str = OP;
    type Args = (Tensor, Option<Tensor>, f64, bool);
    type Out = (Tensor,);

    fn run((input, weight, eps, round_before_weight): Self::Args) -> Result<Self::Out> {
        let (input, weight, c, layout) = check_strided(OP, input, weight, eps)?;
        let rounding = if round_before_weight { Rounding::BeforeWeight } else { Rounding::Once };
        let out = c.empty_like(&input)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked CPU tensors of element type T, `input` read
                // through its strides (its span), the weight contiguous; `out`
                // is freshly allocated, so no other slice of it exists.
                let (x, w, y) = unsafe {
                    (input.as_span_slice::<T>()?, weight.as_ref().map(|w| w.as_slice::<T>()).transpose()?, out.as_mut_slice::<T>()?)
                };
                let x = x.ok_or_else(|| invalid(OP, "input", "has strides that overflow the address space"))?;
                with_torch_par(|par| keel::ops::rms_norm::forward_strided_cpu(x, layout, w, y, c.cols, eps, rounding, par)).map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(OP, c.device)?;
                // SAFETY: checked CUDA tensors of this dtype and shape on the
                // guarded device, `input` read through `layout`; `out` is fresh.
                unsafe {
                    keel::ops::rms_norm::forward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        checks::cuda_dtype(c.dtype)?,
                        ptr(Some(&input))?,
                        layout,
                        ptr(weight.as_ref())?,
                        ptr(Some(&out))?,
                        c.cols,
                        eps,
                        rounding,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((out,))
    }
}

/// The backward op, used by the autograd formula registered in Python.
pub(crate) struct RmsNormBackward;

impl BoxedOp for RmsNormBackward {
    const NAME: &'static str = OP_BWD;
    type Args = (Tensor, Tensor, Option<Tensor>, f64);
    type Out = (Tensor, Tensor);

    fn run((grad_out, input, weight, eps): Self::Args) -> Result<Self::Out> {
        let (input, weight, c, layout) = check_strided(OP_BWD, input, weight, eps)?;
        let grad_out = checks::like(OP_BWD, "grad_out", grad_out, &input, &c)?;
        let grad_input = c.empty_like(&input)?;
        let grad_weight = Tensor::empty(&[if weight.is_some() { c.cols as i64 } else { 0 }], c.dtype, c.device)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked CPU tensors of element type T, `input` read
                // through its strides (its span), the others contiguous; the
                // two outputs are fresh, distinct allocations.
                let (dy, x, w, dx, dw) = unsafe {
                    (
                        grad_out.as_slice::<T>()?,
                        input.as_span_slice::<T>()?,
                        weight.as_ref().map(|w| w.as_slice::<T>()).transpose()?,
                        grad_input.as_mut_slice::<T>()?,
                        if weight.is_some() { Some(grad_weight.as_mut_slice::<T>()?) } else { None },
                    )
                };
                let x = x.ok_or_else(|| invalid(OP_BWD, "input", "has strides that overflow the address space"))?;
                with_torch_par(|par| keel::ops::rms_norm::backward_strided_cpu(dy, x, layout, w, dx, dw, c.cols, eps, par)).map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(OP_BWD, c.device)?;
                let scratch_len = keel::ops::rms_norm::backward_scratch_len(&call.gpu, c.rows, c.cols);
                let scratch = if weight.is_some() {
                    Some(Tensor::empty(&[scratch_len.max(1) as i64], ScalarType::F32, c.device)?)
                } else {
                    None
                };
                // SAFETY: as in the forward; `scratch` holds scratch_len f32s and
                // comes from torch's caching allocator on this stream's device.
                unsafe {
                    keel::ops::rms_norm::backward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        checks::cuda_dtype(c.dtype)?,
                        ptr(Some(&grad_out))?,
                        ptr(Some(&input))?,
                        ptr(weight.as_ref())?,
                        ptr(Some(&grad_input))?,
                        if weight.is_some() { ptr(Some(&grad_weight))? } else { 0 },
                        ptr(scratch.as_ref())?,
                        layout,
                        c.cols,
                        eps,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((grad_input, grad_weight))
    }
}
