//! Fused cross-entropy over logits `[rows, cols]` and int64 class targets
//! `[rows]`, with `ignore_index`, label smoothing and the reductions `none`,
//! `mean`, `sum`, and class weights where given: the same as
//! `torch.nn.functional.cross_entropy`. No log-softmax is stored; the forward can hand back each row's
//! log-sum-exp (`lse`, one value per row in the accumulation type), which the
//! backward takes in place of recomputing it, so that it reads each row once.
//! Forward + backward need one logits-sized buffer (the gradient) beyond their
//! inputs.
//!
//! Targets outside `[0, cols)` that are not `ignore_index` are an error. On
//! CUDA that check reads a count back from the device, so the CUDA entry
//! points synchronise `stream` once per call; while `stream` is being
//! captured into a CUDA graph (`torch.cuda.graph`, `torch.compile`'s
//! "reduce-overhead") they cannot, and a bad target's row gets a NaN loss
//! and gradient (so a "mean" or "sum" is NaN) instead of the error. A CUDA
//! backward given the forward's `lse` does not check again: the forward that
//! wrote it checked the same targets (autograd saves both and refuses them
//! if either changed), so a training step synchronises once, not twice; a
//! bad target there gives its row a NaN gradient, as under capture.
//! [`set_cuda_target_checks`]`(false)` (or `KEEL_CUDA_TARGET_CHECKS=0` in the
//! environment) turns the check off for the process: no synchronisation at
//! all, and a bad target gives NaN as under capture.
//!
//! CUDA: one block per row; the row's max, sum of exp and (for label
//! smoothing) sum come from one read of it (online softmax). The backward
//! then reads the row once more to write the gradient, or, given the
//! forward's `lse`, only that once.
//!
//! Against probability targets (a float target shaped like the logits):
//! `forward_probs_*` and `backward_probs_*`, from `cross_entropy/probs.rs`.
pub use keel_cpu::cross_entropy::{Options, Reduction};

use super::{check_cols, check_len};
use crate::cpu::{Element, Par};
use crate::cuda::{gpu, launch_rows, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::{driver, Error, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use std::sync::Arc;

mod probs;
mod target_checks;
pub use probs::{
    backward_probs_cpu, backward_probs_cuda, backward_probs_cuda_raw, forward_probs_cpu, forward_probs_cuda,
    forward_probs_cuda_raw, probs_loss_dtype,
};
#[cfg(test)]
pub(crate) use probs::{backward_probs_on, forward_probs_on};
pub use target_checks::{cuda_target_checks, set_cuda_target_checks, TARGET_CHECKS_VAR};

const MODULE: (&str, &str) = ("cross_entropy", crate::ptx::CROSS_ENTROPY);

/// CPU forward: the loss (`rows` values for [`Reduction::None`], else one),
/// and each row's log-sum-exp into `lse` when given (`rows` values; 0 for
/// ignored rows). `weight`: class weights (`cols` values) or none, as torch's
/// (`"mean"` then divides by the sum of the weights of the rows not ignored).
#[allow(clippy::too_many_arguments)]
pub fn forward_cpu<T: Element>(
    logits: &[T],
    target: &[i64],
    weight: Option<&[T]>,
    out: &mut [T],
    lse: Option<&mut [T::Acc]>,
    cols: usize,
    opts: Options,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::cross_entropy::forward(logits, target, weight, out, lse, cols, opts, par)?)
}

/// CPU backward: `grad_logits` from the loss gradient `grad`, given the
/// forward's `lse` or recomputing it. A given `lse` must be the one the
/// forward wrote for these logits: it is trusted (another value gives a wrong
/// gradient, not an error). `weight`: the forward's class weights, or none.
#[allow(clippy::too_many_arguments)]
pub fn backward_cpu<T: Element>(
    grad: &[T],
    logits: &[T],
    target: &[i64],
    weight: Option<&[T]>,
    lse: Option<&[T::Acc]>,
    grad_logits: &mut [T],
    cols: usize,
    opts: Options,
    par: Par<'_>,
) -> Result<()> {
    Ok(keel_cpu::cross_entropy::backward(grad, logits, target, weight, lse, grad_logits, cols, opts, par)?)
}

/// f32 elements of device scratch the CUDA entry points need: the row losses
/// and two counters.
pub fn scratch_len(rows: usize) -> usize {
    rows + 2
}

fn reduction_code(r: Reduction) -> i32 {
    match r {
        Reduction::None => 0,
        Reduction::Mean => 1,
        Reduction::Sum => 2,
    }
}

fn single_block() -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 }
}

/// Reads the bad-target count that the kernels left after the row losses in
/// `scratch` (waiting for them), and turns a non-zero count into an error.
/// While the stream is being captured into a CUDA graph nothing may wait for
/// it, so nothing is read: a bad target's row then has a NaN loss (so a
/// "mean" or "sum" is NaN) and a NaN gradient, as the kernels leave them;
/// likewise where `t` does not check targets ([`Target::checks_targets`]).
///
/// # Safety
/// `scratch` must hold [`scratch_len`]`(rows)` f32s on `t`.
unsafe fn check_status(
    op: &'static str,
    t: &dyn Target,
    scratch: u64,
    rows: usize,
    opts: &Options,
    cols: usize,
) -> Result<()> {
    if !t.checks_targets() || t.capturing()? {
        return Ok(());
    }
    let mut status = [0i32; 2];
    // SAFETY: the two counters follow the rows f32 losses in scratch.
    unsafe { t.read_i32s("cross_entropy's target check", scratch + 4 * rows as u64, &mut status)? };
    if status[0] != 0 {
        return Err(Error::Invalid {
            op,
            arg: "target",
            msg: format!(
                "has {} value(s) out of range for {cols} classes (and not ignore_index = {})",
                status[0], opts.ignore_index
            ),
        });
    }
    Ok(())
}

fn check_dims(op: &'static str, rows: usize, cols: usize, opts: &Options) -> Result<()> {
    check_cols(op, rows, cols)?;
    keel_cpu::cross_entropy::check(op, rows * cols, rows, None, cols, opts)?;
    Ok(())
}

/// CUDA forward on raw device pointers; synchronises `stream` to check the
/// targets, except while `stream` is being captured into a CUDA graph or with
/// [`set_cuda_target_checks`]`(false)` (then a target out of range gives its
/// row a NaN loss instead of an error). `lse`
/// is 0, or where each row's log-sum-exp is written (`rows` f32s; 0 for
/// ignored rows); `weight` is 0, or the class weights (`cols` of `dtype`).
///
/// # Safety
/// `logits` (`rows * cols` of `dtype`), `target` (`rows` i64), a non-zero
/// `weight` (`cols` of `dtype`), `out`
/// (`opts.reduction.out_len(rows)` of `dtype`), `scratch` ([`scratch_len`]
/// f32s) and a non-zero `lse` must be device addresses on `stream`'s device;
/// `out`, `lse` and `scratch` must not overlap anything else.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    logits: u64,
    target: u64,
    weight: u64,
    out: u64,
    lse: u64,
    scratch: u64,
    rows: usize,
    cols: usize,
    opts: Options,
) -> Result<()> {
    let s = Stream { gpu, stream };
    // SAFETY: forwarded from this function's contract.
    unsafe { forward_on(&s, dtype, logits, target, weight, out, lse, scratch, rows, cols, opts) }
}

/// [`forward_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`forward_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_on(
    t: &dyn Target,
    dtype: DType,
    logits: u64,
    target: u64,
    weight: u64,
    out: u64,
    lse: u64,
    scratch: u64,
    rows: usize,
    cols: usize,
    opts: Options,
) -> Result<()> {
    const OP: &str = "cross_entropy";
    check_dims(OP, rows, cols, &opts)?;
    let s = dtype.suffix();
    let (r, c, ii) = (Arg::I64(rows as i64), Arg::I32(cols as i32), Arg::I64(opts.ignore_index));
    if rows > 0 {
        let ls = Arg::F32(opts.label_smoothing as f32);
        let args =
            [Arg::Ptr(logits), Arg::Ptr(target), Arg::Ptr(weight), Arg::Ptr(scratch), Arg::Ptr(lse), r, c, ii, ls];
        // SAFETY: matches cross_entropy_rows_*; pointers per our contract.
        unsafe { launch_rows(t, MODULE, "cross_entropy_rows", dtype, rows, cols, &args)? };
    }
    let args = [
        Arg::Ptr(scratch),
        Arg::Ptr(target),
        Arg::Ptr(weight),
        Arg::Ptr(scratch + 4 * rows as u64),
        Arg::Ptr(out),
        Arg::I64(rows as i64),
        Arg::I32(cols as i32),
        Arg::I64(opts.ignore_index),
        Arg::I32(reduction_code(opts.reduction)),
    ];
    // SAFETY: matches cross_entropy_reduce_*; pointers per our contract.
    unsafe { t.launch(MODULE, &format!("cross_entropy_reduce_{s}"), single_block(), &args)? };
    // SAFETY: scratch per our contract.
    unsafe { check_status(OP, t, scratch, rows, &opts, cols) }
}

/// CUDA backward on raw device pointers. `lse` is 0 (recomputed), or the
/// forward's `rows` f32s. Without `lse` it synchronises `stream` to check the
/// targets, except during graph capture or with the check off (see
/// [`forward_cuda_raw`]); with it, it
/// does not: the targets must be those the forward that wrote `lse` checked
/// (a bad one gives its row a NaN gradient, no error).
///
/// # Safety
/// As [`forward_cuda_raw`], with `grad` (`opts.reduction.out_len(rows)`
/// elements) in place of `out`, `lse` an input, `weight` the forward's, and
/// `grad_logits` (`rows * cols`) not overlapping the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    dtype: DType,
    grad: u64,
    logits: u64,
    target: u64,
    weight: u64,
    lse: u64,
    grad_logits: u64,
    scratch: u64,
    rows: usize,
    cols: usize,
    opts: Options,
) -> Result<()> {
    let s = Stream { gpu, stream };
    // SAFETY: forwarded from this function's contract.
    unsafe { backward_on(&s, dtype, grad, logits, target, weight, lse, grad_logits, scratch, rows, cols, opts) }
}

/// [`backward_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`backward_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn backward_on(
    t: &dyn Target,
    dtype: DType,
    grad: u64,
    logits: u64,
    target: u64,
    weight: u64,
    lse: u64,
    grad_logits: u64,
    scratch: u64,
    rows: usize,
    cols: usize,
    opts: Options,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    check_dims(OP, rows, cols, &opts)?;
    let status = scratch + 4 * rows as u64;
    let (pt, pw, ps) = (Arg::Ptr(target), Arg::Ptr(weight), Arg::Ptr(status));
    let args = [pt, pw, ps, Arg::I64(rows as i64), Arg::I32(cols as i32), Arg::I64(opts.ignore_index)];
    // SAFETY: matches cross_entropy_count_*; pointers per our contract.
    unsafe { t.launch(MODULE, &format!("cross_entropy_count_{}", dtype.suffix()), single_block(), &args)? };
    if rows > 0 {
        let args = [
            Arg::Ptr(grad),
            Arg::Ptr(logits),
            Arg::Ptr(target),
            Arg::Ptr(weight),
            Arg::Ptr(lse),
            Arg::Ptr(status),
            Arg::Ptr(grad_logits),
            Arg::I64(rows as i64),
            Arg::I32(cols as i32),
            Arg::I64(opts.ignore_index),
            Arg::F32(opts.label_smoothing as f32),
            Arg::I32(reduction_code(opts.reduction)),
        ];
        // SAFETY: matches cross_entropy_bwd_*; pointers per our contract.
        unsafe { launch_rows(t, MODULE, "cross_entropy_bwd", dtype, rows, cols, &args)? };
    }
    if lse != 0 {
        // The forward that wrote `lse` checked these targets (our contract).
        return Ok(());
    }
    // SAFETY: scratch per our contract.
    unsafe { check_status(OP, t, scratch, rows, &opts, cols) }
}

fn scratch(stream: &Arc<CudaStream>, rows: usize) -> Result<CudaSlice<f32>> {
    stream.alloc_zeros::<f32>(scratch_len(rows)).map_err(driver("allocating cross_entropy scratch"))
}

/// CUDA forward on `cudarc` buffers, launched on `stream` (which it
/// synchronises, except during graph capture or with the check off: see
/// [`forward_cuda_raw`]); each
/// row's log-sum-exp into `lse` when given; class weights `weight` where given.
#[allow(clippy::too_many_arguments)]
pub fn forward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    logits: &CudaSlice<T>,
    target: &CudaSlice<i64>,
    weight: Option<&CudaSlice<T>>,
    out: &mut CudaSlice<T>,
    lse: Option<&mut CudaSlice<f32>>,
    cols: usize,
    opts: Options,
) -> Result<()> {
    const OP: &str = "cross_entropy";
    let rows = keel_cpu::cross_entropy::check(OP, logits.len(), target.len(), weight.map(|w| w.len()), cols, &opts)?;
    check_len(OP, "out", out.len(), opts.reduction.out_len(rows))?;
    if let Some(l) = &lse {
        check_len(OP, "lse", l.len(), rows)?;
    }
    let gpu = gpu(stream.context().ordinal())?;
    let sc = scratch(stream, rows)?;
    let (pl, _g1) = logits.device_ptr(stream);
    let (pt, _g2) = target.device_ptr(stream);
    let (po, _g3) = out.device_ptr_mut(stream);
    let (ps, _g4) = sc.device_ptr(stream);
    let (pe, _g5) = lse.map(|l| l.device_ptr_mut(stream)).unzip();
    let (pw, _g6) = weight.map(|w| w.device_ptr(stream)).unzip();
    let (pw, pe) = (pw.unwrap_or(0), pe.unwrap_or(0));
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { forward_cuda_raw(&gpu, stream, T::DTYPE, pl, pt, pw, po, pe, ps, rows, cols, opts) }
}

/// CUDA backward on `cudarc` buffers, launched on `stream`, given the
/// forward's `lse` or recomputing it. Without `lse` it synchronises `stream`
/// to check the targets (except during graph capture or with the check off);
/// with it, the targets
/// must be the ones that forward checked (see [`backward_cuda_raw`]).
/// `weight`: the forward's class weights, or none.
#[allow(clippy::too_many_arguments)]
pub fn backward_cuda<T: CudaElement>(
    stream: &Arc<CudaStream>,
    grad: &CudaSlice<T>,
    logits: &CudaSlice<T>,
    target: &CudaSlice<i64>,
    weight: Option<&CudaSlice<T>>,
    lse: Option<&CudaSlice<f32>>,
    grad_logits: &mut CudaSlice<T>,
    cols: usize,
    opts: Options,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let rows = keel_cpu::cross_entropy::check(OP, logits.len(), target.len(), weight.map(|w| w.len()), cols, &opts)?;
    check_len(OP, "grad", grad.len(), opts.reduction.out_len(rows))?;
    check_len(OP, "grad_logits", grad_logits.len(), logits.len())?;
    if let Some(l) = lse {
        check_len(OP, "lse", l.len(), rows)?;
    }
    let gpu = gpu(stream.context().ordinal())?;
    let sc = scratch(stream, rows)?;
    let (pg, _g1) = grad.device_ptr(stream);
    let (pl, _g2) = logits.device_ptr(stream);
    let (pt, _g3) = target.device_ptr(stream);
    let (pd, _g4) = grad_logits.device_ptr_mut(stream);
    let (ps, _g5) = sc.device_ptr(stream);
    let (pe, _g6) = lse.map(|l| l.device_ptr(stream)).unzip();
    let (pw, _g7) = weight.map(|w| w.device_ptr(stream)).unzip();
    let (pw, pe) = (pw.unwrap_or(0), pe.unwrap_or(0));
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { backward_cuda_raw(&gpu, stream, T::DTYPE, pg, pl, pt, pw, pe, pd, ps, rows, cols, opts) }
}
