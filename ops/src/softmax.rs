//! `keel::softmax` and `keel::softmax_backward`.
//!
//! `softmax(Tensor input, float scale=1.0) -> Tensor`: `softmax(input * scale)`
//! over the last dim. `softmax_backward(grad_out, output, scale) -> grad_input`,
//! from the forward's output.
use crate::checks::{self, with_float_type};
use crate::device::{check_err, kernel_err, ptr, CudaCall};
use crate::torch_pool::with_torch_par;
use keel_abi::{BoxedOp, DeviceType, Result, Tensor};

/// The kernels' own check of `scale` (finite), for every device.
fn check_scale(op: &'static str, c: &checks::Rows, scale: f64) -> Result<()> {
    keel::cpu::softmax::check(op, c.rows * c.cols, c.cols, scale).map(drop).map_err(check_err)
}

/// `softmax`.
pub(crate) struct Softmax;

impl BoxedOp for Softmax {
    const NAME: &'static str = "softmax";
    type Args = (Tensor, f64);
    type Out = (Tensor,);

    fn run((input, scale): Self::Args) -> Result<Self::Out> {
        let op = Self::NAME;
        let (input, c) = checks::rows_of(op, "input", input)?;
        check_scale(op, &c, scale)?;
        let out = c.empty_like(&input)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensor of element type T; `out` is fresh.
                let (x, y) = unsafe { (input.as_slice::<T>()?, out.as_mut_slice::<T>()?) };
                with_torch_par(|par| keel::ops::softmax::forward_cpu(x, y, c.cols, scale, par)).map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(op, c.device)?;
                let dtype = checks::cuda_dtype(c.dtype)?;
                let (px, po) = (ptr(Some(&input))?, ptr(Some(&out))?);
                // SAFETY: checked contiguous CUDA tensors on the guarded device; `out` is fresh.
                unsafe {
                    keel::ops::softmax::forward_cuda_raw(&call.gpu, &call.stream, dtype, px, po, c.rows, c.cols, scale)
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((out,))
    }
}

/// `softmax_backward`.
pub(crate) struct SoftmaxBackward;

impl BoxedOp for SoftmaxBackward {
    const NAME: &'static str = "softmax_backward";
    type Args = (Tensor, Tensor, f64);
    type Out = (Tensor,);

    fn run((grad_out, output, scale): Self::Args) -> Result<Self::Out> {
        let op = Self::NAME;
        let (output, c) = checks::rows_of(op, "output", output)?;
        let grad_out = checks::like(op, "grad_out", grad_out, &output, &c)?;
        check_scale(op, &c, scale)?;
        let grad_input = c.empty_like(&output)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors of element type T; `grad_input` is fresh.
                let (dy, y, dx) = unsafe { (grad_out.as_slice::<T>()?, output.as_slice::<T>()?, grad_input.as_mut_slice::<T>()?) };
                with_torch_par(|par| keel::ops::softmax::backward_cpu(dy, y, dx, c.cols, scale, par)).map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(op, c.device)?;
                let dtype = checks::cuda_dtype(c.dtype)?;
                let (pg, py, pd) = (ptr(Some(&grad_out))?, ptr(Some(&output))?, ptr(Some(&grad_input))?);
                // SAFETY: checked contiguous CUDA tensors on the guarded device; `grad_input` is fresh.
                unsafe {
                    keel::ops::softmax::backward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        dtype,
                        pg,
                        py,
                        pd,
                        c.rows,
                        c.cols,
                        scale,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((grad_input,))
    }
}
