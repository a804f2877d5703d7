//! Layer normalisation over the last dimension:
//! `y = (x - mean) / sqrt(var + eps) * w + b` (biased variance).
//!
//! Matches `torch.nn.functional.layer_norm(x, (cols,), w, b, eps)`.
//! - Shapes: `x`, `y`, `grad_input`, `grad_out` hold `rows * cols` elements
//!   (row-major); `weight`, `bias` and their gradients hold `cols`.
//! - Dtypes: f32, f16, bf16 on CPU and CUDA; f64 on CPU.
//! - Numerics: f32 accumulation (f64 for f64), mean and variance in two
//!   passes, one rounding to the output type.
//! - CUDA: one block per row, 128-bit loads, warp-shuffle sums; the backward
//!   sums the weight and bias gradients per block in f32 scratch
//!   ([`backward_scratch_len`]) and then over blocks: deterministic.
use super::{check_cols, norm_backward_config, reduce_parts, sum_parts};
use crate::cpu::{Element, Par};
use crate::cuda::{gpu, launch_rows, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::Result;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::sync::Arc;

const OP: &str = "layer_norm";
const MODULE: (&str, &str) = ("layer_norm", crate::ptx::LAYER_NORM);

/// CPU forward. See [`keel_cpu::layer_norm::forward`].
pub fn forward_cpu<T: Element>(
    x: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    out: &mut [T],
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::layer_norm::forward(x, weight, bias, out, cols, eps, par)?)
}

/// CPU backward. See [`keel_cpu::layer_norm::backward`].
#[allow(clippy::too_many_arguments)]
pub fn backward_cpu<T: Element>(
    grad_out: &[T],
    x: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    grad_input: &mut [T],
    grad_weight: Option<&mut [T]>,
    grad_bias: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::layer_norm::backward(grad_out, x, weight, bias, grad_input, grad_weight, grad_bias, cols, eps, par)?)
}

fn check_dims(rows: usize, cols: usize, eps: f64) -> Result<()> {
    check_cols(OP, rows, cols)?;
    let n = rows * cols;
    keel_cpu::layer_norm::check_forward(n, None, None, n, cols, eps)?;
    Ok(())
}

/// f32 elements of scratch [`backward_cuda_raw`] needs per parameter gradient.
pub fn backward_scratch_len(gpu: &Gpu, rows: usize, cols: usize) -> usize {
    reduce_parts(gpu.sm_count(), rows) * cols
}

/// CUDA forward on raw device pointers (`weight`, `bias` 0 for none).
///
/// # Safety
/// Every pointer must be a device address on `stream`'s device, valid for
/// `rows * cols` (`cols` for `weight` and `bias`) elements of `dtype`, and
/// `out` must not overlap the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    x: u64,
    weight: u64,
    bias: u64,
    out: u64,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { forward_on(&Stream { gpu, stream }, dtype, x, weight, bias, out, rows, cols, eps) }
}

/// [`forward_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`forward_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_on(
    t: &dyn Target,
    dtype: DType,
    x: u64,
    weight: u64,
    bias: u64,
    out: u64,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<()> {
    check_dims(rows, cols, eps)?;
    if rows == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(weight),
        Arg::Ptr(bias),
        Arg::Ptr(out),
        Arg::I64(rows as i64),
        Arg::I32(cols as i32),
        Arg::F32(eps as f32),
    ];
    // SAFETY: the argument list matches layer_norm_fwd_*; pointers per our contract.
    unsafe { launch_rows(t, MODULE, "layer_norm_fwd", dtype, rows, cols, &args) }
}

/// CUDA backward on raw device pointers (`weight`, `grad_weight`,
/// `grad_bias` 0 for none).
///
/// # Safety
/// As [`forward_cuda_raw`]; `scratch_w` / `scratch_b` must each hold
/// [`backward_scratch_len`] f32s when `grad_weight` / `grad_bias` is given.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    grad_out: u64,
    x: u64,
    weight: u64,
    grad_input: u64,
    grad_weight: u64,
    grad_bias: u64,
    scratch_w: u64,
    scratch_b: u64,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        backward_on(
            &Stream { gpu, stream },
            dtype,
            grad_out,
            x,
            weight,
            grad_input,
            grad_weight,
            grad_bias,
            scratch_w,
            scratch_b,
            rows,
            cols,
            eps,
        )
    }
}

/// [`backward_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`backward_cuda_raw`], on `t`, each scratch holding
/// `reduce_parts(t.sm_count(), rows) * cols` f32s when its gradient is given.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn backward_on(
    t: &dyn Target,
    dtype: DType,
    grad_out: u64,
    x: u64,
    weight: u64,
    grad_input: u64,
    grad_weight: u64,
    grad_bias: u64,
    scratch_w: u64,
    scratch_b: u64,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<()> {
    check_dims(rows, cols, eps)?;
    let keep = t.norm_keep(OP)?;
    let (cfg, parts, kernel) = norm_backward_config(t.sm_count(), rows, cols, dtype.size(), keep);
    let s = dtype.suffix();
    let pw = if grad_weight != 0 { scratch_w } else { 0 };
    let pb = if grad_bias != 0 { scratch_b } else { 0 };
    if rows > 0 {
        let args = [
            Arg::Ptr(grad_out),
            Arg::Ptr(x),
            Arg::Ptr(weight),
            Arg::Ptr(grad_input),
            Arg::Ptr(pw),
            Arg::Ptr(pb),
            Arg::I64(rows as i64),
            Arg::I32(cols as i32),
            Arg::F32(eps as f32),
        ];
        // SAFETY: matches layer_norm_bwd{,2,2h,2s}_*; pointers per our contract.
        unsafe { t.launch(MODULE, &format!("layer_norm_{}_{s}", kernel.stem()), cfg, &args)? };
    }
    if cols > 0 {
        let kernel = format!("layer_norm_bwd_sum_{s}");
        for (partial, out) in [(pw, grad_weight), (pb, grad_bias)] {
            if out != 0 {
                // SAFETY: `partial` holds parts * cols f32s, `out` cols elements.
                unsafe { sum_parts(t, MODULE, &kernel, partial, out, parts, cols)? };
            }
        }
    }
    Ok(())
}

/// CUDA forward on `cudarc` buffers, launched on `stream`.
pub fn forward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &CudaSlice<T>,
    weight: Option<&CudaSlice<T>>,
    bias: Option<&CudaSlice<T>>,
    out: &mut CudaSlice<T>,
    cols: usize,
    eps: f64,
) -> Result<()> {
    let rows = keel_cpu::layer_norm::check_forward(
        x.len(),
        weight.map(|w| w.len()),
        bias.map(|b| b.len()),
        out.len(),
        cols,
        eps,
    )?;
    let gpu = gpu(stream.context().ordinal())?;
    let (px, _gx) = x.device_ptr(stream);
    let pw = weight.map(|w| w.device_ptr(stream));
    let pb = bias.map(|b| b.device_ptr(stream));
    let (po, _go) = out.device_ptr_mut(stream);
    let p = |g: &Option<(u64, _)>| g.as_ref().map_or(0, |p| p.0);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { forward_cuda_raw(&gpu, stream, T::DTYPE, px, p(&pw), p(&pb), po, rows, cols, eps) }
}

/// CUDA backward on `cudarc` buffers; allocates its scratch on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn backward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    grad_out: &CudaSlice<T>,
    x: &CudaSlice<T>,
    weight: Option<&CudaSlice<T>>,
    grad_input: &mut CudaSlice<T>,
    grad_weight: Option<&mut CudaSlice<T>>,
    grad_bias: Option<&mut CudaSlice<T>>,
    cols: usize,
    eps: f64,
) -> Result<()> {
    // The bias does not enter the gradient; its length is cols when given.
    let bias_len = grad_bias.as_deref().map(|g| g.len());
    let rows = keel_cpu::layer_norm::check_backward(
        grad_out.len(),
        x.len(),
        weight.map(|w| w.len()),
        bias_len,
        grad_input.len(),
        grad_weight.as_deref().map(|g| g.len()),
        bias_len,
        cols,
        eps,
    )?;
    let gpu = gpu(stream.context().ordinal())?;
    let n = backward_scratch_len(&gpu, rows, cols).max(1);
    let alloc = |what| stream.alloc_zeros::<f32>(n).map_err(crate::error::driver(what));
    let (sw, sb) = (alloc("allocating scratch")?, alloc("allocating scratch")?);
    let (pg, _g1) = grad_out.device_ptr(stream);
    let (px, _g2) = x.device_ptr(stream);
    let pw = weight.map(|w| w.device_ptr(stream));
    let (pgi, _g3) = grad_input.device_ptr_mut(stream);
    let pgw = grad_weight.map(|g| g.device_ptr_mut(stream));
    let pgb = grad_bias.map(|g| g.device_ptr_mut(stream));
    let (psw, _g4) = sw.device_ptr(stream);
    let (psb, _g5) = sb.device_ptr(stream);
    let p = |g: &Option<(u64, _)>| g.as_ref().map_or(0, |p| p.0);
    // SAFETY: lengths checked above, scratch sized by backward_scratch_len.
    unsafe {
        backward_cuda_raw(&gpu, stream, T::DTYPE, pg, px, p(&pw), pgi, p(&pgw), p(&pgb), psw, psb, rows, cols, eps)
    }
}
