//! `keel::layer_norm` and `keel::layer_norm_backward`.
//!
//! `layer_norm(Tensor input, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor`
//! matches `torch.nn.functional.layer_norm(input, (input.shape[-1],), weight, bias, eps)`.
//! `layer_norm_backward(grad_out, input, weight, bias, eps) -> (grad_input, grad_weight, grad_bias)`;
//! a parameter gradient has shape `[0]` when that parameter is None.
use crate::checks::{self, with_float_type, Rows};
use crate::device::{kernel_err, ptr, CudaCall};
use crate::torch_pool::with_torch_par;
use keel_abi::{BoxedOp, DeviceType, Result, ScalarType, Tensor};

const OP: &str = "layer_norm";
const OP_BWD: &str = "layer_norm_backward";

/// The checked tensors, each contiguous, and what the checks found.
type Checked = (Tensor, Option<Tensor>, Option<Tensor>, Rows);

fn check(op: &str, input: Tensor, weight: Option<Tensor>, bias: Option<Tensor>, eps: f64) -> Result<Checked> {
    let (input, c) = checks::rows_of(op, "input", input)?;
    let weight = weight.map(|p| checks::param(op, "weight", p, &c)).transpose()?;
    let bias = bias.map(|p| checks::param(op, "bias", p, &c)).transpose()?;
    checks::eps(op, eps)?;
    Ok((input, weight, bias, c))
}

/// The forward op.
pub(crate) struct LayerNorm;

impl BoxedOp for LayerNorm {
    const NAME: &'static str = OP;
    type Args = (Tensor, Option<Tensor>, Option<Tensor>, f64);
    type Out = (Tensor,);

    fn run((input, weight, bias, eps): Self::Args) -> Result<Self::Out> {
        let (input, weight, bias, c) = check(OP, input, weight, bias, eps)?;
        let out = c.empty_like(&input)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors of element type T; `out` is fresh.
                let (x, w, b, y) = unsafe {
                    (
                        input.as_slice::<T>()?,
                        weight.as_ref().map(|w| w.as_slice::<T>()).transpose()?,
                        bias.as_ref().map(|b| b.as_slice::<T>()).transpose()?,
                        out.as_mut_slice::<T>()?,
                    )
                };
                with_torch_par(|par| keel::ops::layer_norm::forward_cpu(x, w, b, y, c.cols, eps, par)).map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(OP, c.device)?;
                // SAFETY: checked contiguous CUDA tensors of this dtype and shape
                // on the guarded device; `out` is a fresh allocation.
                unsafe {
                    keel::ops::layer_norm::forward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        checks::cuda_dtype(c.dtype)?,
                        ptr(Some(&input))?,
                        ptr(weight.as_ref())?,
                        ptr(bias.as_ref())?,
                        ptr(Some(&out))?,
                        c.rows,
                        c.cols,
                        eps,
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
pub(crate) struct LayerNormBackward;

impl BoxedOp for LayerNormBackward {
    const NAME: &'static str = OP_BWD;
    type Args = (Tensor, Tensor, Option<Tensor>, Option<Tensor>, f64);
    type Out = (Tensor, Tensor, Tensor);

    fn run((grad_out, input, weight, bias, eps): Self::Args) -> Result<Self::Out> {
        let (input, weight, bias, c) = check(OP_BWD, input, weight, bias, eps)?;
        let grad_out = checks::like(OP_BWD, "grad_out", grad_out, &input, &c)?;
        let grad_input = c.empty_like(&input)?;
        let param_grad =
            |p: &Option<Tensor>| Tensor::empty(&[if p.is_some() { c.cols as i64 } else { 0 }], c.dtype, c.device);
        let (grad_weight, grad_bias) = (param_grad(&weight)?, param_grad(&bias)?);
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors of element type T; the
                // outputs are fresh, distinct allocations.
                let (dy, x, w, b, dx, dw, db) = unsafe {
                    (
                        grad_out.as_slice::<T>()?,
                        input.as_slice::<T>()?,
                        weight.as_ref().map(|w| w.as_slice::<T>()).transpose()?,
                        bias.as_ref().map(|b| b.as_slice::<T>()).transpose()?,
                        grad_input.as_mut_slice::<T>()?,
                        if weight.is_some() { Some(grad_weight.as_mut_slice::<T>()?) } else { None },
                        if bias.is_some() { Some(grad_bias.as_mut_slice::<T>()?) } else { None },
                    )
                };
                with_torch_par(|par| keel::ops::layer_norm::backward_cpu(dy, x, w, b, dx, dw, db, c.cols, eps, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(OP_BWD, c.device)?;
                let len = keel::ops::layer_norm::backward_scratch_len(&call.gpu, c.rows, c.cols).max(1) as i64;
                let scratch = |p: &Option<Tensor>| {
                    p.as_ref().map(|_| Tensor::empty(&[len], ScalarType::F32, c.device)).transpose()
                };
                let (sw, sb) = (scratch(&weight)?, scratch(&bias)?);
                // SAFETY: as in the forward; each scratch holds backward_scratch_len
                // f32s from torch's caching allocator on this device.
                unsafe {
                    keel::ops::layer_norm::backward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        checks::cuda_dtype(c.dtype)?,
                        ptr(Some(&grad_out))?,
                        ptr(Some(&input))?,
                        ptr(weight.as_ref())?,
                        ptr(Some(&grad_input))?,
                        if weight.is_some() { ptr(Some(&grad_weight))? } else { 0 },
                        if bias.is_some() { ptr(Some(&grad_bias))? } else { 0 },
                        ptr(sw.as_ref())?,
                        ptr(sb.as_ref())?,
                        c.rows,
                        c.cols,
                        eps,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((grad_input, grad_weight, grad_bias))
    }
}
