//! Fused cross-entropy against probability targets ("soft labels": a float
//! target `[rows, cols]` shaped like the logits, of their dtype or, on CUDA,
//! another of f32, f16 and bf16: a teacher's float32 probabilities of a
//! student's 16-bit logits, or 16-bit ones of float32 logits, read as they
//! are; the loss is then f32, torch's promotion of the pair),
//! as `torch.nn.functional.cross_entropy(logits, p)` computes it; see
//! [`keel_cpu::cross_entropy_probs`] for the formulas. Class weights
//! (torch's `weight=`, `cols` of the target's dtype) are optional: `None` on
//! the CPU, a 0 pointer on CUDA. Re-exported by
//! [`crate::ops::cross_entropy`], whose class-index entry points these mirror.
//!
//! CUDA: one block per row, as for class indices, but no synchronisation: no
//! target can be out of range.
#[cfg(doc)]
use super::{backward_cpu, backward_cuda_raw, scratch_len};
use super::{reduction_code, scratch, single_block, Reduction, MODULE};
use crate::cpu::{Element, Par};
use crate::cuda::{gpu, launch_rows, Arg, CudaElement, CudaSlice, CudaStream, DType, Gpu, Stream, Target};
use crate::error::{Error, Result};
use crate::ops::{check_cols, check_len};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// CPU forward against probability targets `target` (`[rows, cols]`, as the
/// logits; see [`keel_cpu::cross_entropy_probs`]): the loss (`rows` values for
/// [`Reduction::None`], else one; `"mean"` over all rows), and each row's
/// log-sum-exp into `lse` when given; `weight`, the class weights (`cols`,
/// of the target's type) where given. `target` of `T`, or of another type of
/// its accumulation type (f32 for f16 and bf16 logits), read as it is; the
/// loss `out` of any type (torch's: the promotion of the logits' and the
/// target's).
#[allow(clippy::too_many_arguments)]
pub fn forward_probs_cpu<T: Element, P: Element<Acc = T::Acc>, O: Element>(
    logits: &[T],
    target: &[P],
    weight: Option<&[P]>,
    out: &mut [O],
    lse: Option<&mut [T::Acc]>,
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
    par: Par<'_>,
) -> Result<()> {
    use keel_cpu::cross_entropy_probs::forward;
    Ok(forward(logits, target, weight, out, lse, cols, label_smoothing, reduction, par)?)
}

/// CPU backward of [`forward_probs_cpu`]: `grad_logits`, given the forward's
/// `lse` (trusted, as [`backward_cpu`] trusts it) or recomputing it; `grad`
/// of the loss's type.
#[allow(clippy::too_many_arguments)]
pub fn backward_probs_cpu<T: Element, P: Element<Acc = T::Acc>, O: Element>(
    grad: &[O],
    logits: &[T],
    target: &[P],
    weight: Option<&[P]>,
    lse: Option<&[T::Acc]>,
    grad_logits: &mut [T],
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
    par: Par<'_>,
) -> Result<()> {
    use keel_cpu::cross_entropy_probs::backward;
    Ok(backward(grad, logits, target, weight, lse, grad_logits, cols, label_smoothing, reduction, par)?)
}

fn check_probs_dims(op: &'static str, rows: usize, cols: usize, label_smoothing: f64) -> Result<()> {
    check_cols(op, rows, cols)?;
    keel_cpu::cross_entropy_probs::check(op, rows * cols, rows * cols, None, cols, label_smoothing)?;
    Ok(())
}

/// The name of the probability kernel `kind` (`"rows"`, `"bwd"`, before the
/// logits' dtype suffix that [`launch_rows`] adds) for a target of `target`:
/// `cross_entropy_probs_{kind}` for the logits' `dtype`, else
/// `cross_entropy_probs_p{target}_{kind}` (every pair of f32, f16 and bf16
/// has one).
fn probs_kernel(kind: &str, dtype: DType, target: DType) -> String {
    if dtype == target {
        format!("cross_entropy_probs_{kind}")
    } else {
        format!("cross_entropy_probs_p{}_{kind}", target.suffix())
    }
}

/// The loss's dtype (and its gradient's) for logits of `dtype` and a target
/// of `target`: torch's promotion of the two, f32 where they differ.
pub fn probs_loss_dtype(dtype: DType, target: DType) -> DType {
    if dtype == target {
        dtype
    } else {
        DType::F32
    }
}

/// Checks that the loss's (or its gradient's) element type `O` is
/// [`probs_loss_dtype`] of the pair.
fn check_loss_type(op: &'static str, arg: &'static str, dtype: DType, target: DType, o: DType) -> Result<()> {
    let want = probs_loss_dtype(dtype, target);
    if o == want {
        return Ok(());
    }
    let msg = format!(
        "must be of {} (the loss's type for {} logits and a {} target), got {}",
        want.suffix(),
        dtype.suffix(),
        target.suffix(),
        o.suffix()
    );
    Err(Error::Invalid { op, arg, msg })
}

/// CUDA forward against probability targets (see [`forward_probs_cpu`]) on
/// raw device pointers. No synchronisation: no target is out of range. `lse`
/// is 0, or where each row's log-sum-exp is written (`rows` f32s); `weight`
/// is 0, or the class weights (`cols` of `target_dtype`). `target_dtype` is
/// any of the three; the loss has [`probs_loss_dtype`] (torch's promotion of
/// the two).
///
/// # Safety
/// `logits` (`rows * cols` of `dtype`) and `target` (`rows * cols` of
/// `target_dtype`), a non-zero
/// `weight` (`cols` of `target_dtype`), `out`
/// (`reduction.out_len(rows)` of the loss's dtype), `scratch` ([`scratch_len`] f32s)
/// and a non-zero `lse` must be device addresses on `stream`'s device; `out`,
/// `lse` and `scratch` must not overlap anything else.
#[allow(clippy::too_many_arguments)]
pub unsafe fn forward_probs_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    (dtype, target_dtype): (DType, DType),
    (logits, target, weight, out, lse, scratch): (u64, u64, u64, u64, u64, u64),
    rows: usize,
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
) -> Result<()> {
    let t = Stream { gpu, stream };
    let ptrs = (logits, target, weight, out, lse, scratch);
    // SAFETY: forwarded from this function's contract.
    unsafe { forward_probs_on(&t, (dtype, target_dtype), ptrs, rows, cols, label_smoothing, reduction) }
}

/// [`forward_probs_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`forward_probs_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_probs_on(
    t: &dyn Target,
    (dtype, target_dtype): (DType, DType),
    (logits, target, weight, out, lse, scratch): (u64, u64, u64, u64, u64, u64),
    rows: usize,
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
) -> Result<()> {
    check_probs_dims("cross_entropy", rows, cols, label_smoothing)?;
    let kernel = probs_kernel("rows", dtype, target_dtype);
    let (r, c) = (Arg::I64(rows as i64), Arg::I32(cols as i32));
    if rows > 0 {
        let ls = Arg::F32(label_smoothing as f32);
        let args = [Arg::Ptr(logits), Arg::Ptr(target), Arg::Ptr(weight), Arg::Ptr(scratch), Arg::Ptr(lse), r, c, ls];
        // SAFETY: matches cross_entropy_probs_rows_*; pointers per our contract.
        unsafe { launch_rows(t, MODULE, &kernel, dtype, rows, cols, &args)? };
    }
    let args = [Arg::Ptr(scratch), Arg::Ptr(out), r, Arg::I32(reduction_code(reduction))];
    let name = format!("cross_entropy_probs_reduce_{}", probs_loss_dtype(dtype, target_dtype).suffix());
    // SAFETY: matches cross_entropy_probs_reduce_*; pointers per our contract.
    unsafe { t.launch(MODULE, &name, single_block(), &args) }
}

/// CUDA backward of [`forward_probs_cuda_raw`]: `grad_logits` given the
/// forward's `lse` (`rows` f32s, trusted as [`backward_cuda_raw`] trusts it)
/// or, where `lse` is 0, recomputing it. No synchronisation.
///
/// # Safety
/// As [`forward_probs_cuda_raw`], with `grad` (`reduction.out_len(rows)` of
/// the loss's dtype) in place of `out`, `lse` an input, `weight` and `target_dtype` as there, and
/// `grad_logits` (`rows * cols`) not overlapping the inputs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward_probs_cuda_raw(
    gpu: &Gpu,
    stream: &CudaStream,
    (dtype, target_dtype): (DType, DType),
    (grad, logits, target, weight, lse, grad_logits): (u64, u64, u64, u64, u64, u64),
    rows: usize,
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
) -> Result<()> {
    let t = Stream { gpu, stream };
    let ptrs = (grad, logits, target, weight, lse, grad_logits);
    // SAFETY: forwarded from this function's contract.
    unsafe { backward_probs_on(&t, (dtype, target_dtype), ptrs, rows, cols, label_smoothing, reduction) }
}

/// [`backward_probs_cuda_raw`] on any [`Target`].
///
/// # Safety
/// As [`backward_probs_cuda_raw`], on `t`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn backward_probs_on(
    t: &dyn Target,
    (dtype, target_dtype): (DType, DType),
    (grad, logits, target, weight, lse, grad_logits): (u64, u64, u64, u64, u64, u64),
    rows: usize,
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
) -> Result<()> {
    check_probs_dims("cross_entropy_backward", rows, cols, label_smoothing)?;
    let kernel = probs_kernel("bwd", dtype, target_dtype);
    if rows == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(grad),
        Arg::Ptr(logits),
        Arg::Ptr(target),
        Arg::Ptr(weight),
        Arg::Ptr(lse),
        Arg::Ptr(grad_logits),
        Arg::I64(rows as i64),
        Arg::I32(cols as i32),
        Arg::F32(label_smoothing as f32),
        Arg::I32(reduction_code(reduction)),
    ];
    // SAFETY: matches cross_entropy_probs_bwd_*; pointers per our contract.
    unsafe { launch_rows(t, MODULE, &kernel, dtype, rows, cols, &args) }
}

/// CUDA forward against probability targets on `cudarc` buffers, launched on
/// `stream` (no synchronisation); each row's log-sum-exp into `lse` when
/// given; `weight`, the class weights (`cols`, of the target's type) where
/// given; `target` of any of the three types, and the loss of
/// [`probs_loss_dtype`] (`T` where `P` is `T`, else f32; an error otherwise).
#[allow(clippy::too_many_arguments)]
pub fn forward_probs_cuda<T: CudaElement, P: CudaElement, O: CudaElement>(
    stream: &Arc<CudaStream>,
    logits: &CudaSlice<T>,
    target: &CudaSlice<P>,
    weight: Option<&CudaSlice<P>>,
    out: &mut CudaSlice<O>,
    lse: Option<&mut CudaSlice<f32>>,
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
) -> Result<()> {
    const OP: &str = "cross_entropy";
    let wl = weight.map(|w| w.len());
    let rows = keel_cpu::cross_entropy_probs::check(OP, logits.len(), target.len(), wl, cols, label_smoothing)?;
    check_len(OP, "out", out.len(), reduction.out_len(rows))?;
    check_loss_type(OP, "out", T::DTYPE, P::DTYPE, O::DTYPE)?;
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
    let ptrs = (pl, pt, pw.unwrap_or(0), po, pe.unwrap_or(0), ps);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { forward_probs_cuda_raw(&gpu, stream, (T::DTYPE, P::DTYPE), ptrs, rows, cols, label_smoothing, reduction) }
}

/// CUDA backward of [`forward_probs_cuda`] on `cudarc` buffers, launched on
/// `stream`, given the forward's `lse` or recomputing it (`target` as there,
/// `grad` of the loss's type).
#[allow(clippy::too_many_arguments)]
pub fn backward_probs_cuda<T: CudaElement, P: CudaElement, O: CudaElement>(
    stream: &Arc<CudaStream>,
    grad: &CudaSlice<O>,
    logits: &CudaSlice<T>,
    target: &CudaSlice<P>,
    weight: Option<&CudaSlice<P>>,
    lse: Option<&CudaSlice<f32>>,
    grad_logits: &mut CudaSlice<T>,
    cols: usize,
    label_smoothing: f64,
    reduction: Reduction,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let wl = weight.map(|w| w.len());
    let rows = keel_cpu::cross_entropy_probs::check(OP, logits.len(), target.len(), wl, cols, label_smoothing)?;
    check_len(OP, "grad", grad.len(), reduction.out_len(rows))?;
    check_loss_type(OP, "grad", T::DTYPE, P::DTYPE, O::DTYPE)?;
    check_len(OP, "grad_logits", grad_logits.len(), logits.len())?;
    if let Some(l) = lse {
        check_len(OP, "lse", l.len(), rows)?;
    }
    let gpu = gpu(stream.context().ordinal())?;
    let (pg, _g1) = grad.device_ptr(stream);
    let (pl, _g2) = logits.device_ptr(stream);
    let (pt, _g3) = target.device_ptr(stream);
    let (pd, _g4) = grad_logits.device_ptr_mut(stream);
    let (pe, _g5) = lse.map(|l| l.device_ptr(stream)).unzip();
    let (pw, _g6) = weight.map(|w| w.device_ptr(stream)).unzip();
    let ptrs = (pg, pl, pt, pw.unwrap_or(0), pe.unwrap_or(0), pd);
    // SAFETY: lengths checked above; the buffers live on this stream's device.
    unsafe { backward_probs_cuda_raw(&gpu, stream, (T::DTYPE, P::DTYPE), ptrs, rows, cols, label_smoothing, reduction) }
}
