//! Fused cross-entropy over logits `[n, v]` and probability targets `[n, v]`
//! ("soft labels", as distillation uses them): torch's
//! `F.cross_entropy(logits, p)` with a float `p` shaped like the logits.
//!
//! With label smoothing `eps` the target is `q = (1 - eps) p + eps / v`, and
//! a row's loss is `sum_j q_j (lse - x_j) = A lse - (1 - eps) sum_j p_j x_j -
//! eps mean(x)`, `A = sum_j q_j = (1 - eps) sum_j p_j + eps` (torch does not
//! require `sum_j p_j = 1`, nor does this). `"mean"` divides the sum by the
//! rows; no row is ignored (torch refuses `ignore_index` with probabilities).
//! The gradient is `dx_j = g (A softmax(x)_j - q_j)`.
//!
//! Class weights `w` (`[v]`, torch's `weight=`) make the target `a = w q`:
//! a row's loss `sum_j a_j (lse - x_j) = A lse - sum_j a_j x_j` with `A =
//! sum_j a_j`, its gradient `g (A softmax(x)_j - a_j)`, and `"mean"` still
//! over the rows (torch's, for probabilities). `a` is made in the sums, in
//! `T::Acc`, not stored.
//!
//! The target may have another element type `P` with the logits'
//! accumulation type (f32 probabilities of bf16 or f16 logits: a teacher's
//! float32 softmax against a student's 16-bit logits; bf16 or f16 ones of
//! f32 logits, or of the other 16-bit type), read as it is: no copy rounded
//! to the logits' dtype, nor widened. The class weights have the target's
//! type. The loss has a type of its own, `O` (torch's is the promotion of
//! the logits' and the target's: f32 there), and so does its gradient.
//!
//! Fused as [`crate::cross_entropy`] is: the forward reads each row of the
//! logits and of the target once from memory (the max, the exp-sum, then the
//! dot products from cache) and can hand back each row's `lse`; the backward
//! takes that `lse` (or recomputes it) and writes the gradient in one pass
//! over both rows. Nothing logits-sized is made but the gradient.
use crate::cross_entropy::{check_rows, lse_of, write_losses, Reduction, LSE_TRUSTED_BELOW};
use crate::element::{Acc, Element};
use crate::error::{check_len, Result};
use crate::par::Par;
use crate::rows::{next_row, row_and_next, Blocks, Split};
use crate::simd::{dispatch, prefetch_part, sum_map, sums3};
use crate::softmax::{exp_into, exp_sum, row_max};
use crate::wide::{cast, is};
use crate::widen;

const OP_FWD: &str = "cross_entropy";
const OP_BWD: &str = "cross_entropy_backward";

/// Checks the lengths (the target's, and the weights', `cols`, where there
/// are weights) and the label smoothing; returns the number of rows.
pub fn check(
    op: &'static str,
    logits: usize,
    target: usize,
    weight: Option<usize>,
    cols: usize,
    label_smoothing: f64,
) -> Result<usize> {
    let rows = check_rows(op, logits, cols, label_smoothing)?;
    check_len(op, "target", target, logits)?;
    if let Some(w) = weight {
        check_len(op, "weight", w, cols)?;
    }
    Ok(rows)
}

/// Class weights as the rows' sums read them: as `T` (the target's type),
/// and as f32 where the rows are widened to f32 for their sums (f16 on x86,
/// [`widen::to_f32`]; f32 weights as they are).
#[derive(Clone, Copy)]
struct Weights<'a, T> {
    w: &'a [T],
    wide: Option<&'a [f32]>,
}

impl<'a, T: 'static> Weights<'a, T> {
    /// `w`, widened into `buf` where rows are.
    fn new(w: &'a [T], buf: &'a mut Vec<f32>) -> Self {
        Weights { w, wide: target_f32(w, buf) }
    }
}

/// A target row as f32 where the logits' rows are widened to f32 ([`widen`]):
/// an f32 row as it is, an f16 one widened into `buf`; `None` elsewhere.
#[inline(always)]
fn target_f32<'a, P: 'static>(p: &'a [P], buf: &'a mut Vec<f32>) -> Option<&'a [f32]> {
    if is::<P, f32>() {
        return Some(cast::<P, f32>(p));
    }
    widen::to_f32(p, buf)
}

/// Whether a row widened to f32 can be read with the weights `w` (none, or
/// widened too).
fn widened_with<T>(w: Option<Weights<'_, T>>) -> bool {
    w.is_none_or(|w| w.wide.is_some())
}

/// Forward: writes the loss (`rows` values for [`Reduction::None`], else one)
/// and, when `lse` is given (`rows` values), each row's log-sum-exp, which
/// [`backward`] can take instead of recomputing it; `weight`, the class
/// weights (`cols` values, of the target's type) where given; `target` of
/// the logits' type or another of its accumulation type, the loss of any
/// type (see the module's text).
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Element, P: Element<Acc = T::Acc>, O: Element>(
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
    let rows = check(OP_FWD, logits.len(), target.len(), weight.map(<[P]>::len), cols, label_smoothing)?;
    check_len(OP_FWD, "out", out.len(), reduction.out_len(rows))?;
    if let Some(l) = &lse {
        check_len(OP_FWD, "lse", l.len(), rows)?;
    }
    let mut losses = vec![[0f64; 2]; rows];
    let mut buf = Vec::new();
    let w = weight.map(|w| Weights::new(w, &mut buf));
    if rows > 0 {
        let blocks = Blocks::new(&par, rows, cols);
        let ls = Split::new(&mut losses, blocks.per);
        par.for_each(blocks.count, &|b| {
            let mut l = ls.get(b);
            let r = blocks.rows(b);
            let (x, p) = (&logits[r.start * cols..r.end * cols], &target[r.start * cols..r.end * cols]);
            let (mut wp, mut wx) = (Vec::new(), Vec::new());
            dispatch(
                #[inline(always)]
                || {
                    for (i, l) in l.iter_mut().enumerate() {
                        let (x, ahead) = row_and_next(x, i, cols);
                        let wide = (&mut wp, &mut wx);
                        *l = row_loss(x, &p[i * cols..][..cols], w, label_smoothing, ahead, wide);
                    }
                },
            );
        });
    }
    write_losses(&losses, out, lse, reduction, rows as f64);
    Ok(())
}

/// Backward: `grad_logits` from the loss gradient `grad` (`rows` values for
/// [`Reduction::None`], else one; of the loss's type) and the forward's
/// inputs (`weight` as there); with the
/// forward's `lse`, the max pass is skipped (f32 and f64 rows whose `|lse|`
/// is [`LSE_TRUSTED_BELOW`] or more recompute theirs, as
/// [`crate::cross_entropy::backward`] does).
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element, P: Element<Acc = T::Acc>, O: Element>(
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
    let rows = check(OP_BWD, logits.len(), target.len(), weight.map(<[P]>::len), cols, label_smoothing)?;
    check_len(OP_BWD, "grad", grad.len(), reduction.out_len(rows))?;
    check_len(OP_BWD, "grad_logits", grad_logits.len(), logits.len())?;
    if let Some(l) = lse {
        check_len(OP_BWD, "lse", l.len(), rows)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let row_grad = |i: usize| -> f64 {
        match reduction {
            Reduction::None => grad[i].to_f64(),
            Reduction::Sum => grad[0].to_f64(),
            Reduction::Mean => grad[0].to_f64() / rows as f64,
        }
    };
    let mut buf = Vec::new();
    let w = weight.map(|w| Weights::new(w, &mut buf));
    let blocks = Blocks::new(&par, rows, cols);
    let dxs = Split::new(grad_logits, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let mut dx = dxs.get(b);
        let r = blocks.rows(b);
        let (x, p) = (&logits[r.start * cols..r.end * cols], &target[r.start * cols..r.end * cols]);
        let (mut scratch, mut wide) = (vec![T::Acc::ZERO; cols], Vec::new());
        dispatch(
            #[inline(always)]
            || {
                for i in 0..r.len() {
                    let row = r.start + i;
                    let (x, ahead) = row_and_next(x, i, cols);
                    let (dx, ahead_w) = dx[i * cols..].split_at_mut(cols);
                    let ahead = (ahead, next_row(ahead_w, cols));
                    let p = &p[i * cols..][..cols];
                    let lse = lse.map(|l| l[row]);
                    let bufs = (&mut scratch[..], &mut wide);
                    row_grad_into(x, p, w, dx, bufs, row_grad(row), label_smoothing, lse, ahead);
                }
            },
        );
    });
    Ok(())
}

/// One row's loss, `A lse - (1 - eps) sum(p x) - eps mean(x)` (with weights,
/// `A lse - sum(a x)`), and its `lse`, in f64 from `Acc` sums.
///
/// The sums are of `x - m` (`m` the row's max; `lse - m = ln s`): `A ln s -
/// sum(a (x - m))` is two terms of one sign for a target of one sign, where
/// `A lse - sum(a x)` cancelled the logits' offset (f32 logits near 1000 lost
/// 2.7e-5 of the loss, torch 1.3e-7; near 100, 2.1e-6).
#[inline(always)]
fn row_loss<T: Element, P: Element<Acc = T::Acc>>(
    x: &[T],
    p: &[P],
    w: Option<Weights<'_, P>>,
    eps: f64,
    ahead: &[T],
    wide: (&mut Vec<f32>, &mut Vec<f32>),
) -> [f64; 2] {
    let one = T::Acc::ONE;
    let m = row_max(x, one);
    let s = exp_sum(x, one, m, ahead);
    let ln_s = s.to_f64().ln();
    let lse = lse_of(m.to_f64(), ln_s);
    // f16 on x86: both rows widened by `vcvtph2ps` (exactly) for the sums,
    // as in the backward (`row_grad_into`): the software widening of
    // subnormal targets took the forward 213 ms at `[4096, 32000]` (bf16: 37).
    // An f16 target beside other logits is widened so too, and they are read
    // as f32 beside it: f32 ones as they are, bf16 ones widened (the f16
    // target's software widening took the forward of f32 logits 218 ms at
    // `[4096, 32000]`, 57 widened; of bf16 logits 196, 43).
    let (wp, wx) = wide;
    let rows32 = match (widened_with(w), target_f32(p, wp)) {
        (true, Some(p)) if is::<P, half::f16>() && is::<T, f32>() => Some((p, cast::<T, f32>(x))),
        (true, Some(p)) if is::<P, half::f16>() => widen::to_f32_beside_f16(x, wx).map(|x| (p, x)),
        (true, Some(p)) => widen::to_f32(x, wx).map(|x| (p, x)),
        _ => None,
    };
    if let Some(w) = w {
        let c = (1.0 - eps, eps / x.len() as f64);
        let (dot, total) = match (rows32, w.wide) {
            (Some((p, x)), Some(w)) => weighted_dots(p, x, w, c, m.to_f64()),
            _ => weighted_dots(p, x, w.w, c, m.to_f64()),
        };
        return [total * ln_s - dot, lse];
    }
    let (dot, total, sum_x) = match rows32 {
        Some((p, x)) => dots(p, x, eps, m.to_f64()),
        None => dots(p, x, eps, m.to_f64()),
    };
    let mut loss = (1.0 - eps) * (total * ln_s - dot);
    if eps > 0.0 {
        // eps (lse - mean(x)) = eps (ln s - mean(x - m)).
        loss += eps * (ln_s - sum_x / x.len() as f64);
    }
    [loss, lse]
}

/// `sum(p (x - m))` and `sum(p)` in one pass (x is the third slice too,
/// unused), and `sum(x - m)` where label smoothing takes it (else 0).
#[inline(always)]
fn dots<P: Element, T: Element<Acc = P::Acc>>(p: &[P], x: &[T], eps: f64, m: f64) -> (f64, f64, f64) {
    let m = P::Acc::from_f64(m); // exactly: the max of the row
    let (dot, total) = sums3(p, x, x, |p, x, _| (p * (x - m), p));
    let sum_x = if eps > 0.0 { sum_map(x, |v| v - m).to_f64() } else { 0.0 };
    (dot.to_f64(), total.to_f64(), sum_x)
}

/// `sum(a (x - m))` and `sum(a)` in one pass, `a = w (c.0 p + c.1)` (the
/// weighted, smoothed target: `c = (1 - eps, eps / v)`).
#[inline(always)]
fn weighted_dots<P: Element, T: Element<Acc = P::Acc>, W: Element<Acc = P::Acc>>(
    p: &[P],
    x: &[T],
    w: &[W],
    (c1, c0): (f64, f64),
    m: f64,
) -> (f64, f64) {
    let (c1, c0, m) = (P::Acc::from_f64(c1), P::Acc::from_f64(c0), P::Acc::from_f64(m));
    let (dot, total) = sums3(p, x, w, |p, x, w| {
        let a = w * (p * c1 + c0);
        (a * (x - m), a)
    });
    (dot.to_f64(), total.to_f64())
}

/// `sum(a)` as [`weighted_dots`] makes it, for the backward.
#[inline(always)]
fn weighted_sum<P: Element, W: Element<Acc = P::Acc>>(p: &[P], w: &[W], (c1, c0): (f64, f64)) -> f64 {
    let (c1, c0) = (P::Acc::from_f64(c1), P::Acc::from_f64(c0));
    sums3(p, w, w, |p, w, _| (w * (p * c1 + c0), P::Acc::ZERO)).0.to_f64()
}

/// One row's gradient, `dx_j = g A e_j / s - g (1 - eps) p_j - g eps / v`,
/// (with weights, `g A e_j / s - w_j (g (1 - eps) p_j + g eps / v)`),
/// with `e = exp(x - m)` and `s` its sum: `m` is the given `lse` (then `s =
/// 1`) for f32 and f64 rows where it can be trusted (see
/// [`LSE_TRUSTED_BELOW`]), else the row's max or, for bf16 and f16, the given
/// `lse`, with `e` in a scratch row and `s` summed there (the rounding of the
/// `lse` cancels in `e / s`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn row_grad_into<T: Element, P: Element<Acc = T::Acc>>(
    x: &[T],
    p: &[P],
    w: Option<Weights<'_, P>>,
    dx: &mut [T],
    (scratch, wide): (&mut [T::Acc], &mut Vec<f32>),
    g: f64,
    eps: f64,
    lse: Option<T::Acc>,
    (ahead, ahead_w): (&[T], &[T]),
) {
    let one = T::Acc::ONE;
    // f16 on x86: the target widened once by `vcvtph2ps` (exactly) for both
    // of its passes. The software widening meets subnormal targets (under
    // 6.1e-5, common in a vocabulary's probabilities) with arithmetic on f32
    // denormals, microcode assists on Intel: the backward took 380 ms at
    // `[4096, 32000]` (bf16: 60).
    let wide_p = target_f32(p, wide).filter(|_| widened_with(w));
    let c = (1.0 - eps, eps / x.len() as f64);
    let total = match (w, wide_p) {
        (None, Some(p)) => (1.0 - eps) * f64::from(target_sum(p)) + eps,
        (None, None) => (1.0 - eps) * target_sum(p).to_f64() + eps,
        (Some(Weights { wide: Some(w), .. }), Some(p)) => weighted_sum(p, w, c),
        (Some(w), _) => weighted_sum(p, w.w, c),
    };
    let gp = T::Acc::from_f64(g * (1.0 - eps));
    let off = T::Acc::from_f64(g * eps / x.len() as f64);
    let narrow = std::mem::size_of::<T>() != std::mem::size_of::<T::Acc>();
    let lim = T::Acc::from_f64(LSE_TRUSTED_BELOW);
    let lse = lse.filter(|&l| narrow || (l < lim && l > T::Acc::ZERO - lim));
    if let (Some(m), false) = (lse, narrow) {
        let ga = T::Acc::from_f64(g * total);
        let e = |x: T| (x.to_acc() - m).exp_nonpos() * ga;
        // f32 logits: the target (and weights) as widened above where they
        // were (an f16 target read in software took this backward 239 ms at
        // `[4096, 32000]`, 66 widened); `T::Acc` is then f32.
        let acc = |v: f32| cast::<f32, T::Acc>(std::slice::from_ref(&v))[0];
        match (w, wide_p) {
            (Some(Weights { wide: Some(w), .. }), Some(p)) => {
                let f = |x: T, p: f32, w: f32| T::from_acc(e(x) - acc(w) * (acc(p) * gp + off));
                map3_into(x, p, w, dx, f, ahead, ahead_w);
            }
            (None, Some(p)) => {
                map3_into(x, p, p, dx, |x, p, _| T::from_acc(e(x) - (acc(p) * gp + off)), ahead, ahead_w)
            }
            (Some(w), _) => {
                let f = |x: T, p: P, w: P| T::from_acc(e(x) - w.to_acc() * (p.to_acc() * gp + off));
                map3_into(x, p, w.w, dx, f, ahead, ahead_w);
            }
            (None, None) => {
                map3_into(x, p, p, dx, |x, p, _| T::from_acc(e(x) - (p.to_acc() * gp + off)), ahead, ahead_w)
            }
        }
        return;
    }
    let m = lse.unwrap_or_else(|| row_max(x, one));
    let s = exp_into(x, scratch, one, m, ahead, ahead_w);
    let ga = T::Acc::from_f64(g * total / s.to_f64());
    // In `T::Acc` in place, then narrowed by the CPU's conversion
    // instruction where it has one (not rounded value by value).
    let affine = |e: &mut T::Acc, p: T::Acc| *e = *e * ga - (p * gp + off);
    let weighted = |e: &mut T::Acc, p: T::Acc, w: T::Acc| *e = *e * ga - w * (p * gp + off);
    // `T::Acc` is f32 where the target was widened.
    match (w, wide_p) {
        (None, Some(p)) => scratch.iter_mut().zip(cast::<f32, T::Acc>(p)).for_each(|(e, &p)| affine(e, p)),
        (None, None) => scratch.iter_mut().zip(p).for_each(|(e, p)| affine(e, p.to_acc())),
        (Some(Weights { wide: Some(w), .. }), Some(p)) => {
            let pw = cast::<f32, T::Acc>(p).iter().zip(cast::<f32, T::Acc>(w));
            scratch.iter_mut().zip(pw).for_each(|(e, (&p, &w))| weighted(e, p, w));
        }
        (Some(w), _) => {
            let pw = p.iter().zip(w.w);
            scratch.iter_mut().zip(pw).for_each(|(e, (p, w))| weighted(e, p.to_acc(), w.to_acc()));
        }
    }
    T::from_acc_slice(scratch, dx);
}

/// `sum(p)`, by `sums3`'s loop: `sum_map`'s compiled to two lanes here for
/// bf16, the first read of the target row (the backward 60 -> 47 ms at
/// `[4096, 32000]`; prefetching the next row's target changed nothing).
#[inline(always)]
fn target_sum<P: Element>(p: &[P]) -> P::Acc {
    sums3(p, p, p, |p, _, _| (p, P::Acc::ZERO)).0
}

/// `dx_i = f(x_i, p_i, w_i)` in parts of 32, prefetching the next row's
/// input (`ahead`) and output (`ahead_w`) as it goes, as `exp_into` does
/// (`w` is `p` again where there are no weights: `f` does not read it).
#[inline(always)]
fn map3_into<T: Element, P: Element>(
    x: &[T],
    p: &[P],
    w: &[P],
    dx: &mut [T],
    f: impl Fn(T, P, P) -> T,
    ahead: &[T],
    ahead_w: &[T],
) {
    const W: usize = 32;
    let (cx, cp, cw, cd) = (x.chunks_exact(W), p.chunks_exact(W), w.chunks_exact(W), dx.chunks_exact_mut(W));
    let at = x.len() - cx.remainder().len();
    for (k, (((cx, cp), cw), cd)) in cx.zip(cp).zip(cw).zip(cd).enumerate() {
        prefetch_part::<T, false>(ahead, k, W);
        prefetch_part::<T, true>(ahead_w, k, W);
        for i in 0..W {
            cd[i] = f(cx[i], cp[i], cw[i]);
        }
    }
    let rest = x[at..].iter().zip(&p[at..]).zip(&w[at..]);
    for (d, ((&x, &p), &w)) in dx[at..].iter_mut().zip(rest) {
        *d = f(x, p, w);
    }
}

/// Reference forward in f64: the reduced loss (`rows` values for `None`).
pub fn forward_ref<T: Element, P: Element>(
    logits: &[T],
    target: &[P],
    weight: Option<&[P]>,
    cols: usize,
    eps: f64,
    reduction: Reduction,
) -> Vec<f64> {
    let mut losses = vec![];
    for (x, p) in logits.chunks(cols).zip(target.chunks(cols)) {
        let lse = lse_ref(x);
        let a = target_ref(p, weight, eps);
        losses.push(x.iter().zip(a).map(|(x, a)| a * (lse - x.to_f64())).sum());
    }
    let rows = losses.len() as f64;
    match reduction {
        Reduction::None => losses,
        Reduction::Sum => vec![losses.iter().sum()],
        Reduction::Mean => vec![losses.iter().sum::<f64>() / rows],
    }
}

/// Reference backward in f64.
pub fn backward_ref<T: Element, P: Element, O: Element>(
    grad: &[O],
    logits: &[T],
    target: &[P],
    weight: Option<&[P]>,
    cols: usize,
    eps: f64,
    reduction: Reduction,
) -> Vec<f64> {
    let rows = logits.len() / cols;
    let mut out = vec![];
    for (i, (x, p)) in logits.chunks(cols).zip(target.chunks(cols)).enumerate() {
        let g = match reduction {
            Reduction::None => grad[i].to_f64(),
            Reduction::Sum => grad[0].to_f64(),
            Reduction::Mean => grad[0].to_f64() / rows as f64,
        };
        let lse = lse_ref(x);
        let q = target_ref(p, weight, eps);
        let total: f64 = q.iter().sum();
        out.extend(x.iter().zip(&q).map(|(x, q)| g * (total * (x.to_f64() - lse).exp() - q)));
    }
    out
}

/// A row's target in f64: `w ((1 - eps) p + eps / v)` (`w` 1 where none).
fn target_ref<P: Element>(p: &[P], weight: Option<&[P]>, eps: f64) -> Vec<f64> {
    let (w, v) = (|j: usize| weight.map_or(1.0, |w| w[j].to_f64()), p.len() as f64);
    p.iter().enumerate().map(|(j, p)| w(j) * ((1.0 - eps) * p.to_f64() + eps / v)).collect()
}

/// A row's log-sum-exp in f64.
fn lse_ref<T: Element>(x: &[T]) -> f64 {
    let m = x.iter().map(|v| v.to_f64()).fold(f64::NEG_INFINITY, f64::max);
    m + x.iter().map(|v| (v.to_f64() - m).exp()).sum::<f64>().ln()
}
