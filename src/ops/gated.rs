//! Gated activations: `act(a) * b` for an input whose last dimension is
//! `[a | b]`, each half `d` wide. `silu` gives SwiGLU (`silu_and_mul`),
//! `gelu` GeGLU (`gelu_and_mul`, exact or tanh).
//!
//! - Shapes: `input`, `grad_input` hold `rows * 2d` elements; `out`,
//!   `grad_out` hold `rows * d`.
//! - Numerics: f32 math (f64 for f64), one rounding to the output type. On
//!   the CPU, bf16 and f16 take an `exp` within 3.2e-6 (relative) in the
//!   sigmoids and gelu's pdf: within one unit in the last place.
//! - CUDA: element-wise grid-stride loop, 128-bit loads of each half.
pub use keel_cpu::gated::Activation;

use super::check_len;
use crate::cpu::{Element, Par};
use crate::cuda::{gpu, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::{Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use std::sync::Arc;

const MODULE: (&str, &str) = ("gated", crate::ptx::GATED);

/// CPU forward: `out = act(input[.., :d]) * input[.., d:]`.
pub fn forward_cpu<T: Element>(act: Activation, input: &[T], out: &mut [T], d: usize, par: Par<'_>) -> Result<()> {
    Ok(keel_cpu::gated::forward(act, input, out, d, par)?)
}

/// CPU backward: `grad_input` from `grad_out` and the forward's `input`.
pub fn backward_cpu<T: Element>(
    act: Activation,
    grad_out: &[T],
    input: &[T],
    grad_input: &mut [T],
    d: usize,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::gated::backward(act, grad_out, input, grad_input, d, par)?)
}

fn kernel(act: Activation, which: &str, dtype: DType) -> String {
    format!("{}_and_mul_{which}_{}", act.name(), dtype.suffix())
}

/// Threads a block of [`config`]'s grid. With [`BLOCKS_PER_SM`], the forward
/// kernels' `__launch_bounds__(256, 8)` in gated.cu, which keep all of them
/// resident: the two must change together.
const THREADS: usize = 256;
/// Blocks an SM of [`config`]'s grid at most (see [`THREADS`]).
const BLOCKS_PER_SM: usize = 8;

/// Grid-stride launch over `rows * d` outputs, 16 bytes of each half per thread-step:
/// blocks of [`THREADS`], at most [`BLOCKS_PER_SM`] per SM.
fn config(sm_count: u32, rows: usize, d: usize, dtype: DType) -> LaunchConfig {
    let per = if d.is_multiple_of(16 / dtype.size()) { 16 / dtype.size() } else { 1 };
    let items = (rows * d).div_ceil(per);
    let blocks = items.div_ceil(THREADS).clamp(1, sm_count as usize * BLOCKS_PER_SM);
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 }
}

fn check_d(act: Activation, rows: usize, d: usize) -> Result<()> {
    if d > i32::MAX as usize / 2 {
        return Err(Error::Invalid {
            op: act.op(),
            arg: "d",
            msg: format!("{d} exceeds the kernel's limit of 2^30-1"),
        });
    }
    keel_cpu::gated::check(act.op(), rows * 2 * d, "out", rows * d, d)?;
    Ok(())
}

/// CUDA forward on raw device pointers.
///
/// # Safety
/// `input` (`rows * 2d` elements) and `out` (`rows * d`) must be device
/// addresses of `dtype` on `stream`'s device, not overlapping.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    act: Activation,
    dtype: DType,
    input: u64,
    out: u64,
    rows: usize,
    d: usize,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { forward_on(&Stream { gpu, stream }, act, dtype, input, out, rows, d) }
}

/// [`forward_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`forward_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_on(
    t: &dyn Target,
    act: Activation,
    dtype: DType,
    input: u64,
    out: u64,
    rows: usize,
    d: usize,
) -> Result<()> {
    check_d(act, rows, d)?;
    if rows * d == 0 {
        return Ok(());
    }
    let args = [Arg::Ptr(input), Arg::Ptr(out), Arg::I64(rows as i64), Arg::I32(d as i32)];
    // SAFETY: the argument list matches *_and_mul_fwd_*; pointers per our contract.
    unsafe { t.launch(MODULE, &kernel(act, "fwd", dtype), config(t.sm_count(), rows, d, dtype), &args) }
}

/// CUDA backward on raw device pointers.
///
/// # Safety
/// As [`forward_cuda_raw`]; `grad_out` holds `rows * d` elements and
/// `grad_input` `rows * 2d`, not overlapping the others.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    act: Activation,
    dtype: DType,
    grad_out: u64,
    input: u64,
    grad_input: u64,
    rows: usize,
    d: usize,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { backward_on(&Stream { gpu, stream }, act, dtype, grad_out, input, grad_input, rows, d) }
}

/// [`backward_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`backward_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn backward_on(
    t: &dyn Target,
    act: Activation,
    dtype: DType,
    grad_out: u64,
    input: u64,
    grad_input: u64,
    rows: usize,
    d: usize,
) -> Result<()> {
    check_d(act, rows, d)?;
    if rows * d == 0 {
        return Ok(());
    }
    let args = [Arg::Ptr(grad_out), Arg::Ptr(input), Arg::Ptr(grad_input), Arg::I64(rows as i64), Arg::I32(d as i32)];
    // SAFETY: the argument list matches *_and_mul_bwd_*; pointers per our contract.
    unsafe { t.launch(MODULE, &kernel(act, "bwd", dtype), config(t.sm_count(), rows, d, dtype), &args) }
}

/// CUDA forward on `cudarc` buffers, launched on `stream`.
pub fn forward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    act: Activation,
    input: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    d: usize,
) -> Result<()> {
    let rows = keel_cpu::gated::check(act.op(), input.len(), "out", out.len(), d)?;
    let gpu = gpu(stream.context().ordinal())?;
    let (pi, _g1) = input.device_ptr(stream);
    let (po, _g2) = out.device_ptr_mut(stream);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { forward_cuda_raw(&gpu, stream, act, T::DTYPE, pi, po, rows, d) }
}

/// CUDA backward on `cudarc` buffers, launched on `stream`.
pub fn backward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    act: Activation,
    grad_out: &CudaSlice<T>,
    input: &CudaSlice<T>,
    grad_input: &mut CudaSlice<T>,
    d: usize,
) -> Result<()> {
    let rows = keel_cpu::gated::check(act.op(), input.len(), "grad_out", grad_out.len(), d)?;
    check_len(act.op(), "grad_input", grad_input.len(), input.len())?;
    let gpu = gpu(stream.context().ordinal())?;
    let (pg, _g1) = grad_out.device_ptr(stream);
    let (pi, _g2) = input.device_ptr(stream);
    let (pd, _g3) = grad_input.device_ptr_mut(stream);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { backward_cuda_raw(&gpu, stream, act, T::DTYPE, pg, pi, pd, rows, d) }
}
