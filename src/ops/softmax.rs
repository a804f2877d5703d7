//! Softmax over the last dimension of `x * scale`, and its backward from the
//! output. Matches `torch.softmax(x * scale, -1)`.
//!
//! - Shapes: every buffer holds `rows * cols` elements, row-major.
//! - Numerics: max-subtracted, f32 math (f64 for f64), one rounding; an all
//!   `-inf` row gives NaN, as in torch.
//! - CUDA: one block per row, a max-and-sum-of-exp pass (online softmax) and a
//!   store pass, 128-bit loads.
use super::{check_cols, check_len};
use crate::cpu::{Element, Par};
use crate::cuda::{gpu, launch_rows, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::Result;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::sync::Arc;

const MODULE: (&str, &str) = ("softmax", crate::ptx::SOFTMAX);

/// CPU forward. See [`keel_cpu::softmax::forward`].
pub fn forward_cpu<T: Element>(x: &[T], out: &mut [T], cols: usize, scale: f64, par: Par<'_>) -> Result<()> {
    Ok(keel_cpu::softmax::forward(x, out, cols, scale, par)?)
}

/// CPU backward from the forward's output `y`. See [`keel_cpu::softmax::backward`].
pub fn backward_cpu<T: Element>(
    grad_out: &[T],
    y: &[T],
    grad_input: &mut [T],
    cols: usize,
    scale: f64,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::softmax::backward(grad_out, y, grad_input, cols, scale, par)?)
}

/// Launches `softmax_{which}_*` (`which` is `fwd` or `bwd`, checked as `op`)
/// with the device pointers `ptrs` (inputs, then the output) and the row shape.
///
/// # Safety
/// `ptrs` must match the kernel's pointer parameters, each a device address on
/// `t` holding `rows * cols` elements of `dtype`; the output must not overlap
/// the inputs.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run_on(
    t: &dyn Target,
    op: &'static str,
    which: &str,
    dtype: DType,
    ptrs: &[u64],
    rows: usize,
    cols: usize,
    scale: f64,
) -> Result<()> {
    check_cols(op, rows, cols)?;
    keel_cpu::softmax::check(op, rows * cols, cols, scale)?;
    if rows == 0 {
        return Ok(());
    }
    let shape = [Arg::I64(rows as i64), Arg::I32(cols as i32), Arg::F32(scale as f32)];
    let args: Vec<Arg> = ptrs.iter().map(|&p| Arg::Ptr(p)).chain(shape).collect();
    // SAFETY: pointers per our contract, then (rows, cols, scale) as both kernels take them.
    unsafe { launch_rows(t, MODULE, &format!("softmax_{which}"), dtype, rows, cols, &args) }
}

/// CUDA forward on raw device pointers.
///
/// # Safety
/// `x` and `out` must be device addresses on `stream`'s device holding
/// `rows * cols` elements of `dtype`, not overlapping.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    x: u64,
    out: u64,
    rows: usize,
    cols: usize,
    scale: f64,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { run_on(&Stream { gpu, stream }, "softmax", "fwd", dtype, &[x, out], rows, cols, scale) }
}

/// CUDA backward on raw device pointers, from the forward's output `y`.
///
/// # Safety
/// As [`forward_cuda_raw`] for `grad_out`, `y` and `grad_input`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    grad_out: u64,
    y: u64,
    grad_input: u64,
    rows: usize,
    cols: usize,
    scale: f64,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        run_on(&Stream { gpu, stream }, "softmax_backward", "bwd", dtype, &[grad_out, y, grad_input], rows, cols, scale)
    }
}

fn rows_of(op: &'static str, len: usize, cols: usize, others: &[(&'static str, usize)]) -> Result<usize> {
    for &(arg, n) in others {
        check_len(op, arg, n, len)?;
    }
    Ok(keel_cpu::softmax::check(op, len, cols, 0.0)?)
}

/// CUDA forward on `cudarc` buffers, launched on `stream`.
pub fn forward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    cols: usize,
    scale: f64,
) -> Result<()> {
    let rows = rows_of("softmax", x.len(), cols, &[("out", out.len())])?;
    let gpu = gpu(stream.context().ordinal())?;
    let (px, _g1) = x.device_ptr(stream);
    let (po, _g2) = out.device_ptr_mut(stream);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { forward_cuda_raw(&gpu, stream, T::DTYPE, px, po, rows, cols, scale) }
}

/// CUDA backward on `cudarc` buffers, launched on `stream`.
pub fn backward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    grad_out: &CudaSlice<T>,
    y: &CudaSlice<T>,
    grad_input: &mut CudaSlice<T>,
    cols: usize,
    scale: f64,
) -> Result<()> {
    let rows =
        rows_of("softmax_backward", y.len(), cols, &[("grad_out", grad_out.len()), ("grad_input", grad_input.len())])?;
    let gpu = gpu(stream.context().ordinal())?;
    let (pg, _g1) = grad_out.device_ptr(stream);
    let (py, _g2) = y.device_ptr(stream);
    let (pd, _g3) = grad_input.device_ptr_mut(stream);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { backward_cuda_raw(&gpu, stream, T::DTYPE, pg, py, pd, rows, cols, scale) }
}
