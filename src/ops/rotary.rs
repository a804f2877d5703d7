//! Rotary position embedding for `x[batch, seq, heads, head_dim]` with `cos`,
//! `sin` of shape `[seq, rotary_dim / 2]`: GPT-NeoX (rotate halves) or GPT-J
//! (interleaved pairs) layout; dims past `rotary_dim` pass through. The
//! backward is the same rotation by the opposite angle (`inverse`).
//!
//! - Numerics: f32 math (f64 for f64), one rounding.
//! - CUDA: `lanes` threads per row (one head of one token), 16-byte loads
//!   where the layout allows, the position worked out once per row.
//! - Layout: the `_strided` functions read an `x` whose batch, seq and heads
//!   dims have any strides (see [`Strides`]); outputs are contiguous. The
//!   `_inplace` functions rotate such an `x` in place (vLLM's form).
pub use keel_cpu::rotary::{Shape, Strides};

use crate::cpu::{Element, Par};
use crate::cuda::{gpu, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::{Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use std::sync::Arc;

const MODULE: (&str, &str) = ("rotary", crate::ptx::ROTARY);

/// CPU: `out` = `x` rotated (by the opposite angle when `inverse`).
#[allow(clippy::too_many_arguments)]
pub fn apply_cpu<T: Element>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    out: &mut [T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::rotary::apply(x, cos, sin, out, shape, interleaved, inverse, par)?)
}

/// CPU, `x` laid out with `strides`: see [`keel_cpu::rotary::apply_strided`].
#[allow(clippy::too_many_arguments)]
pub fn apply_strided_cpu<T: Element>(
    x: &[T],
    strides: Strides,
    cos: &[T],
    sin: &[T],
    out: &mut [T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::rotary::apply_strided(x, strides, cos, sin, out, shape, interleaved, inverse, par)?)
}

/// CPU, in place: see [`keel_cpu::rotary::apply_inplace`].
#[allow(clippy::too_many_arguments)]
pub fn apply_inplace_cpu<T: Element>(
    x: &mut [T],
    strides: Strides,
    cos: &[T],
    sin: &[T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::rotary::apply_inplace(x, strides, cos, sin, shape, interleaved, inverse, par)?)
}

fn check_limits(op: &'static str, shape: &Shape) -> Result<()> {
    for (arg, v) in [("seq", shape.seq), ("heads", shape.heads), ("head_dim", shape.head_dim)] {
        if v > i32::MAX as usize {
            return Err(Error::Invalid { op, arg, msg: format!("{v} exceeds the kernel's limit of 2^31-1") });
        }
    }
    Ok(())
}

/// The checks of a launch: the shape, the kernel's 32-bit limits, and
/// strides whose span fits the kernel's 64-bit signed offsets (one that
/// overflows usize fails the check too). Returns the rows to launch, 0 for
/// an empty `x`.
fn check_launch(op: &'static str, shape: &Shape, strides: Strides) -> Result<usize> {
    check_limits(op, shape)?;
    let (n, half) = (shape.numel(), shape.rotary_dim / 2);
    let span = shape.span(strides).unwrap_or(usize::MAX);
    shape.check_strided(op, span, strides, shape.seq * half, shape.seq * half, n)?;
    if span > i64::MAX as usize {
        let msg = format!("strides {strides} reach past 2^63 elements");
        return Err(Error::Invalid { op, arg: "x", msg });
    }
    Ok(if n == 0 { 0 } else { shape.batch * shape.seq * shape.heads })
}

/// Threads per row (`lanes`: a power of two, up to 32, enough for one
/// 16-byte step over the larger of the rotated part and the pass-through) and
/// the launch: blocks of 256 threads, `256 / lanes` rows each at a time,
/// grid-stride, at most 8 blocks per SM.
fn config(sm_count: u32, dtype: DType, rows: usize, shape: &Shape, interleaved: bool) -> (usize, LaunchConfig) {
    let n = 16 / dtype.size();
    let half = shape.rotary_dim / 2;
    let rotated = if interleaved { 2 * half } else { half };
    let steps = rotated.max(shape.head_dim - 2 * half).div_ceil(n).max(1);
    let lanes = steps.next_power_of_two().min(32);
    let blocks = rows.div_ceil(256 / lanes).clamp(1, sm_count as usize * 8);
    (lanes, LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}

/// CUDA on raw device pointers; `x` laid out with `strides`
/// (`shape.contiguous()` for a contiguous one).
///
/// # Safety
/// `x` must be a device address on `stream`'s device holding
/// `shape.span(strides)` elements of `dtype`, `out` one holding
/// `shape.numel()`, `cos` and `sin` `seq * rotary_dim / 2`; `out` must not
/// overlap the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn apply_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    x: u64,
    strides: Strides,
    cos: u64,
    sin: u64,
    out: u64,
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { apply_on(&Stream { gpu, stream }, dtype, x, strides, cos, sin, out, shape, interleaved, inverse) }
}

/// [`apply_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`apply_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn apply_on(
    t: &dyn Target,
    dtype: DType,
    x: u64,
    strides: Strides,
    cos: u64,
    sin: u64,
    out: u64,
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward" } else { "rotary_embedding" };
    let rows = check_launch(op, &shape, strides)?;
    if rows == 0 {
        return Ok(());
    }
    let ptrs = [Arg::Ptr(x), Arg::Ptr(cos), Arg::Ptr(sin), Arg::Ptr(out)];
    // SAFETY: rotary_* takes x, cos, sin, out; pointers per our contract.
    unsafe { launch(t, dtype, "rotary", &ptrs, rows, &shape, strides, interleaved, inverse) }
}

/// Launches `kernel` (`rotary` or `rotary_inplace`, for `dtype`) over `rows`
/// rows: the pointer arguments `ptrs`, then those both kernels share.
///
/// # Safety
/// `ptrs` must be `kernel`'s pointer parameters, valid as the callers'
/// contracts say.
#[allow(clippy::too_many_arguments)]
unsafe fn launch(
    t: &dyn Target,
    dtype: DType,
    kernel: &str,
    ptrs: &[Arg],
    rows: usize,
    shape: &Shape,
    strides: Strides,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    let (lanes, cfg) = config(t.sm_count(), dtype, rows, shape, interleaved);
    let shared = [
        Arg::I64(rows as i64),
        Arg::I32(shape.seq as i32),
        Arg::I32(shape.heads as i32),
        Arg::I32(shape.head_dim as i32),
        Arg::I32((shape.rotary_dim / 2) as i32),
        Arg::I32(interleaved as i32),
        Arg::F32(if inverse { -1.0 } else { 1.0 }),
        Arg::I32(lanes as i32),
        Arg::I64(strides.batch as i64),
        Arg::I64(strides.seq as i64),
        Arg::I64(strides.heads as i64),
    ];
    let args: Vec<Arg> = ptrs.iter().chain(&shared).copied().collect();
    // SAFETY: the pointers per this function's contract, then the parameters
    // both kernels declare after them, in order.
    unsafe { t.launch(MODULE, &format!("{kernel}_{}", dtype.suffix()), cfg, &args) }
}

/// CUDA in place on raw device pointers: `x`, laid out with `strides`
/// (heads that do not overlap), becomes its rotation (vLLM's form).
///
/// # Safety
/// `x` must be a device address on `stream`'s device holding
/// `shape.span(strides)` elements of `dtype`, `cos` and `sin`
/// `seq * rotary_dim / 2`; `x` must not overlap them.
#[allow(clippy::too_many_arguments)]
pub unsafe fn apply_inplace_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    x: u64,
    strides: Strides,
    cos: u64,
    sin: u64,
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { apply_inplace_on(&Stream { gpu, stream }, dtype, x, strides, cos, sin, shape, interleaved, inverse) }
}

/// [`apply_inplace_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`apply_inplace_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn apply_inplace_on(
    t: &dyn Target,
    dtype: DType,
    x: u64,
    strides: Strides,
    cos: u64,
    sin: u64,
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward_" } else { "rotary_embedding_" };
    let rows = check_launch(op, &shape, strides)?;
    shape.check_disjoint(op, strides)?;
    if rows == 0 {
        return Ok(());
    }
    let ptrs = [Arg::Ptr(x), Arg::Ptr(cos), Arg::Ptr(sin)];
    // SAFETY: rotary_inplace_* takes x, cos, sin; pointers per our contract.
    unsafe { launch(t, dtype, "rotary_inplace", &ptrs, rows, &shape, strides, interleaved, inverse) }
}

/// CUDA in place on a `cudarc` buffer, `x` laid out with `strides` (heads
/// that do not overlap), launched on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn apply_inplace_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &mut CudaSlice<T>,
    strides: Strides,
    cos: &CudaSlice<T>,
    sin: &CudaSlice<T>,
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward_" } else { "rotary_embedding_" };
    shape.check_strided(op, x.len(), strides, cos.len(), sin.len(), shape.numel())?;
    let gpu = gpu(stream.context().ordinal())?;
    let (px, _g1) = x.device_ptr_mut(stream);
    let (pc, _g2) = cos.device_ptr(stream);
    let (ps, _g3) = sin.device_ptr(stream);
    // SAFETY: lengths checked above; `x` is borrowed mutably, so it overlaps neither input.
    unsafe { apply_inplace_cuda_raw(&gpu, stream, T::DTYPE, px, strides, pc, ps, shape, interleaved, inverse) }
}

/// CUDA on `cudarc` buffers, launched on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn apply_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &CudaSlice<T>,
    cos: &CudaSlice<T>,
    sin: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward" } else { "rotary_embedding" };
    shape.check(op, x.len(), cos.len(), sin.len(), out.len())?;
    apply_strided_cuda(stream, x, shape.contiguous(), cos, sin, out, shape, interleaved, inverse)
}

/// CUDA on `cudarc` buffers, `x` laid out with `strides` (it must hold at
/// least `shape.span(strides)` elements), launched on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn apply_strided_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &CudaSlice<T>,
    strides: Strides,
    cos: &CudaSlice<T>,
    sin: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    shape: Shape,
    interleaved: bool,
    inverse: bool,
) -> Result<()> {
    let op = if inverse { "rotary_embedding_backward" } else { "rotary_embedding" };
    shape.check_strided(op, x.len(), strides, cos.len(), sin.len(), out.len())?;
    let gpu = gpu(stream.context().ordinal())?;
    let (px, _g1) = x.device_ptr(stream);
    let (pc, _g2) = cos.device_ptr(stream);
    let (ps, _g3) = sin.device_ptr(stream);
    let (po, _g4) = out.device_ptr_mut(stream);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { apply_cuda_raw(&gpu, stream, T::DTYPE, px, strides, pc, ps, po, shape, interleaved, inverse) }
}
