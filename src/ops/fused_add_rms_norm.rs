//! `sum = x + residual`, `out = rms_norm(sum) * w`, in one pass over memory.
//!
//! Matches `s = x + residual; (F.rms_norm(s, (cols,), w, eps), s)`: `sum` is
//! rounded to the element type before it is normalised, as in torch. The
//! forwards take a [`Rounding`]: [`Rounding::BeforeWeight`] rounds `sum /
//! rms` to the element type before the weight, as vLLM's kernel does.
//! - Shapes: `x`, `residual`, `out`, `sum` and the gradients hold
//!   `rows * cols` elements; `weight` and `grad_weight` hold `cols`.
//! - The backward is [`crate::ops::rms_norm`]'s with the gradient arriving at
//!   `sum` added: `grad_sum` is the gradient of both `x` and `residual`.
use super::check_cols;
use crate::cpu::{Element, Par, RowLayout};
use crate::cuda::{gpu, launch_rows, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::Result;
use crate::ops::rms_norm::{rounds_first, Rounding};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::sync::Arc;

const OP: &str = "fused_add_rms_norm";
const OP_INPLACE: &str = "fused_add_rms_norm_";
const MODULE: (&str, &str) = ("fused_add_rms_norm", crate::ptx::FUSED_ADD_RMS_NORM);

/// CPU forward. See [`keel_cpu::fused_add_rms_norm::forward`].
#[allow(clippy::too_many_arguments)]
pub fn forward_cpu<T: Element>(
    x: &[T],
    residual: &[T],
    weight: Option<&[T]>,
    out: &mut [T],
    sum: &mut [T],
    cols: usize,
    eps: f64,
    rounding: Rounding,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::fused_add_rms_norm::forward(x, residual, weight, out, sum, cols, eps, rounding, par)?)
}

/// CPU forward in place (vLLM's form): `residual` becomes the sum, `x` the
/// normalised output. See [`keel_cpu::fused_add_rms_norm::forward_inplace`].
pub fn forward_inplace_cpu<T: Element>(
    x: &mut [T],
    residual: &mut [T],
    weight: Option<&[T]>,
    cols: usize,
    eps: f64,
    rounding: Rounding,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::fused_add_rms_norm::forward_inplace(x, residual, weight, cols, eps, rounding, par)?)
}

/// CPU backward. See [`keel_cpu::fused_add_rms_norm::backward`].
#[allow(clippy::too_many_arguments)]
pub fn backward_cpu<T: Element>(
    grad_out: &[T],
    grad_sum_out: Option<&[T]>,
    sum: &[T],
    weight: Option<&[T]>,
    grad_sum: &mut [T],
    grad_weight: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::fused_add_rms_norm::backward(
        grad_out,
        grad_sum_out,
        sum,
        weight,
        grad_sum,
        grad_weight,
        cols,
        eps,
        par,
    )?)
}

/// CUDA forward on raw device pointers (`weight` 0 for none).
///
/// # Safety
/// Every pointer must be a device address on `stream`'s device, valid for
/// `rows * cols` (`cols` for `weight`) elements of `dtype`; `out` and `sum`
/// must not overlap each other or the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    x: u64,
    residual: u64,
    weight: u64,
    out: u64,
    sum: u64,
    rows: usize,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { forward_on(&Stream { gpu, stream }, dtype, x, residual, weight, out, sum, rows, cols, eps, rounding) }
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
    residual: u64,
    weight: u64,
    out: u64,
    sum: u64,
    rows: usize,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    check_cols(OP, rows, cols)?;
    let n = rows * cols;
    keel_cpu::fused_add_rms_norm::check_forward(n, n, None, n, n, cols, eps)?;
    if rows == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(residual),
        Arg::Ptr(weight),
        Arg::Ptr(out),
        Arg::Ptr(sum),
        Arg::I64(rows as i64),
        Arg::I32(cols as i32),
        Arg::F32(eps as f32),
        Arg::I32(i32::from(rounds_first(rounding, weight, dtype))),
    ];
    // SAFETY: the argument list matches fused_add_rms_norm_fwd_*; pointers per our contract.
    unsafe { launch_rows(t, MODULE, "fused_add_rms_norm_fwd", dtype, rows, cols, &args) }
}

/// CUDA forward in place on raw device pointers (`weight` 0 for none):
/// `residual` becomes the sum, `x` the normalised output.
///
/// # Safety
/// Every pointer must be a device address on `stream`'s device, valid for
/// `rows * cols` (`cols` for `weight`) elements of `dtype`; `x` and
/// `residual` must not overlap each other or `weight`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_inplace_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    x: u64,
    residual: u64,
    weight: u64,
    rows: usize,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { forward_inplace_on(&Stream { gpu, stream }, dtype, x, residual, weight, rows, cols, eps, rounding) }
}

/// [`forward_inplace_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`forward_inplace_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_inplace_on(
    t: &dyn Target,
    dtype: DType,
    x: u64,
    residual: u64,
    weight: u64,
    rows: usize,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    check_cols(OP_INPLACE, rows, cols)?;
    let n = rows * cols;
    keel_cpu::fused_add_rms_norm::check_forward(n, n, None, n, n, cols, eps).map_err(|e| e.renamed(OP_INPLACE))?;
    if rows == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(residual),
        Arg::Ptr(weight),
        Arg::I64(rows as i64),
        Arg::I32(cols as i32),
        Arg::F32(eps as f32),
        Arg::I32(i32::from(rounds_first(rounding, weight, dtype))),
    ];
    // SAFETY: the argument list matches fused_add_rms_norm_inplace_*; pointers per our contract.
    unsafe { launch_rows(t, MODULE, "fused_add_rms_norm_inplace", dtype, rows, cols, &args) }
}

/// CUDA forward on `cudarc` buffers, launched on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn forward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &CudaSlice<T>,
    residual: &CudaSlice<T>,
    weight: Option<&CudaSlice<T>>,
    out: &mut CudaSlice<T>,
    sum: &mut CudaSlice<T>,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    let rows = keel_cpu::fused_add_rms_norm::check_forward(
        x.len(),
        residual.len(),
        weight.map(|w| w.len()),
        out.len(),
        sum.len(),
        cols,
        eps,
    )?;
    let gpu = gpu(stream.context().ordinal())?;
    let (px, _g1) = x.device_ptr(stream);
    let (pr, _g2) = residual.device_ptr(stream);
    let pw = weight.map(|w| w.device_ptr(stream));
    let (po, _g3) = out.device_ptr_mut(stream);
    let (ps, _g4) = sum.device_ptr_mut(stream);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe {
        forward_cuda_raw(
            &gpu,
            stream,
            T::DTYPE,
            px,
            pr,
            pw.as_ref().map_or(0, |p| p.0),
            po,
            ps,
            rows,
            cols,
            eps,
            rounding,
        )
    }
}

/// CUDA forward in place on `cudarc` buffers, launched on `stream`:
/// `residual` becomes the sum, `x` the normalised output.
pub fn forward_inplace_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &mut CudaSlice<T>,
    residual: &mut CudaSlice<T>,
    weight: Option<&CudaSlice<T>>,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    let rows = keel_cpu::fused_add_rms_norm::check_forward(
        x.len(),
        residual.len(),
        weight.map(|w| w.len()),
        x.len(),
        residual.len(),
        cols,
        eps,
    )
    .map_err(|e| e.renamed(OP_INPLACE))?;
    let gpu = gpu(stream.context().ordinal())?;
    let (px, _g1) = x.device_ptr_mut(stream);
    let (pr, _g2) = residual.device_ptr_mut(stream);
    let pw = weight.map(|w| w.device_ptr(stream));
    // SAFETY: lengths checked above; two `&mut` buffers cannot overlap.
    unsafe {
        forward_inplace_cuda_raw(
            &gpu,
            stream,
            T::DTYPE,
            px,
            pr,
            pw.as_ref().map_or(0, |p| p.0),
            rows,
            cols,
            eps,
            rounding,
        )
    }
}

/// CUDA backward on `cudarc` buffers; allocates its scratch on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn backward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    grad_out: &CudaSlice<T>,
    grad_sum_out: Option<&CudaSlice<T>>,
    sum: &CudaSlice<T>,
    weight: Option<&CudaSlice<T>>,
    grad_sum: &mut CudaSlice<T>,
    grad_weight: Option<&mut CudaSlice<T>>,
    cols: usize,
    eps: f64,
) -> Result<()> {
    let rows = keel_cpu::fused_add_rms_norm::check_backward(
        grad_out.len(),
        grad_sum_out.map(|g| g.len()),
        sum.len(),
        weight.map(|w| w.len()),
        grad_sum.len(),
        grad_weight.as_deref().map(|g| g.len()),
        cols,
        eps,
    )?;
    let gpu = gpu(stream.context().ordinal())?;
    let scratch: CudaSlice<f32> = stream
        .alloc_zeros(super::rms_norm::backward_scratch_len(&gpu, rows, cols).max(1))
        .map_err(crate::error::driver("allocating scratch"))?;
    let (pg, _g1) = grad_out.device_ptr(stream);
    let pa = grad_sum_out.map(|g| g.device_ptr(stream));
    let (px, _g2) = sum.device_ptr(stream);
    let pw = weight.map(|w| w.device_ptr(stream));
    let (pgi, _g3) = grad_sum.device_ptr_mut(stream);
    let pgw = grad_weight.map(|g| g.device_ptr_mut(stream));
    let (ps, _g4) = scratch.device_ptr(stream);
    // SAFETY: lengths checked above, scratch sized by backward_scratch_len.
    unsafe {
        super::rms_norm::backward_add_cuda_raw(
            &gpu,
            stream,
            T::DTYPE,
            pg,
            pa.as_ref().map_or(0, |p| p.0),
            px,
            pw.as_ref().map_or(0, |p| p.0),
            pgi,
            pgw.as_ref().map_or(0, |p| p.0),
            ps,
            RowLayout::contiguous(rows, cols),
            cols,
            eps,
        )
    }
}
