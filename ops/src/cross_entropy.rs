//! `keel::cross_entropy` and `keel::cross_entropy_backward`.
//!
//! `cross_entropy(Tensor logits, Tensor target, int ignore_index=-100,
//! float label_smoothing=0.0, str reduction="mean") -> Tensor` for logits
//! `[N, V]` and int64 `target[N]`, as `torch.nn.functional.cross_entropy`.
//! `cross_entropy_backward(grad, logits, target, ignore_index, label_smoothing,
//! reduction) -> grad_logits` recomputes the softmax from the logits (fused:
//! nothing logits-sized is saved by the forward).
use crate::checks::{self, invalid, with_float_type, Rows};
use crate::device::{check_err, kernel_err, ptr, CudaCall};
use crate::torch_pool::with_torch_par;
use keel::ops::cross_entropy::{Options, Reduction};
use keel_abi::{BoxedOp, DeviceType, Result, ScalarType, Tensor};

/// Checks logits, target and the options.
fn check(
    op: &'static str,
    logits: &Tensor,
    target: &Tensor,
    ii: i64,
    ls: f64,
    reduction: &str,
) -> Result<(Rows, Options)> {
    let c = checks::rows_of(op, "logits", logits)?;
    let s = logits.sizes()?;
    if s.len() != 2 {
        return Err(invalid(op, "logits", format!("must have 2 dims [N, V], got shape {s:?}")));
    }
    checks::same_device(op, "target", target, "logits", c.device)?;
    if target.dtype()? != ScalarType::I64 {
        return Err(invalid(
            op,
            "target",
            format!("must have dtype torch.int64 (class indices), got {}", target.dtype()?),
        ));
    }
    if target.sizes()? != [s[0]] {
        return Err(invalid(
            op,
            "target",
            format!("must have shape [{}] (logits' first dim), got {:?}", s[0], target.sizes()?),
        ));
    }
    checks::contiguous(op, "target", target)?;
    // The kernels' own checks of V > 0 and the options, for every device.
    let reduction = Reduction::parse(op, reduction).map_err(check_err)?;
    let opts = Options { ignore_index: ii, label_smoothing: ls, reduction };
    keel::cpu::cross_entropy::check(op, c.rows * c.cols, c.rows, c.cols, &opts).map_err(check_err)?;
    Ok((c, opts))
}

fn loss_shape(c: &Rows, reduction: Reduction) -> Vec<i64> {
    if reduction == Reduction::None {
        vec![c.rows as i64]
    } else {
        vec![]
    }
}

/// `cross_entropy`.
pub(crate) struct CrossEntropy;

impl BoxedOp for CrossEntropy {
    const NAME: &'static str = "cross_entropy";
    type Args = (Tensor, Tensor, i64, f64, String);
    type Out = (Tensor,);

    fn run((logits, target, ii, ls, reduction): Self::Args) -> Result<Self::Out> {
        let op = Self::NAME;
        let (c, opts) = check(op, &logits, &target, ii, ls, &reduction)?;
        let out = Tensor::empty(&loss_shape(&c, opts.reduction), c.dtype, c.device)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors (logits of T, target of i64); `out` is fresh.
                let (x, t, y) = unsafe { (logits.as_slice::<T>()?, target.as_slice::<i64>()?, out.as_mut_slice::<T>()?) };
                with_torch_par(|par| keel::ops::cross_entropy::forward_cpu(x, t, y, c.cols, opts, par)).map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(op, c.device)?;
                let dtype = checks::cuda_dtype(c.dtype)?;
                let n = keel::ops::cross_entropy::scratch_len(c.rows) as i64;
                let scratch = Tensor::empty(&[n], ScalarType::F32, c.device)?;
                let (px, pt, po, ps) =
                    (ptr(Some(&logits))?, ptr(Some(&target))?, ptr(Some(&out))?, ptr(Some(&scratch))?);
                // SAFETY: checked contiguous CUDA tensors on the guarded device; `out` and `scratch` are fresh.
                unsafe {
                    keel::ops::cross_entropy::forward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        dtype,
                        px,
                        pt,
                        po,
                        ps,
                        c.rows,
                        c.cols,
                        opts,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((out,))
    }
}

/// `cross_entropy_backward`.
pub(crate) struct CrossEntropyBackward;

impl BoxedOp for CrossEntropyBackward {
    const NAME: &'static str = "cross_entropy_backward";
    type Args = (Tensor, Tensor, Tensor, i64, f64, String);
    type Out = (Tensor,);

    fn run((grad, logits, target, ii, ls, reduction): Self::Args) -> Result<Self::Out> {
        let op = Self::NAME;
        let (c, opts) = check(op, &logits, &target, ii, ls, &reduction)?;
        checks::same_device(op, "grad", &grad, "logits", c.device)?;
        checks::same_dtype(op, "grad", &grad, "logits", c.dtype)?;
        let want = loss_shape(&c, opts.reduction);
        if grad.sizes()? != want.as_slice() {
            return Err(invalid(op, "grad", format!("must have shape {want:?} (the loss's), got {:?}", grad.sizes()?)));
        }
        checks::contiguous(op, "grad", &grad)?;
        let grad_logits = c.empty_like(&logits)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors; `grad_logits` is fresh.
                let (g, x, t, dx) = unsafe {
                    (grad.as_slice::<T>()?, logits.as_slice::<T>()?, target.as_slice::<i64>()?, grad_logits.as_mut_slice::<T>()?)
                };
                with_torch_par(|par| keel::ops::cross_entropy::backward_cpu(g, x, t, dx, c.cols, opts, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(op, c.device)?;
                let dtype = checks::cuda_dtype(c.dtype)?;
                let n = keel::ops::cross_entropy::scratch_len(c.rows) as i64;
                let scratch = Tensor::empty(&[n], ScalarType::F32, c.device)?;
                let (pg, px, pt) = (ptr(Some(&grad))?, ptr(Some(&logits))?, ptr(Some(&target))?);
                let (pd, ps) = (ptr(Some(&grad_logits))?, ptr(Some(&scratch))?);
                // SAFETY: checked contiguous CUDA tensors on the guarded device; outputs are fresh.
                unsafe {
                    keel::ops::cross_entropy::backward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        dtype,
                        pg,
                        px,
                        pt,
                        pd,
                        ps,
                        c.rows,
                        c.cols,
                        opts,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        Ok((grad_logits,))
    }
}
