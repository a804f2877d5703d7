//! `keel::fused_add_rms_norm` and its backward.
//!
//! `fused_add_rms_norm(Tensor input, Tensor residual, Tensor? weight=None, float eps=1e-06, bool
//! round_before_weight=False) -> (Tensor, Tensor)` returns `(rms_norm(input + residual), input +
//! residual)`; `round_before_weight` rounds `sum / rms` to the dtype before the weight, as vLLM's
//! kernel and Hugging Face's `LlamaRMSNorm` do (see `keel::rms_norm`).
//! `fused_add_rms_norm_backward(grad_out, grad_sum?, sum, weight, eps) -> (grad, grad_weight)`:
//! `grad` is the gradient of both `input` and `residual`; `grad_weight` is
//! `[0]` when `weight` is None.
//! `fused_add_rms_norm_(Tensor(a!) input, Tensor(b!) residual, Tensor? weight=None, float eps=1e-06,
//! bool round_before_weight=False) -> ()` is the forward in place: `residual` becomes the sum, `input` the output. A
//! non-contiguous `input` or `residual` is worked on in a contiguous copy and
//! written back; one whose elements share memory is refused.
use crate::checks::{self, with_float_type};
use crate::device::{kernel_err, ptr, CudaCall};
use crate::rms_norm::check;
use crate::torch_pool::with_torch_par;
use keel::ops::rms_norm::Rounding;
use keel_abi::{BoxedOp, DeviceType, Result, ScalarType, Tensor};

const OP: &str = "fused_add_rms_norm";
const OP_BWD: &str = "fused_add_rms_norm_backward";
const OP_INPLACE: &str = "fused_add_rms_norm_";

/// The kernels' [`Rounding`] for the schema's `round_before_weight`.
fn rounding(round_before_weight: bool) -> Rounding {
    if round_before_weight {
        Rounding::BeforeWeight
    } else {
        Rounding::Once
    }
}

/// The forward op.
pub(crate) struct FusedAddRmsNorm;

impl BoxedOp for FusedAddRmsNorm {
    const NAME: &'static str = OP;
    type Args = (Tensor, Tensor, Option<Tensor>, f64, bool);
    type Out = (Tensor, Tensor);

    fn run((input, residual, weight, eps, round_before_weight): Self::Args) -> Result<Self::Out> {
        let rounding = rounding(round_before_weight);
        let (input, weight, c) = check(OP, "input", input, weight, eps)?;
        let residual = checks::like(OP, "residual", residual, &input, &c)?;
        let (out, sum) = (c.empty_like(&input)?, c.empty_like(&input)?);
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors of element type T; the
                // two outputs are fresh, distinct allocations.
                let (x, r, w, y, s) = unsafe {
                    (
                        input.as_slice::<T>()?,
                        residual.as_slice::<T>()?,
                        weight.as_ref().map(|w| w.as_slice::<T>()).transpose()?,
                        out.as_mut_slice::<T>()?,
                        sum.as_mut_slice::<T>()?,
                    )
                };
                with_torch_par(|par| keel::ops::fused_add_rms_norm::forward_cpu(x, r, w, y, s, c.cols, eps, rounding, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(OP, c.device)?;
                // SAFETY: checked contiguous CUDA tensors of this dtype and shape
                // on the guarded device; the outputs are fresh allocations.
                unsafe {
                    keel::ops::fused_add_rms_norm::forward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        checks::cuda_dtype(c.dtype)?,
                        ptr(Some(&input))?,
                        ptr(Some(&residual))?,
                        ptr(weight.as_ref())?,
                        ptr(Some(&out))?,
                        ptr(Some(&sum))?,
                        c.rows,
                        c.cols,
                        eps,
                        rounding,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((out, sum))
    }
}

/// The in-place forward (vLLM's form): `residual` becomes `input +
/// residual`, `input` the rms_norm of that sum. No autograd: the Python
/// layer refuses it where a gradient is needed.
pub(crate) struct FusedAddRmsNormInplace;

impl BoxedOp for FusedAddRmsNormInplace {
    const NAME: &'static str = OP_INPLACE;
    type Args = (Tensor, Tensor, Option<Tensor>, f64, bool);
    type Out = ();

    fn run((input, residual, weight, eps, round_before_weight): Self::Args) -> Result<Self::Out> {
        let rounding = rounding(round_before_weight);
        // A layout the kernel cannot write is worked on in a contiguous copy,
        // written back after (`back`); contiguous ones are written directly.
        let (input, input_back) = checks::written(OP_INPLACE, "input", input)?;
        let (residual, residual_back) = checks::written(OP_INPLACE, "residual", residual)?;
        let (input, weight, c) = check(OP_INPLACE, "input", input, weight, eps)?;
        let residual = checks::like(OP_INPLACE, "residual", residual, &input, &c)?;
        // Memory shared between the tensors as given (not the copies) would
        // make the result depend on the order of the writes.
        let given_input = input_back.as_ref().unwrap_or(&input);
        let given_residual = residual_back.as_ref().unwrap_or(&residual);
        checks::disjoint(OP_INPLACE, "residual", given_residual, "input", given_input)?;
        if let Some(w) = &weight {
            checks::disjoint(OP_INPLACE, "weight", w, "input", given_input)?;
            checks::disjoint(OP_INPLACE, "weight", w, "residual", given_residual)?;
        }
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors of element type T
                // that share no memory, so the two mutable slices and the
                // weight's do not overlap.
                let (x, r, w) = unsafe {
                    (
                        input.as_mut_slice::<T>()?,
                        residual.as_mut_slice::<T>()?,
                        weight.as_ref().map(|w| w.as_slice::<T>()).transpose()?,
                    )
                };
                with_torch_par(|par| keel::ops::fused_add_rms_norm::forward_inplace_cpu(x, r, w, c.cols, eps, rounding, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(OP_INPLACE, c.device)?;
                // SAFETY: checked contiguous CUDA tensors of this dtype and
                // shape on the guarded device, sharing no memory.
                unsafe {
                    keel::ops::fused_add_rms_norm::forward_inplace_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        checks::cuda_dtype(c.dtype)?,
                        ptr(Some(&input))?,
                        ptr(Some(&residual))?,
                        ptr(weight.as_ref())?,
                        c.rows,
                        c.cols,
                        eps,
                        rounding,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        if let Some(back) = residual_back {
            back.copy_from(&residual)?;
        }
        if let Some(back) = input_back {
            back.copy_from(&input)?;
        }
        Ok(())
    }
}

/// The backward op, used by the autograd formula registered in Python.
pub(crate) struct FusedAddRmsNormBackward;

impl BoxedOp for FusedAddRmsNormBackward {
    const NAME: &'static str = OP_BWD;
    type Args = (Tensor, Option<Tensor>, Tensor, Option<Tensor>, f64);
    type Out = (Tensor, Tensor);

    fn run((grad_out, grad_sum, sum, weight, eps): Self::Args) -> Result<Self::Out> {
        let (sum, weight, c) = check(OP_BWD, "sum", sum, weight, eps)?;
        let grad_out = checks::like(OP_BWD, "grad_out", grad_out, &sum, &c)?;
        let grad_sum = grad_sum.map(|g| checks::like(OP_BWD, "grad_sum", g, &sum, &c)).transpose()?;
        let grad = c.empty_like(&sum)?;
        let grad_weight = Tensor::empty(&[if weight.is_some() { c.cols as i64 } else { 0 }], c.dtype, c.device)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors of element type T; the
                // outputs are fresh, distinct allocations.
                let (dy, ds, s, w, dx, dw) = unsafe {
                    (
                        grad_out.as_slice::<T>()?,
                        grad_sum.as_ref().map(|g| g.as_slice::<T>()).transpose()?,
                        sum.as_slice::<T>()?,
                        weight.as_ref().map(|w| w.as_slice::<T>()).transpose()?,
                        grad.as_mut_slice::<T>()?,
                        if weight.is_some() { Some(grad_weight.as_mut_slice::<T>()?) } else { None },
                    )
                };
                with_torch_par(|par| keel::ops::fused_add_rms_norm::backward_cpu(dy, ds, s, w, dx, dw, c.cols, eps, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(OP_BWD, c.device)?;
                let len = keel::ops::rms_norm::backward_scratch_len(&call.gpu, c.rows, c.cols).max(1) as i64;
                let scratch = weight.as_ref().map(|_| Tensor::empty(&[len], ScalarType::F32, c.device)).transpose()?;
                // SAFETY: as in the forward; scratch holds backward_scratch_len f32s.
                unsafe {
                    keel::ops::rms_norm::backward_add_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        checks::cuda_dtype(c.dtype)?,
                        ptr(Some(&grad_out))?,
                        ptr(grad_sum.as_ref())?,
                        ptr(Some(&sum))?,
                        ptr(weight.as_ref())?,
                        ptr(Some(&grad))?,
                        if weight.is_some() { ptr(Some(&grad_weight))? } else { 0 },
                        ptr(scratch.as_ref())?,
                        keel::cpu::RowLayout::contiguous(c.rows, c.cols),
                        c.cols,
                        eps,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((grad, grad_weight))
    }
}
