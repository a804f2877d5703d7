//! `keel::silu_and_mul`, `keel::gelu_and_mul` and their backwards.
//!
//! `silu_and_mul(Tensor input) -> Tensor` and
//! `gelu_and_mul(Tensor input, str approximate="none") -> Tensor`: for
//! `input[..., 2d]`, `act(input[..., :d]) * input[..., d:]`.
//! `*_backward(grad_out, input[, approximate]) -> grad_input`.
use crate::checks::{self, invalid, with_float_type, Rows};
use crate::device::{check_err, kernel_err, ptr, CudaCall};
use crate::torch_pool::with_torch_par;
use keel::ops::gated::Activation;
use keel_abi::{BoxedOp, DeviceType, Result, Tensor};

/// Checks `input` (last dim even) and returns it, contiguous, with `d`.
fn check(op: &str, input: Tensor) -> Result<(Tensor, Rows, usize)> {
    let (input, c) = checks::rows_of(op, "input", input)?;
    if c.cols % 2 != 0 {
        return Err(invalid(op, "input", format!("must have an even last dimension (2d), got {}", c.cols)));
    }
    let d = c.cols / 2;
    Ok((input, c, d))
}

fn gelu(approximate: &str) -> Result<Activation> {
    Activation::gelu(approximate).map_err(check_err)
}

fn forward(act: Activation, input: Tensor) -> Result<(Tensor,)> {
    let op = act.op();
    let (input, c, d) = check(op, input)?;
    let mut sizes = input.sizes()?.to_vec();
    *sizes.last_mut().expect("checked: at least 1 dim") = d as i64;
    let out = Tensor::empty(&sizes, c.dtype, c.device)?;
    match c.device.kind {
        DeviceType::Cpu => with_float_type!(c.dtype, T => {
            // SAFETY: checked contiguous CPU tensor of element type T; `out` is fresh.
            let (x, y) = unsafe { (input.as_slice::<T>()?, out.as_mut_slice::<T>()?) };
            with_torch_par(|par| keel::ops::gated::forward_cpu(act, x, y, d, par)).map_err(kernel_err)?
        }),
        DeviceType::Cuda => {
            let call = CudaCall::new(op, c.device)?;
            // SAFETY: checked contiguous CUDA tensors on the guarded device; `out` is fresh.
            unsafe {
                keel::ops::gated::forward_cuda_raw(
                    &call.gpu,
                    &call.stream,
                    act,
                    checks::cuda_dtype(c.dtype)?,
                    ptr(Some(&input))?,
                    ptr(Some(&out))?,
                    c.rows,
                    d,
                )
            }
            .map_err(kernel_err)?
        }
        DeviceType::Meta | DeviceType::Other(_) => {}
    }
    Ok((out,))
}

fn backward(act: Activation, op: &str, grad_out: Tensor, input: Tensor) -> Result<(Tensor,)> {
    let (input, c, d) = check(op, input)?;
    checks::same_device(op, "grad_out", &grad_out, "input", c.device)?;
    checks::same_dtype(op, "grad_out", &grad_out, "input", c.dtype)?;
    let mut want = input.sizes()?.to_vec();
    *want.last_mut().expect("checked: at least 1 dim") = d as i64;
    if grad_out.sizes()? != want.as_slice() {
        return Err(invalid(
            op,
            "grad_out",
            format!("must have shape {want:?} (input's with the last dim halved), got {:?}", grad_out.sizes()?),
        ));
    }
    let grad_out = checks::dense(op, "grad_out", grad_out)?;
    let grad_input = c.empty_like(&input)?;
    match c.device.kind {
        DeviceType::Cpu => with_float_type!(c.dtype, T => {
            // SAFETY: checked contiguous CPU tensors of element type T; `grad_input` is fresh.
            let (dy, x, dx) = unsafe { (grad_out.as_slice::<T>()?, input.as_slice::<T>()?, grad_input.as_mut_slice::<T>()?) };
            with_torch_par(|par| keel::ops::gated::backward_cpu(act, dy, x, dx, d, par)).map_err(kernel_err)?
        }),
        DeviceType::Cuda => {
            let call = CudaCall::new(op, c.device)?;
            // SAFETY: checked contiguous CUDA tensors on the guarded device; `grad_input` is fresh.
            unsafe {
                keel::ops::gated::backward_cuda_raw(
                    &call.gpu,
                    &call.stream,
                    act,
                    checks::cuda_dtype(c.dtype)?,
                    ptr(Some(&grad_out))?,
                    ptr(Some(&input))?,
                    ptr(Some(&grad_input))?,
                    c.rows,
                    d,
                )
            }
            .map_err(kernel_err)?
        }
        DeviceType::Meta | DeviceType::Other(_) => {}
    }
    Ok((grad_input,))
}

/// `silu_and_mul`.
pub(crate) struct SiluAndMul;

impl BoxedOp for SiluAndMul {
    const NAME: &'static str = "silu_and_mul";
    type Args = (Tensor,);
    type Out = (Tensor,);

    fn run((input,): Self::Args) -> Result<Self::Out> {
        forward(Activation::Silu, input)
    }
}

/// `silu_and_mul_backward`.
pub(crate) struct SiluAndMulBackward;

impl BoxedOp for SiluAndMulBackward {
    const NAME: &'static str = "silu_and_mul_backward";
    type Args = (Tensor, Tensor);
    type Out = (Tensor,);

    fn run((grad_out, input): Self::Args) -> Result<Self::Out> {
        backward(Activation::Silu, Self::NAME, grad_out, input)
    }
}

/// `gelu_and_mul`.
pub(crate) struct GeluAndMul;

impl BoxedOp for GeluAndMul {
    const NAME: &'static str = "gelu_and_mul";
    type Args = (Tensor, String);
    type Out = (Tensor,);

    fn run((input, approximate): Self::Args) -> Result<Self::Out> {
        forward(gelu(&approximate)?, input)
    }
}

/// `gelu_and_mul_backward`.
pub(crate) struct GeluAndMulBackward;

impl BoxedOp for GeluAndMulBackward {
    const NAME: &'static str = "gelu_and_mul_backward";
    type Args = (Tensor, Tensor, String);
    type Out = (Tensor,);

    fn run((grad_out, input, approximate): Self::Args) -> Result<Self::Out> {
        backward(gelu(&approximate)?, Self::NAME, grad_out, input)
    }
}
