//! `keel::cross_entropy`, `keel::cross_entropy_with_lse` and
//! `keel::cross_entropy_backward`.
//!
//! `cross_entropy(Tensor logits, Tensor target, int ignore_index=-100,
//! float label_smoothing=0.0, str reduction="mean", Tensor? weight=None) ->
//! Tensor` for logits `[N, V]` and int64 `target[N]`, as
//! `torch.nn.functional.cross_entropy`; or, as torch also takes them,
//! probabilities: a `target` of the logits' shape and dtype, or, for float32,
//! float16 and bfloat16 logits, another of those three (read as it is, not
//! rounded nor widened; the loss is then float32, as torch's, and so is its
//! gradient; class weights have the target's dtype) (`ignore_index`
//! must be the default there, as torch requires; on CUDA nothing is
//! synchronised for them: no target can be out of range). Class weights
//! `weight` (`[V]`, the logits' dtype) where given, with either target, are
//! read by the kernels beside each row, as torch's `weight` (with class
//! indices, `"mean"` divides by the sum of the weights of the rows not
//! ignored). `cross_entropy_with_lse` (same arguments) also returns each
//! row's log-sum-exp (`[N]`, float32, or float64 for float64 logits; 0 for
//! ignored rows). `cross_entropy_backward(grad, logits, target, ignore_index,
//! label_smoothing, reduction, lse=None, weight=None) -> grad_logits` takes that lse, or
//! recomputes it from the logits (fused either way: nothing logits-sized is
//! saved by the forward). On CUDA, given the lse it does not check the
//! targets again (no synchronisation): they are the forward's, which did
//! (see `keel::ops::cross_entropy`).
use crate::checks::{self, invalid, with_float_type, Rows};
use crate::device::{check_err, kernel_err, kernel_err_as, ptr, CudaCall};
use crate::torch_pool::with_torch_par;
use keel::cpu::Element;
use keel::ops::cross_entropy::{Options, Reduction};
use keel_abi::{BoxedOp, DeviceType, Result, ScalarType, Tensor};

/// Runs `$body` with `$T` the logits' element type, `$P` the probability
/// target's and `$O` the loss's: `$T` thrice, or two of f32, f16 and bf16
/// with an f32 loss (the pairs [`check_probabilities`] takes).
macro_rules! with_probs_types {
    ($dtype:expr, $target:expr, $T:ident, $P:ident, $O:ident => $body:expr) => {
        match ($dtype, $target) {
            (ScalarType::F16, ScalarType::F32) => with_probs_types!(@pair half::f16, f32, $T, $P, $O => $body),
            (ScalarType::BF16, ScalarType::F32) => with_probs_types!(@pair half::bf16, f32, $T, $P, $O => $body),
            (ScalarType::F32, ScalarType::F16) => with_probs_types!(@pair f32, half::f16, $T, $P, $O => $body),
            (ScalarType::F32, ScalarType::BF16) => with_probs_types!(@pair f32, half::bf16, $T, $P, $O => $body),
            (ScalarType::F16, ScalarType::BF16) => with_probs_types!(@pair half::f16, half::bf16, $T, $P, $O => $body),
            (ScalarType::BF16, ScalarType::F16) => with_probs_types!(@pair half::bf16, half::f16, $T, $P, $O => $body),
            _ => with_float_type!($dtype, $T => {
                type $P = $T;
                type $O = $T;
                $body
            }),
        }
    };
    (@pair $t:ty, $p:ty, $T:ident, $P:ident, $O:ident => $body:expr) => {{
        type $T = $t;
        type $P = $p;
        type $O = f32;
        $body
    }};
}

/// Whether probabilities of `target` may go beside logits of `logits`: the
/// same dtype, or two of float32, float16 and bfloat16.
fn probs_pair(logits: ScalarType, target: ScalarType) -> bool {
    let narrow = |d| matches!(d, ScalarType::F32 | ScalarType::F16 | ScalarType::BF16);
    logits == target || (narrow(logits) && narrow(target))
}

/// The checked arguments: logits, target and weights contiguous.
struct Checked {
    logits: Tensor,
    target: Tensor,
    /// Class weights.
    weight: Option<Tensor>,
    /// What the checks found of the logits.
    c: Rows,
    opts: Options,
    /// Whether the target holds probabilities (a float tensor shaped like
    /// the logits) rather than class indices.
    probs: bool,
    /// The loss's dtype (and its gradient's): the logits', or float32 for
    /// probabilities of another dtype (torch's promotion of the two).
    loss_dtype: ScalarType,
}

/// The arguments the forward ops share: logits, target, ignore_index,
/// label_smoothing, reduction, weight.
type Args = (Tensor, Tensor, i64, f64, String, Option<Tensor>);

/// Checks logits, target, the options and the weights; returns the tensors
/// contiguous ([`checks::dense`]).
fn check(
    op: &'static str,
    (logits, target, ii, ls, reduction, weight): (Tensor, Tensor, i64, f64, &str, Option<Tensor>),
) -> Result<Checked> {
    let c = checks::strided_rows_of(op, "logits", &logits)?;
    let s = logits.sizes()?;
    if s.len() != 2 {
        return Err(invalid(op, "logits", format!("must have 2 dims [N, V], got shape {s:?}")));
    }
    checks::same_device(op, "target", &target, "logits", c.device)?;
    let probs = matches!(target.dtype()?, ScalarType::F16 | ScalarType::BF16 | ScalarType::F32 | ScalarType::F64);
    let loss_dtype = if probs && target.dtype()? != c.dtype { ScalarType::F32 } else { c.dtype };
    if probs {
        check_probabilities(op, &target, &c, s, ii)?;
    } else if target.dtype()? != ScalarType::I64 {
        return Err(invalid(
            op,
            "target",
            format!(
                "must have dtype torch.int64 (class indices) or the logits' {} (probabilities), got {}",
                c.dtype,
                target.dtype()?
            ),
        ));
    } else if target.sizes()? != [s[0]] {
        return Err(invalid(
            op,
            "target",
            format!("must have shape [{}] (logits' first dim), got {:?}", s[0], target.sizes()?),
        ));
    }
    // The kernels' own checks of V > 0 and the options, for every device.
    let reduction = Reduction::parse(op, reduction).map_err(check_err)?;
    let opts = Options { ignore_index: ii, label_smoothing: ls, reduction };
    keel::cpu::cross_entropy::check(op, c.rows * c.cols, c.rows, None, c.cols, &opts).map_err(check_err)?;
    let weight_dtype = if probs { target.dtype()? } else { c.dtype };
    let weight = weight.map(|w| check_weight(op, w, &c, weight_dtype)).transpose()?;
    let (logits, target) = (checks::dense(op, "logits", logits)?, checks::dense(op, "target", target)?);
    Ok(Checked { logits, target, weight, c, opts, probs, loss_dtype })
}

/// Checks a target of probabilities (a float tensor) against the logits
/// (`sizes`): their shape, a dtype [`probs_pair`] takes, and an
/// `ignore_index` (`ii`) no class has (a negative one, as torch takes).
fn check_probabilities(op: &str, target: &Tensor, c: &Rows, sizes: &[i64], ii: i64) -> Result<()> {
    let dtype = target.dtype()?;
    if !probs_pair(c.dtype, dtype) {
        let msg = format!(
            "of probabilities must have the logits' dtype {} (or, for float32, float16 and bfloat16 logits, \
             another of those three), got {dtype}",
            c.dtype
        );
        return Err(invalid(op, "target", msg));
    }
    if target.sizes()? != sizes {
        let msg = format!("of probabilities must have the logits' shape {sizes:?}, got {:?}", target.sizes()?);
        return Err(invalid(op, "target", msg));
    }
    // torch takes any negative one (no class has it) and refuses the others.
    if ii >= 0 {
        let msg = format!("applies to class indices only, not to probabilities (a float target), got {ii}");
        return Err(invalid(op, "ignore_index", msg));
    }
    Ok(())
}

/// Checks class weights: `[V]` on the logits' device, of the logits' dtype or,
/// with probabilities of another dtype, of theirs (`dtype`).
fn check_weight(op: &str, w: Tensor, c: &Rows, dtype: ScalarType) -> Result<Tensor> {
    if dtype == c.dtype {
        return checks::param(op, "weight", w, c);
    }
    let d = w.dtype()?;
    if d != dtype {
        let msg = format!("must have the target's dtype {dtype} (probabilities of {} logits), got {d}", c.dtype);
        return Err(invalid(op, "weight", msg));
    }
    checks::param(op, "weight", w, &Rows { dtype, ..*c })
}

fn loss_shape(c: &Rows, reduction: Reduction) -> Vec<i64> {
    if reduction == Reduction::None {
        vec![c.rows as i64]
    } else {
        vec![]
    }
}

/// The dtype of the lse: the accumulation type of `dtype`.
fn lse_dtype(dtype: ScalarType) -> ScalarType {
    if dtype == ScalarType::F64 {
        ScalarType::F64
    } else {
        ScalarType::F32
    }
}

/// The forward of `cross_entropy` and `cross_entropy_with_lse`: the loss, and
/// the lse when `with_lse`.
fn forward(
    op: &'static str,
    (logits, target, ii, ls, reduction, weight): Args,
    with_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let Checked { logits, target, weight, c, opts, probs, loss_dtype } =
        check(op, (logits, target, ii, ls, &reduction, weight))?;
    let out = Tensor::empty(&loss_shape(&c, opts.reduction), loss_dtype, c.device)?;
    let lse = if with_lse { Some(Tensor::empty(&[c.rows as i64], lse_dtype(c.dtype), c.device)?) } else { None };
    match c.device.kind {
        DeviceType::Cpu if probs => with_probs_types!(c.dtype, target.dtype()?, T, P, O => {
            // SAFETY: checked contiguous CPU tensors (logits of T, target and weight of P); `out`
            // (of O, the loss's dtype) and `lse` (of T's accumulation type) are fresh.
            let (x, p, y) = unsafe { (logits.as_slice::<T>()?, target.as_slice::<P>()?, out.as_mut_slice::<O>()?) };
            // SAFETY: as above.
            let w = match &weight { Some(w) => Some(unsafe { w.as_slice::<P>()? }), None => None };
            let l = match &lse {
                // SAFETY: as above.
                Some(l) => Some(unsafe { l.as_mut_slice::<<T as Element>::Acc>()? }),
                None => None,
            };
            let (cols, r) = (c.cols, opts.reduction);
            with_torch_par(|par| keel::ops::cross_entropy::forward_probs_cpu(x, p, w, y, l, cols, ls, r, par))
                .map_err(kernel_err_as(op))?
        }),
        DeviceType::Cpu => with_float_type!(c.dtype, T => {
            // SAFETY: checked contiguous CPU tensors (logits and weight of T, target of i64); `out`
            // and `lse` (of T's accumulation type) are fresh.
            let (x, t, y) = unsafe { (logits.as_slice::<T>()?, target.as_slice::<i64>()?, out.as_mut_slice::<T>()?) };
            // SAFETY: as above.
            let w = match &weight { Some(w) => Some(unsafe { w.as_slice::<T>()? }), None => None };
            let l = match &lse {
                // SAFETY: as above.
                Some(l) => Some(unsafe { l.as_mut_slice::<<T as Element>::Acc>()? }),
                None => None,
            };
            with_torch_par(|par| keel::ops::cross_entropy::forward_cpu(x, t, w, y, l, c.cols, opts, par)).map_err(kernel_err_as(op))?
        }),
        DeviceType::Cuda => {
            let call = CudaCall::new(op, c.device)?;
            let dtype = checks::cuda_dtype(c.dtype)?;
            let n = keel::ops::cross_entropy::scratch_len(c.rows) as i64;
            let scratch = Tensor::empty(&[n], ScalarType::F32, c.device)?;
            let (px, pt, po, ps) = (ptr(Some(&logits))?, ptr(Some(&target))?, ptr(Some(&out))?, ptr(Some(&scratch))?);
            let (pl, pw) = (ptr(lse.as_ref())?, ptr(weight.as_ref())?);
            if probs {
                let (rows, cols, r) = (c.rows, c.cols, opts.reduction);
                let dtypes = (dtype, checks::cuda_dtype(target.dtype()?)?);
                // SAFETY: checked contiguous CUDA tensors on the guarded device (target of the
                // logits' shape and a dtype `probs_pair` takes, weight of its dtype, [V]); `out` (of
                // the loss's dtype), `lse` (f32) and `scratch` are fresh.
                unsafe {
                    keel::ops::cross_entropy::forward_probs_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        dtypes,
                        (px, pt, pw, po, pl, ps),
                        rows,
                        cols,
                        ls,
                        r,
                    )
                }
                .map_err(kernel_err_as(op))?;
                return Ok((out, lse));
            }
            // SAFETY: checked contiguous CUDA tensors on the guarded device (weight of the logits'
            // dtype, [V]); `out`, `lse` (f32) and `scratch` are fresh.
            unsafe {
                keel::ops::cross_entropy::forward_cuda_raw(
                    &call.gpu,
                    &call.stream,
                    dtype,
                    px,
                    pt,
                    pw,
                    po,
                    pl,
                    ps,
                    c.rows,
                    c.cols,
                    opts,
                )
            }
            .map_err(kernel_err_as(op))?
        }
        DeviceType::Meta | DeviceType::Other(_) => {}
    }
    Ok((out, lse))
}

/// `cross_entropy`.
pub(crate) struct CrossEntropy;

impl BoxedOp for CrossEntropy {
    const NAME: &'static str = "cross_entropy";
    type Args = Args;
    type Out = (Tensor,);

    fn run(args: Self::Args) -> Result<Self::Out> {
        Ok((forward(Self::NAME, args, false)?.0,))
    }
}

/// `cross_entropy_with_lse`.
pub(crate) struct CrossEntropyWithLse;

impl BoxedOp for CrossEntropyWithLse {
    const NAME: &'static str = "cross_entropy_with_lse";
    type Args = Args;
    type Out = (Tensor, Tensor);

    fn run(args: Self::Args) -> Result<Self::Out> {
        match forward(Self::NAME, args, true)? {
            (loss, Some(lse)) => Ok((loss, lse)),
            (_, None) => unreachable!("forward returns the lse when asked for it"),
        }
    }
}

/// Checks the optional `lse` of `cross_entropy_backward` against the logits.
fn check_lse(op: &str, lse: Tensor, c: &Rows) -> Result<Tensor> {
    checks::same_device(op, "lse", &lse, "logits", c.device)?;
    let want = lse_dtype(c.dtype);
    if lse.dtype()? != want {
        let msg = format!(
            "must have dtype {want} (cross_entropy_with_lse's lse for {} logits), got {}",
            c.dtype,
            lse.dtype()?
        );
        return Err(invalid(op, "lse", msg));
    }
    if lse.sizes()? != [c.rows as i64] {
        return Err(invalid(op, "lse", format!("must have shape [{}] (one per row), got {:?}", c.rows, lse.sizes()?)));
    }
    checks::dense(op, "lse", lse)
}

/// `cross_entropy_backward`.
pub(crate) struct CrossEntropyBackward;

impl BoxedOp for CrossEntropyBackward {
    const NAME: &'static str = "cross_entropy_backward";
    type Args = (Tensor, Tensor, Tensor, i64, f64, String, Option<Tensor>, Option<Tensor>);
    type Out = (Tensor,);

    fn run((grad, logits, target, ii, ls, reduction, lse, weight): Self::Args) -> Result<Self::Out> {
        let op = Self::NAME;
        let Checked { logits, target, weight, c, opts, probs, loss_dtype } =
            check(op, (logits, target, ii, ls, &reduction, weight))?;
        checks::same_device(op, "grad", &grad, "logits", c.device)?;
        if !probs || target.dtype()? == c.dtype {
            checks::same_dtype(op, "grad", &grad, "logits", c.dtype)?;
        } else if grad.dtype()? != loss_dtype {
            let msg = format!(
                "must have the loss's dtype {loss_dtype} (that of a {} target of {} logits), got {}",
                target.dtype()?,
                c.dtype,
                grad.dtype()?
            );
            return Err(invalid(op, "grad", msg));
        }
        let want = loss_shape(&c, opts.reduction);
        if grad.sizes()? != want.as_slice() {
            return Err(invalid(op, "grad", format!("must have shape {want:?} (the loss's), got {:?}", grad.sizes()?)));
        }
        let grad = checks::dense(op, "grad", grad)?;
        let lse = lse.map(|l| check_lse(op, l, &c)).transpose()?;
        let grad_logits = c.empty_like(&logits)?;
        match c.device.kind {
            DeviceType::Cpu if probs => with_probs_types!(c.dtype, target.dtype()?, T, P, O => {
                // SAFETY: checked contiguous CPU tensors (`lse` of T's accumulation type; target
                // and weight of P, grad of O); `grad_logits` is fresh.
                let (g, x, p, dx) = unsafe {
                    (grad.as_slice::<O>()?, logits.as_slice::<T>()?, target.as_slice::<P>()?, grad_logits.as_mut_slice::<T>()?)
                };
                // SAFETY: as above.
                let w = match &weight { Some(w) => Some(unsafe { w.as_slice::<P>()? }), None => None };
                let l = match &lse {
                    // SAFETY: as above.
                    Some(l) => Some(unsafe { l.as_slice::<<T as Element>::Acc>()? }),
                    None => None,
                };
                let (cols, r) = (c.cols, opts.reduction);
                with_torch_par(|par| keel::ops::cross_entropy::backward_probs_cpu(g, x, p, w, l, dx, cols, ls, r, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked contiguous CPU tensors (`lse` of T's accumulation type, weight of
                // T); `grad_logits` is fresh.
                let (g, x, t, dx) = unsafe {
                    (grad.as_slice::<T>()?, logits.as_slice::<T>()?, target.as_slice::<i64>()?, grad_logits.as_mut_slice::<T>()?)
                };
                // SAFETY: as above.
                let w = match &weight { Some(w) => Some(unsafe { w.as_slice::<T>()? }), None => None };
                let l = match &lse {
                    // SAFETY: as above.
                    Some(l) => Some(unsafe { l.as_slice::<<T as Element>::Acc>()? }),
                    None => None,
                };
                with_torch_par(|par| keel::ops::cross_entropy::backward_cpu(g, x, t, w, l, dx, c.cols, opts, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cuda if probs => {
                let call = CudaCall::new(op, c.device)?;
                let dtype = checks::cuda_dtype(c.dtype)?;
                let (pg, px, pt, pl) =
                    (ptr(Some(&grad))?, ptr(Some(&logits))?, ptr(Some(&target))?, ptr(lse.as_ref())?);
                let (pd, pw) = (ptr(Some(&grad_logits))?, ptr(weight.as_ref())?);
                let (rows, cols, r) = (c.rows, c.cols, opts.reduction);
                let dtypes = (dtype, checks::cuda_dtype(target.dtype()?)?);
                // SAFETY: checked contiguous CUDA tensors on the guarded device (`lse` f32, target of
                // the logits' shape and a dtype `probs_pair` takes, weight of its dtype, [V], grad of
                // the loss's dtype); `grad_logits` is fresh.
                unsafe {
                    keel::ops::cross_entropy::backward_probs_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        dtypes,
                        (pg, px, pt, pw, pl, pd),
                        rows,
                        cols,
                        ls,
                        r,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Cuda => {
                let call = CudaCall::new(op, c.device)?;
                let dtype = checks::cuda_dtype(c.dtype)?;
                let n = keel::ops::cross_entropy::scratch_len(c.rows) as i64;
                let scratch = Tensor::empty(&[n], ScalarType::F32, c.device)?;
                let (pg, px, pt, pl) =
                    (ptr(Some(&grad))?, ptr(Some(&logits))?, ptr(Some(&target))?, ptr(lse.as_ref())?);
                let (pd, ps, pw) = (ptr(Some(&grad_logits))?, ptr(Some(&scratch))?, ptr(weight.as_ref())?);
                // SAFETY: checked contiguous CUDA tensors on the guarded device (`lse` f32, weight of
                // the logits' dtype, [V]); outputs are fresh.
                unsafe {
                    keel::ops::cross_entropy::backward_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        dtype,
                        pg,
                        px,
                        pt,
                        pw,
                        pl,
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
