//! RMS normalisation over the last dimension: `y = x / sqrt(mean(x^2) + eps) * w`.
//!
//! Matches `torch.nn.functional.rms_norm(x, (cols,), w, eps)`.
//! - Shapes: `x`, `y`, `grad_*` hold `rows * cols` elements (row-major),
//!   `weight` and `grad_weight` hold `cols`.
//! - Dtypes: f32, f16, bf16 on CPU and CUDA; f64 on CPU.
//! - Numerics: f32 accumulation (f64 for f64 inputs), one rounding to the
//!   output type; or, with [`Rounding::BeforeWeight`] (the `_strided`
//!   functions and [`forward_cuda_raw`]), `x / rms` rounded to it before the
//!   weight multiplies it, as Hugging Face's `LlamaRMSNorm`. Tolerance against an f64 reference: f32 `1e-5` abs + `1.3e-6`
//!   rel per `sqrt(cols)`-sized sum, f16 `1e-3` rel, bf16 `1.6e-2` rel (the
//!   `torch.testing` defaults; see `tests/rms_norm_cpu.rs`).
//! - Layout: the forward's `_strided` functions and [`forward_cuda_raw`] read
//!   rows placed by a [`RowLayout`] (a strided view, each row contiguous).
//! - CUDA: one block per row, 128-bit loads, warp-shuffle sums; the backward
//!   sums the weight gradient per block into an f32 scratch
//!   ([`backward_scratch_len`]) and then over blocks, so it is deterministic.
use super::{norm_backward_config, reduce_parts, sum_parts};
use crate::cpu::{Element, Par, RowLayout};
use crate::cuda::{gpu, rows_config, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::{Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
pub use keel_cpu::rms_norm::Rounding;
use std::sync::Arc;

const OP: &str = "rms_norm";
const MODULE: (&str, &str) = ("rms_norm", crate::ptx::RMS_NORM);

/// CPU forward: `out = rms_norm(x) * weight`. See [`keel_cpu::rms_norm::forward`].
pub fn forward_cpu<T: Element>(
    x: &[T],
    weight: Option<&[T]>,
    out: &mut [T],
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::rms_norm::forward(x, weight, out, cols, eps, par)?)
}

/// CPU backward. See [`keel_cpu::rms_norm::backward`].
#[allow(clippy::too_many_arguments)]
pub fn backward_cpu<T: Element>(
    grad_out: &[T],
    x: &[T],
    weight: Option<&[T]>,
    grad_input: &mut [T],
    grad_weight: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::rms_norm::backward(grad_out, x, weight, grad_input, grad_weight, cols, eps, par)?)
}

/// CPU forward of an `x` whose rows `layout` places, rounding as `rounding`
/// says. See [`keel_cpu::rms_norm::forward_strided`].
#[allow(clippy::too_many_arguments)]
pub fn forward_strided_cpu<T: Element>(
    x: &[T],
    layout: RowLayout,
    weight: Option<&[T]>,
    out: &mut [T],
    cols: usize,
    eps: f64,
    rounding: Rounding,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::rms_norm::forward_strided(x, layout, weight, out, cols, eps, rounding, par)?)
}

/// CPU backward of an `x` whose rows `layout` places. See
/// [`keel_cpu::rms_norm::backward_strided`].
#[allow(clippy::too_many_arguments)]
pub fn backward_strided_cpu<T: Element>(
    grad_out: &[T],
    x: &[T],
    layout: RowLayout,
    weight: Option<&[T]>,
    grad_input: &mut [T],
    grad_weight: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::rms_norm::backward_strided(grad_out, x, layout, weight, grad_input, grad_weight, cols, eps, par)?)
}

/// The kernels' own limits, then the shape and `eps` checks the CPU kernel uses.
fn check_dims(rows: usize, cols: usize, eps: f64) -> Result<()> {
    super::check_cols(OP, rows, cols)?;
    let n = rows * cols;
    keel_cpu::rms_norm::check_forward(n, None, n, cols, eps)?;
    Ok(())
}

/// The rows the kernels run over for `x`'s `layout`, after [`check_dims`]:
/// none where rows have no elements (as the contiguous op counts them). The
/// kernels take 64-bit signed offsets, so the layout's span must fit them.
fn rows_to_launch(layout: RowLayout, cols: usize, eps: f64) -> Result<usize> {
    let rows = if cols == 0 { 0 } else { layout.rows() };
    check_dims(rows, cols, eps)?;
    if layout.span(cols).is_none_or(|s| s > i64::MAX as usize) {
        let msg = format!("layout {layout:?} reaches past 2^63 elements");
        return Err(Error::Invalid { op: OP, arg: "input", msg });
    }
    Ok(rows)
}

/// Whether a CUDA forward rounds `x / rms` to `dtype` before the weight
/// (`weight` its device address, 0 for none): only where `rounding` asks,
/// there is a weight, and `dtype` is narrower than f32 (f32 values are
/// already rounded to f32; the CPU kernels skip it too). Shared with
/// `fused_add_rms_norm`.
pub(crate) fn rounds_first(rounding: Rounding, weight: u64, dtype: DType) -> bool {
    rounding == Rounding::BeforeWeight && weight != 0 && dtype.size() < 4
}

/// f32 elements of scratch that [`backward_cuda_raw`] needs.
pub fn backward_scratch_len(gpu: &Gpu, rows: usize, cols: usize) -> usize {
    reduce_parts(gpu.sm_count(), rows) * cols
}

/// CUDA forward on raw device pointers (`weight` 0 for none), launched on
/// `stream`; `x`'s rows placed by `layout` (`RowLayout::contiguous(rows,
/// cols)` for a contiguous one), `out` contiguous; rounding as `rounding`
/// says.
///
/// # Safety
/// Every pointer must be a device address on `stream`'s device, valid for
/// `layout.span(cols)` elements of `dtype` (`x`), `layout.rows() * cols`
/// (`out`) or `cols` (`weight`), and `out` must not overlap the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    x: u64,
    layout: RowLayout,
    weight: u64,
    out: u64,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { forward_on(&Stream { gpu, stream }, dtype, x, layout, weight, out, cols, eps, rounding) }
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
    layout: RowLayout,
    weight: u64,
    out: u64,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    let rows = rows_to_launch(layout, cols, eps)?;
    if rows == 0 {
        return Ok(());
    }
    let round = rounds_first(rounding, weight, dtype);
    let ([_, n1, n2], [s0, s1, s2]) = (layout.sizes(), layout.strides());
    let (cfg, warp_rows) = forward_config(t.sm_count(), rows, cols, dtype.size());
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(weight),
        Arg::Ptr(out),
        Arg::I64(rows as i64),
        Arg::I32(cols as i32),
        Arg::F32(eps as f32),
        Arg::I64(n1 as i64),
        Arg::I64(n2 as i64),
        Arg::I64(s0 as i64),
        Arg::I64(s1 as i64),
        Arg::I64(s2 as i64),
        Arg::I32(i32::from(round)),
    ];
    let kernel = if warp_rows { "rms_norm_fwd_warp_rows" } else { "rms_norm_fwd" };
    // SAFETY: the argument list matches rms_norm_fwd_* and rms_norm_fwd_warp_rows_*; pointers per our contract.
    unsafe { t.launch(MODULE, &format!("{kernel}_{}", dtype.suffix()), cfg, &args) }
}

/// The forward's launch, and whether it runs `rms_norm_fwd_warp_rows`:
/// [`rows_config`]'s, or, for rows it gives one warp (at most 128 16-byte
/// vectors, as QK-norm's 128-wide heads), blocks of eight warps that each take
/// their own rows, with no block barriers, so that an SM holds 2048 threads
/// instead of 16 blocks of 32. A warp reads `32 / row_team` rows at once
/// (the kernel's `row_team`: the lanes a row takes, one vector each up to
/// 32; the same bits as a team of 32).
fn forward_config(sm_count: u32, rows: usize, cols: usize, elem_bytes: usize) -> (LaunchConfig, bool) {
    let cfg = rows_config(rows, cols, elem_bytes, sm_count * 16);
    if cfg.block_dim.0 > 32 || rows < 2 {
        return (cfg, false);
    }
    let warps = 8u32;
    let per_warp = 32 / row_team(cols.div_ceil(16 / elem_bytes));
    let per_block = (warps * per_warp * 2) as u64; // the kernel's G = 2 groups a warp
    let blocks = (rows as u64).div_ceil(per_block).min(sm_count as u64 * 8) as u32;
    (LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * warps, 1, 1), shared_mem_bytes: 0 }, true)
}

/// Lanes a row of `packs` 16-byte vectors takes in `rms_norm_fwd_warp_rows`,
/// as `row_team` in kernels-cuda/common.cuh: the fewest, a power of two up to
/// 32, that give none more than one vector.
fn row_team(packs: usize) -> u32 {
    packs.clamp(1, 32).next_power_of_two() as u32
}

/// CUDA backward on raw device pointers (`weight`, `grad_weight` 0 for none).
///
/// # Safety
/// As [`forward_cuda_raw`]; `scratch` must hold [`backward_scratch_len`] f32s
/// when `grad_weight` is given.
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
    scratch: u64,
    layout: RowLayout,
    cols: usize,
    eps: f64,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract, with no addend.
    unsafe {
        backward_add_cuda_raw(
            gpu,
            stream,
            dtype,
            grad_out,
            0,
            x,
            weight,
            grad_input,
            grad_weight,
            scratch,
            layout,
            cols,
            eps,
        )
    }
}

/// [`backward_cuda_raw`] adding `grad_add` (0 for none; `rows * cols`
/// elements) to `grad_input`: the backward of `fused_add_rms_norm`.
///
/// # Safety
/// As [`backward_cuda_raw`], and `grad_add` valid like `grad_out`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward_add_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    grad_out: u64,
    grad_add: u64,
    x: u64,
    weight: u64,
    grad_input: u64,
    grad_weight: u64,
    scratch: u64,
    layout: RowLayout,
    cols: usize,
    eps: f64,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        backward_add_on(
            &Stream { gpu, stream },
            dtype,
            grad_out,
            grad_add,
            x,
            weight,
            grad_input,
            grad_weight,
            scratch,
            layout,
            cols,
            eps,
        )
    }
}

/// [`backward_add_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`backward_add_cuda_raw`], on `t`, with `scratch` holding
/// `reduce_parts(t.sm_count(), rows) * cols` f32s when `grad_weight` is given.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn backward_add_on(
    t: &dyn Target,
    dtype: DType,
    grad_out: u64,
    grad_add: u64,
    x: u64,
    weight: u64,
    grad_input: u64,
    grad_weight: u64,
    scratch: u64,
    layout: RowLayout,
    cols: usize,
    eps: f64,
) -> Result<()> {
    let rows = rows_to_launch(layout, cols, eps)?;
    if grad_weight != 0 && weight == 0 {
        return Err(Error::Invalid { op: OP, arg: "grad_weight", msg: "given but weight is None".into() });
    }
    let keep = t.norm_keep(OP)?;
    let (cfg, parts, kernel) = norm_backward_config(t.sm_count(), rows, cols, dtype.size(), keep);
    let partial = if grad_weight != 0 { scratch } else { 0 };
    let s = dtype.suffix();
    if rows > 0 {
        let ([_, n1, n2], [s0, s1, s2]) = (layout.sizes(), layout.strides());
        let args = [
            Arg::Ptr(grad_out),
            Arg::Ptr(grad_add),
            Arg::Ptr(x),
            Arg::Ptr(weight),
            Arg::Ptr(grad_input),
            Arg::Ptr(partial),
            Arg::I64(rows as i64),
            Arg::I32(cols as i32),
            Arg::F32(eps as f32),
            Arg::I64(n1 as i64),
            Arg::I64(n2 as i64),
            Arg::I64(s0 as i64),
            Arg::I64(s1 as i64),
            Arg::I64(s2 as i64),
        ];
        // SAFETY: matches rms_norm_bwd{,2,2h,2s}_*; pointers per our contract.
        unsafe { t.launch(MODULE, &format!("rms_norm_{}_{s}", kernel.stem()), cfg, &args)? };
    }
    if grad_weight != 0 && cols > 0 {
        // SAFETY: `partial` holds parts * cols f32s, `grad_weight` cols elements.
        unsafe { sum_parts(t, MODULE, &format!("rms_norm_bwd_dw_{s}"), partial, grad_weight, parts, cols)? };
    }
    Ok(())
}

/// CUDA forward on `cudarc` buffers, launched on `stream`.
pub fn forward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &CudaSlice<T>,
    weight: Option<&CudaSlice<T>>,
    out: &mut CudaSlice<T>,
    cols: usize,
    eps: f64,
) -> Result<()> {
    let rows = keel_cpu::rms_norm::check_forward(x.len(), weight.map(|w| w.len()), out.len(), cols, eps)?;
    forward_strided_cuda(stream, x, RowLayout::contiguous(rows, cols), weight, out, cols, eps, Rounding::Once)
}

/// CUDA forward on `cudarc` buffers, `x`'s rows placed by `layout` (it must
/// hold at least `layout.span(cols)` elements), launched on `stream`,
/// rounding as `rounding` says.
#[allow(clippy::too_many_arguments)]
pub fn forward_strided_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    x: &CudaSlice<T>,
    layout: RowLayout,
    weight: Option<&CudaSlice<T>>,
    out: &mut CudaSlice<T>,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Result<()> {
    let n = layout.rows() * cols;
    keel_cpu::rms_norm::check_forward(n, weight.map(|w| w.len()), out.len(), cols, eps)?;
    layout.check_len(OP, "input", x.len(), cols)?;
    let gpu = gpu(stream.context().ordinal())?;
    let (px, _gx) = x.device_ptr(stream);
    let pw = weight.map(|w| w.device_ptr(stream));
    let (po, _go) = out.device_ptr_mut(stream);
    // SAFETY: lengths checked above; the buffers live on this stream's device
    // and the guards keep cudarc's event tracking in order.
    let pw = pw.as_ref().map_or(0, |p| p.0);
    unsafe { forward_cuda_raw(&gpu, stream, T::DTYPE, px, layout, pw, po, cols, eps, rounding) }
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
    cols: usize,
    eps: f64,
) -> Result<()> {
    let rows = keel_cpu::rms_norm::check_backward(
        grad_out.len(),
        x.len(),
        weight.map(|w| w.len()),
        grad_input.len(),
        grad_weight.as_deref().map(|g| g.len()),
        cols,
        eps,
    )?;
    let layout = RowLayout::contiguous(rows, cols);
    backward_strided_cuda(stream, grad_out, x, layout, weight, grad_input, grad_weight, cols, eps)
}

/// [`backward_cuda`] of an `x` whose rows `layout` places (it must hold at
/// least `layout.span(cols)` elements); the other buffers are contiguous.
#[allow(clippy::too_many_arguments)]
pub fn backward_strided_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    grad_out: &CudaSlice<T>,
    x: &CudaSlice<T>,
    layout: RowLayout,
    weight: Option<&CudaSlice<T>>,
    grad_input: &mut CudaSlice<T>,
    grad_weight: Option<&mut CudaSlice<T>>,
    cols: usize,
    eps: f64,
) -> Result<()> {
    let rows = layout.rows();
    keel_cpu::rms_norm::check_backward(
        grad_out.len(),
        rows * cols,
        weight.map(|w| w.len()),
        grad_input.len(),
        grad_weight.as_deref().map(|g| g.len()),
        cols,
        eps,
    )?;
    layout.check_len(OP, "input", x.len(), cols)?;
    let gpu = gpu(stream.context().ordinal())?;
    let scratch: CudaSlice<f32> = stream
        .alloc_zeros(backward_scratch_len(&gpu, rows, cols).max(1))
        .map_err(crate::error::driver("allocating scratch"))?;
    let (pg, _g1) = grad_out.device_ptr(stream);
    let (px, _g2) = x.device_ptr(stream);
    let pw = weight.map(|w| w.device_ptr(stream));
    let (pgi, _g3) = grad_input.device_ptr_mut(stream);
    let pgw = grad_weight.map(|g| g.device_ptr_mut(stream));
    let (ps, _g4) = scratch.device_ptr(stream);
    // SAFETY: lengths checked above, scratch sized by backward_scratch_len.
    unsafe {
        backward_cuda_raw(
            &gpu,
            stream,
            T::DTYPE,
            pg,
            px,
            pw.as_ref().map_or(0, |p| p.0),
            pgi,
            pgw.as_ref().map_or(0, |p| p.0),
            ps,
            layout,
            cols,
            eps,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_team_gives_each_lane_at_most_one_vector() {
        // As kernels-cuda/common.cuh's row_team: a head of 128 bf16 (16 vectors)
        // takes 16 lanes, one of 128 f32 (32 vectors) the whole warp.
        assert_eq!([0, 1, 2, 3, 5, 16, 17, 32, 33, 128].map(row_team), [1, 1, 2, 4, 8, 16, 32, 32, 32, 32]);
        for packs in 1..=32 {
            let team = row_team(packs) as usize;
            assert!(team >= packs && (team == 1 || team / 2 < packs));
        }
    }

    #[test]
    fn forward_config_covers_every_row_once_a_pass() {
        // 4096 tokens x 32 heads of 128 bf16: 32 rows a block of 8 warps.
        let (cfg, warp_rows) = forward_config(132, 4096 * 32, 128, 2);
        assert!(warp_rows);
        assert_eq!((cfg.grid_dim.0, cfg.block_dim.0), (132 * 8, 256));
        let (cfg, warp_rows) = forward_config(132, 100, 128, 2);
        assert!(warp_rows);
        assert_eq!(cfg.grid_dim.0, 4); // ceil(100 / 32)
        let (cfg, warp_rows) = forward_config(132, 100, 4096, 4);
        assert!(!warp_rows);
        assert!(cfg.block_dim.0 > 32);
    }
}
