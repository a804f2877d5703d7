//! Fused cross-entropy over logits `[n, v]` and class targets `[n]`.
//!
//! Row loss, as `torch.nn.functional.cross_entropy`, with label smoothing
//! `eps`: `lse(x) - (1 - eps) x[t] - eps * mean(x)`, where `lse` is the
//! log-sum-exp; a row whose target is `ignore_index` has loss 0 and no
//! gradient. Reductions: per-row (`None`), `Sum`, or `Mean` over the rows not
//! ignored (all ignored gives NaN, as torch).
//!
//! Class weights `w` (`[v]`, of `T`, as torch's `weight`): the row loss is
//! `(1 - eps) w[t] (lse - x[t]) + eps / v * sum_c w[c] (lse - x[c])`, the
//! second term `eps / v (W lse - sum(w x))` with `W = sum(w)`, and `Mean`
//! divides by the sum of `w[t]` over the rows not ignored. That is the
//! probability-target loss (`cross_entropy_probs`) of the target `a = w ((1 -
//! eps) onehot(t) + eps / v)`, whose gradient is `g (sum(a) softmax(x) - a)`.
//!
//! Fused: no log-softmax is stored. The forward reads the logits once (max,
//! then exp-sum from cache) and can hand back each row's `lse` (one value per
//! row, in `T::Acc`); the backward takes that `lse`, or recomputes it the same
//! way, and writes `dx = g (softmax(x) - eps / v) - g (1 - eps) [j = t]`. The
//! only logits-sized buffer of forward + backward is the gradient itself.
//!
//! Targets must lie in `[0, v)` or equal `ignore_index`: anything else is an
//! error naming `target`, never a wrong loss.
use crate::element::{Acc, Element};
use crate::error::{check_len, Error, Result};
use crate::par::Par;
use crate::rows::{next_row, row_and_next, Blocks, Split};
use crate::simd::{dispatch, prefetch_part, sum_map, sum_pairs};
use crate::softmax::{affine_bf16, exp_into, exp_sum, row_max};

const OP_FWD: &str = "cross_entropy";
const OP_BWD: &str = "cross_entropy_backward";

/// The f32 and f64 backward takes `exp(x - lse)` as the probabilities, with
/// the forward's `lse`, only where `|lse|` is below this: that carries
/// `lse`'s rounding (half an ulp, `2^-24 |lse|` in f32) as a relative error
/// of every probability, at most 3.8e-6 below 64. Rows with larger logits
/// recompute their max and sum (one more read of the row), whose `exp(x - m)
/// / s` has no such error: with logits near 1e20 and two tied at the max,
/// the forward's lse (the max, `ln 2` lost in rounding) gave each of them
/// probability 1 instead of 0.5. (bf16 and f16 divide by the sum of `exp(x -
/// lse)`, in which the rounding cancels, at no cost: see `row_grad_into`.)
pub const LSE_TRUSTED_BELOW: f64 = 64.0;

/// How the row losses are reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// One loss per row (`"none"`).
    None,
    /// The mean over the rows that are not ignored (`"mean"`).
    Mean,
    /// The sum over all rows (`"sum"`).
    Sum,
}

impl Reduction {
    /// torch's `reduction` argument: `"none"`, `"mean"` or `"sum"`.
    pub fn parse(op: &'static str, s: &str) -> Result<Reduction> {
        match s {
            "none" => Ok(Reduction::None),
            "mean" => Ok(Reduction::Mean),
            "sum" => Ok(Reduction::Sum),
            other => Err(Error::Shape {
                op,
                arg: "reduction",
                msg: format!("must be \"mean\", \"sum\" or \"none\", got {other:?}"),
            }),
        }
    }

    /// Number of loss values for `rows` rows: `rows` for `None`, else 1.
    pub fn out_len(self, rows: usize) -> usize {
        if self == Reduction::None {
            rows
        } else {
            1
        }
    }
}

/// The scalar arguments of a call.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Rows with this target are skipped.
    pub ignore_index: i64,
    /// In `[0, 1]`.
    pub label_smoothing: f64,
    /// The reduction.
    pub reduction: Reduction,
}

/// Checks the shapes (`weight`: the class weights' length, where given) and
/// options; `target` values are checked by [`check_targets`]. Returns the
/// number of rows.
pub fn check(
    op: &'static str,
    logits: usize,
    target: usize,
    weight: Option<usize>,
    cols: usize,
    opts: &Options,
) -> Result<usize> {
    let rows = check_rows(op, logits, cols, opts.label_smoothing)?;
    check_len(op, "target", target, rows)?;
    if let Some(w) = weight {
        check_len(op, "weight", w, cols)?;
    }
    Ok(rows)
}

/// What `Mean` divides the summed losses by: `count`, the rows not ignored,
/// or with class weights the sum of their targets' weights (targets checked
/// by [`check_targets`] already).
pub fn mean_over<T: Element>(target: &[i64], weight: Option<&[T]>, ignore_index: i64, count: usize) -> f64 {
    match weight {
        None => count as f64,
        Some(w) => target.iter().filter(|&&t| t != ignore_index).map(|&t| w[t as usize].to_f64()).sum(),
    }
}

/// `sum / over` for `Mean`, NaN where `over` is 0 (no rows, every row ignored,
/// or every target's class weight 0), as torch's: there its loss is NaN even
/// where label smoothing leaves a sum above 0 (`0/0` of its unsmoothed term
/// plus `x/0` of the smoothed one), and so is the gradient of each row not
/// ignored (those ignored take 0).
pub fn mean_of(sum: f64, over: f64) -> f64 {
    if over == 0.0 {
        f64::NAN
    } else {
        sum / over
    }
}

/// Class weights and their sum.
#[derive(Clone, Copy)]
struct Weights<'a, T> {
    w: &'a [T],
    total: f64,
}

impl<'a, T: Element> Weights<'a, T> {
    fn new(w: Option<&'a [T]>) -> Option<Self> {
        w.map(|w| Weights { w, total: w.iter().map(|v| v.to_f64()).sum() })
    }
}

/// The checks of both target forms (class indices here, probabilities in
/// `cross_entropy_probs`): `ls` in `[0, 1]`, `cols > 0`, and `logits` whole
/// rows of `cols`. Returns the number of rows.
pub(crate) fn check_rows(op: &'static str, logits: usize, cols: usize, ls: f64) -> Result<usize> {
    if !(0.0..=1.0).contains(&ls) {
        return Err(Error::Shape { op, arg: "label_smoothing", msg: format!("must be in [0, 1], got {ls}") });
    }
    if cols == 0 {
        return Err(Error::Shape { op, arg: "logits", msg: "must have at least one class (v > 0)".into() });
    }
    if !logits.is_multiple_of(cols) {
        return Err(Error::Shape {
            op,
            arg: "logits",
            msg: format!("length {logits} is not a multiple of v = {cols}"),
        });
    }
    Ok(logits / cols)
}

/// Errors on the first target outside `[0, cols)` that is not `ignore_index`;
/// returns the number of rows not ignored.
pub fn check_targets(op: &'static str, target: &[i64], cols: usize, ignore_index: i64) -> Result<usize> {
    let mut count = 0;
    for (i, &t) in target.iter().enumerate() {
        if t == ignore_index {
            continue;
        }
        if t < 0 || t as u64 >= cols as u64 {
            return Err(Error::Shape {
                op,
                arg: "target",
                msg: format!(
                    "holds {t} at row {i}, out of range for {cols} classes (and not ignore_index = {ignore_index})"
                ),
            });
        }
        count += 1;
    }
    Ok(count)
}

/// Forward: writes the loss (`rows` values for [`Reduction::None`], else one)
/// and, when `lse` is given (`rows` values), each row's log-sum-exp, which
/// [`backward`] can then take instead of recomputing it (0 for ignored rows).
/// `weight`: class weights (`cols` values), or none.
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Element>(
    logits: &[T],
    target: &[i64],
    weight: Option<&[T]>,
    out: &mut [T],
    lse: Option<&mut [T::Acc]>,
    cols: usize,
    opts: Options,
    par: Par<'_>,
) -> Result<()> {
    let rows = check(OP_FWD, logits.len(), target.len(), weight.map(<[T]>::len), cols, &opts)?;
    check_len(OP_FWD, "out", out.len(), opts.reduction.out_len(rows))?;
    if let Some(l) = &lse {
        check_len(OP_FWD, "lse", l.len(), rows)?;
    }
    let count = check_targets(OP_FWD, target, cols, opts.ignore_index)?;
    let w = Weights::new(weight);
    // Per row: the loss and the log-sum-exp.
    let mut losses = vec![[0f64; 2]; rows];
    if rows > 0 {
        let blocks = Blocks::new(&par, rows, cols);
        let ls = Split::new(&mut losses, blocks.per);
        par.for_each(blocks.count, &|b| {
            let mut l = ls.get(b);
            let r = blocks.rows(b);
            let x = &logits[r.start * cols..r.end * cols];
            dispatch(
                #[inline(always)]
                || {
                    for (i, (&t, l)) in target[r.clone()].iter().zip(l.iter_mut()).enumerate() {
                        let (x, ahead) = row_and_next(x, i, cols);
                        if t != opts.ignore_index {
                            *l = row_loss(x, t as usize, opts.label_smoothing, ahead, w);
                        }
                    }
                },
            );
        });
    }
    write_losses(&losses, out, lse, opts.reduction, mean_over(target, weight, opts.ignore_index, count));
    Ok(())
}

/// The end of both forwards: each row's `[loss, lse]` (f64) to `lse` when
/// given, and the losses reduced into `out` (`"mean"` divides by `mean_over`).
pub(crate) fn write_losses<O: Element, A: Acc>(
    losses: &[[f64; 2]],
    out: &mut [O],
    lse: Option<&mut [A]>,
    reduction: Reduction,
    mean_over: f64,
) {
    if let Some(lse) = lse {
        lse.iter_mut().zip(losses).for_each(|(o, l)| *o = A::from_f64(l[1]));
    }
    let sum = || losses.iter().map(|l| l[0]).sum::<f64>();
    match reduction {
        Reduction::None => out.iter_mut().zip(losses).for_each(|(o, l)| *o = O::from_f64(l[0])),
        Reduction::Sum => out[0] = O::from_f64(sum()),
        Reduction::Mean => out[0] = O::from_f64(mean_of(sum(), mean_over)),
    }
}

/// Backward: `grad_logits` from the loss gradient `grad` (`rows` values for
/// [`Reduction::None`], else one) and the forward's inputs; with the forward's
/// `lse`, each row is read once (the max pass is skipped), except f32 and
/// f64 rows whose `|lse|` is [`LSE_TRUSTED_BELOW`] or more, which recompute
/// theirs. `weight`: the forward's class weights, or none.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
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
    let rows = check(OP_BWD, logits.len(), target.len(), weight.map(<[T]>::len), cols, &opts)?;
    check_len(OP_BWD, "grad", grad.len(), opts.reduction.out_len(rows))?;
    check_len(OP_BWD, "grad_logits", grad_logits.len(), logits.len())?;
    if let Some(l) = lse {
        check_len(OP_BWD, "lse", l.len(), rows)?;
    }
    let count = check_targets(OP_BWD, target, cols, opts.ignore_index)?;
    if rows == 0 {
        return Ok(());
    }
    let over = mean_over(target, weight, opts.ignore_index, count);
    let row_grad = |i: usize| -> f64 {
        match opts.reduction {
            Reduction::None => grad[i].to_f64(),
            Reduction::Sum => grad[0].to_f64(),
            Reduction::Mean => mean_of(grad[0].to_f64(), over),
        }
    };
    let w = Weights::new(weight);
    let eps = opts.label_smoothing;
    let blocks = Blocks::new(&par, rows, cols);
    let dxs = Split::new(grad_logits, blocks.per * cols);
    // With label smoothing, each class's weight enters its gradient: widened
    // once a call.
    let wide: Vec<T::Acc> = match w {
        Some(w) if eps > 0.0 => w.w.iter().map(|v| v.to_acc()).collect(),
        _ => vec![],
    };
    par.for_each(blocks.count, &|b| {
        let mut dx = dxs.get(b);
        let r = blocks.rows(b);
        let x = &logits[r.start * cols..r.end * cols];
        let mut scratch = vec![T::Acc::ZERO; cols];
        dispatch(
            #[inline(always)]
            || {
                for i in 0..r.len() {
                    let (row, t) = (r.start + i, target[r.start + i]);
                    let (x, ahead) = row_and_next(x, i, cols);
                    let (dx, ahead_w) = dx[i * cols..].split_at_mut(cols);
                    if t == opts.ignore_index {
                        dx.iter_mut().for_each(|d| *d = T::default());
                    } else {
                        let ahead = (ahead, next_row(ahead_w, cols));
                        let (t, g, lse) = (t as usize, row_grad(row), lse.map(|l| l[row]));
                        match w {
                            None => row_grad_into(x, t, dx, &mut scratch, g, eps, lse, ahead),
                            // No smoothing: the unweighted gradient scaled by w[t].
                            Some(w) if eps == 0.0 => {
                                row_grad_into(x, t, dx, &mut scratch, g * w.w[t].to_f64(), 0.0, lse, ahead)
                            }
                            Some(w) => {
                                let w = (w.w[t].to_f64(), &wide[..], w.total);
                                weighted_grad_into(x, t, dx, &mut scratch, g, eps, lse, ahead, w)
                            }
                        }
                    }
                }
            },
        );
    });
    Ok(())
}

/// One row's loss, `lse - (1 - eps) x[t] - eps mean(x)`, and its `lse`, in f64
/// from `Acc` sums; with weights, `(1 - eps) w[t] (lse - x[t]) + eps / v (W
/// lse - sum(w x))`.
///
/// The smoothing term `sum_c w_c (lse - x_c)` is `W ln s - sum_c w_c (x_c -
/// m)` (`m` the row's max, `ln s = lse - m`): two terms of one sign for
/// weights of one sign. Summing `w x` and subtracting it from `W lse`
/// cancelled the logits' offset: f32 logits near 1000 lost 1.8e-6 of the
/// loss (torch 1.6e-7), and an infinite weight gave `inf - inf` (now the
/// infinite loss torch gives, but where it is the max's class: `inf * 0`).
#[inline(always)]
fn row_loss<T: Element>(x: &[T], t: usize, eps: f64, ahead: &[T], w: Option<Weights<'_, T>>) -> [f64; 2] {
    let one = T::Acc::ONE;
    let m = row_max(x, one);
    let s = exp_sum(x, one, m, ahead);
    let ln_s = s.to_f64().ln();
    let lse = lse_of(m.to_f64(), ln_s);
    if let Some(w) = w {
        let mut loss = (1.0 - eps) * w.w[t].to_f64() * (lse - x[t].to_f64());
        if eps > 0.0 {
            let dot = sum_pairs(x, w.w, |a, b| (a - m) * b).to_f64();
            loss += eps / x.len() as f64 * (w.total * ln_s - dot);
        }
        return [loss, lse];
    }
    let mut loss = (1.0 - eps) * (lse - x[t].to_f64());
    if eps > 0.0 {
        loss += eps * (ln_s - sum_map(x, |v| v - m).to_f64() / x.len() as f64);
    }
    [loss, lse]
}

/// A row's log-sum-exp from its max `m` and `ln s`, `s = sum(exp(x - m))`:
/// `-inf` for a row of `-inf` only (as `torch.logsumexp`), whose `s` is NaN
/// (`exp(-inf - -inf)`); its loss stays NaN, as torch's.
#[inline(always)]
pub(crate) fn lse_of(m: f64, ln_s: f64) -> f64 {
    if m == f64::NEG_INFINITY {
        m
    } else {
        m + ln_s
    }
}

/// One row's gradient: `g (e / s - eps / v)`, minus `g (1 - eps)` at `t`;
/// `e = exp(x - m)`, `s` its sum, `m` the row's max or, given, its `lse` (no
/// pass for the max: `x - lse <= 0`, as `exp_nonpos` needs, since the forward
/// rounds `lse >= max`, which is representable, to nearest).
/// - bf16, f16: `e` goes to a scratch row and `s` is summed there, so the
///   rounding of a given `lse` cancels in `e / s`.
/// - f32, f64: with a given `lse`, no scratch row: the gradient is written as
///   `e` is computed, taking `s = 1`. That carries `lse`'s rounding into
///   every probability, so it is done only where `|lse|` is below
///   [`LSE_TRUSTED_BELOW`]; other rows take the `m = max` path.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn row_grad_into<T: Element>(
    x: &[T],
    t: usize,
    dx: &mut [T],
    scratch: &mut [T::Acc],
    g: f64,
    eps: f64,
    lse: Option<T::Acc>,
    (ahead, ahead_w): (&[T], &[T]),
) {
    let one = T::Acc::ONE;
    let off = T::Acc::from_f64(g * eps / x.len() as f64);
    if let Some(m) = direct_lse::<T>(lse) {
        // f32, f64: no rounding to do, so no scratch row either.
        exp_affine_into(x, dx, m, T::Acc::from_f64(g), off, ahead, ahead_w);
        let p = (x[t].to_acc() - m).exp_nonpos();
        dx[t] = T::from_f64(g * (p.to_f64() - eps / x.len() as f64) - g * (1.0 - eps));
        return;
    }
    // bf16, f16: a given lse; f32, f64: the max where the lse is not trusted.
    let narrow = std::mem::size_of::<T>() != std::mem::size_of::<T::Acc>();
    let m = lse.filter(|_| narrow).unwrap_or_else(|| row_max(x, one));
    let s = exp_into(x, scratch, one, m, ahead, ahead_w);
    let gs = T::Acc::from_f64(g / s.to_f64());
    // bf16 on AVX2: where the sum is finite so is each term, and the
    // rounding needs no NaN fix-up.
    if !(s.to_f64().is_finite() && affine_bf16(scratch, (gs, off), dx)) {
        T::from_acc_slice_affine(scratch, (gs, off), dx);
    }
    let p = scratch[t].to_f64() / s.to_f64();
    dx[t] = T::from_f64(g * (p - eps / x.len() as f64) - g * (1.0 - eps));
}

/// The given `lse` where the gradient may be written as `exp(x - lse)` is
/// computed, taking its sum as 1: f32 and f64 (no rounding to do from
/// `T::Acc`, so no scratch row), with `|lse|` below [`LSE_TRUSTED_BELOW`].
#[inline(always)]
fn direct_lse<T: Element>(lse: Option<T::Acc>) -> Option<T::Acc> {
    let narrow = std::mem::size_of::<T>() != std::mem::size_of::<T::Acc>();
    let lim = T::Acc::from_f64(LSE_TRUSTED_BELOW);
    lse.filter(|&l| !narrow && l < lim && l > T::Acc::ZERO - lim)
}

/// One row's gradient with class weights and label smoothing:
/// `g (A e_j / s - eps / v w_j)`, minus `g (1 - eps) w[t]` at `t`, with
/// `A = (1 - eps) w[t] + eps W / v` and `e`, `s`, `m` as in
/// [`row_grad_into`]'s scratch path (the rounding of a given `lse` cancels
/// in `e / s`). `(wt, w, total)`: the target's weight, every class's
/// (widened) and their sum. f32 and f64 given a trusted `lse` (as in
/// [`row_grad_into`]) write the gradient as `e` is computed, with `s = 1`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn weighted_grad_into<T: Element>(
    x: &[T],
    t: usize,
    dx: &mut [T],
    scratch: &mut [T::Acc],
    g: f64,
    eps: f64,
    lse: Option<T::Acc>,
    (ahead, ahead_w): (&[T], &[T]),
    (wt, w, total): (f64, &[T::Acc], f64),
) {
    let (one, v) = (T::Acc::ONE, x.len() as f64);
    let a = (1.0 - eps) * wt + eps * total / v;
    let off = T::Acc::from_f64(g * eps / v);
    if let Some(m) = direct_lse::<T>(lse) {
        exp_affine_weighted_into(x, dx, w, m, T::Acc::from_f64(g * a), off, ahead, ahead_w);
        let p = (x[t].to_acc() - m).exp_nonpos().to_f64();
        dx[t] = T::from_f64(g * (a * p - (1.0 - eps) * wt - eps / v * w[t].to_f64()));
        return;
    }
    let m = lse.unwrap_or_else(|| row_max(x, one));
    let s = exp_into(x, scratch, one, m, ahead, ahead_w).to_f64();
    let p = scratch[t].to_f64() / s;
    let gs = T::Acc::from_f64(g * a / s);
    for (e, &w) in scratch.iter_mut().zip(w) {
        *e = *e * gs - off * w;
    }
    T::from_acc_slice(scratch, dx);
    dx[t] = T::from_f64(g * (a * p - (1.0 - eps) * wt - eps / v * w[t].to_f64()));
}

/// `dx_i = exp(x_i - m) gs - off w_i`, as [`exp_affine_into`] (f32, f64).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn exp_affine_weighted_into<T: Element>(
    x: &[T],
    dx: &mut [T],
    w: &[T::Acc],
    m: T::Acc,
    gs: T::Acc,
    off: T::Acc,
    ahead: &[T],
    ahead_w: &[T],
) {
    const W: usize = 32;
    let f = |v: T, w: T::Acc| T::from_acc((v.to_acc() - m).exp_nonpos() * gs - off * w);
    let (cx, cd, cw) = (x.chunks_exact(W), dx.chunks_exact_mut(W), w.chunks_exact(W));
    let at = x.len() - cx.remainder().len();
    for (k, ((cx, cd), cw)) in cx.zip(cd).zip(cw).enumerate() {
        prefetch_part::<T, false>(ahead, k, W);
        prefetch_part::<T, true>(ahead_w, k, W);
        for i in 0..W {
            cd[i] = f(cx[i], cw[i]);
        }
    }
    for ((d, v), w) in dx[at..].iter_mut().zip(&x[at..]).zip(&w[at..]) {
        *d = f(*v, *w);
    }
}

/// `dx_i = exp(x_i - m) gs - off`, rounded once to `T`, straight into `dx`
/// (for f32 and f64, whose rounding from `T::Acc` is none), prefetching as
/// `exp_into` does; `m` at least the row's max.
#[inline(always)]
fn exp_affine_into<T: Element>(x: &[T], dx: &mut [T], m: T::Acc, gs: T::Acc, off: T::Acc, ahead: &[T], ahead_w: &[T]) {
    const W: usize = 32;
    let f = |v: T| T::from_acc((v.to_acc() - m).exp_nonpos() * gs - off);
    let (cx, cd) = (x.chunks_exact(W), dx.chunks_exact_mut(W));
    let at = x.len() - cx.remainder().len();
    for (k, (cx, cd)) in cx.zip(cd).enumerate() {
        prefetch_part::<T, false>(ahead, k, W);
        prefetch_part::<T, true>(ahead_w, k, W);
        for i in 0..W {
            cd[i] = f(cx[i]);
        }
    }
    for (d, v) in dx[at..].iter_mut().zip(&x[at..]) {
        *d = f(*v);
    }
}

/// Reference forward in f64: the reduced loss (`rows` values for `None`),
/// with class weights `weight` where given.
pub fn forward_ref<T: Element>(
    logits: &[T],
    target: &[i64],
    weight: Option<&[T]>,
    cols: usize,
    opts: Options,
) -> Vec<f64> {
    let w: Vec<f64> = weight_ref(weight, cols);
    let (mut losses, mut over) = (vec![], 0.0);
    for (x, &t) in logits.chunks(cols).zip(target) {
        if t == opts.ignore_index {
            losses.push(0.0);
            continue;
        }
        let t = t as usize;
        over += w[t];
        let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let eps = opts.label_smoothing;
        let smooth: f64 = x.iter().zip(&w).map(|(v, w)| w * (lse - v)).sum::<f64>() / cols as f64;
        losses.push((1.0 - eps) * w[t] * (lse - x[t]) + eps * smooth);
    }
    match opts.reduction {
        Reduction::None => losses,
        Reduction::Sum => vec![losses.iter().sum()],
        Reduction::Mean => vec![mean_of(losses.iter().sum::<f64>(), over)],
    }
}

/// The class weights in f64: `weight`, or all 1.
fn weight_ref<T: Element>(weight: Option<&[T]>, cols: usize) -> Vec<f64> {
    weight.map_or_else(|| vec![1.0; cols], |w| w.iter().map(|v| v.to_f64()).collect())
}

/// Reference backward in f64, with class weights `weight` where given.
pub fn backward_ref<T: Element>(
    grad: &[T],
    logits: &[T],
    target: &[i64],
    weight: Option<&[T]>,
    cols: usize,
    opts: Options,
) -> Vec<f64> {
    let w: Vec<f64> = weight_ref(weight, cols);
    let over: f64 = target.iter().filter(|&&t| t != opts.ignore_index).map(|&t| w[t as usize]).sum();
    let mut out = vec![];
    for (i, (x, &t)) in logits.chunks(cols).zip(target).enumerate() {
        if t == opts.ignore_index {
            out.extend(std::iter::repeat_n(0.0, cols));
            continue;
        }
        let g = match opts.reduction {
            Reduction::None => grad[i].to_f64(),
            Reduction::Sum => grad[0].to_f64(),
            Reduction::Mean => mean_of(grad[0].to_f64(), over),
        };
        let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
        let eps = opts.label_smoothing;
        // The target a = w ((1 - eps) onehot(t) + eps / v): dx = g (sum(a) softmax - a).
        let a: Vec<f64> =
            (0..cols).map(|j| w[j] * (if j == t as usize { 1.0 - eps } else { 0.0 } + eps / cols as f64)).collect();
        let total: f64 = a.iter().sum();
        for (v, a) in x.iter().zip(&a) {
            out.push(g * (total * (v - m).exp() / s - a));
        }
    }
    out
}
