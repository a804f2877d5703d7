//! Softmax over the last dimension of `x * scale`, and its backward.
//!
//! For a row `x` of `n` elements: `y = exp(s x - max(s x)) / sum(exp(s x - max(s x)))`
//! with `s = scale`, the same as `torch.softmax(x * scale, -1)`.
//!
//! - Shapes: `x`, `out`, `grad_out`, `grad_input` hold `rows * cols` elements.
//! - Numerics: max-subtracted, `exp` and sums in `T::Acc`, one rounding to `T`.
//!   A row whose every `s x` is `-inf` gives NaN (as torch), as does a row with a
//!   NaN or `+inf`.
//! - Backward (from the output `y`): `dx = s y (dy - sum(dy y))`.
//! - Passes: max, then `exp` into a row-sized `Acc` scratch (L1/L2-resident)
//!   with its sum, then the scaled store: the input is read from memory once.
use crate::element::{Acc, Element};
use crate::error::{check_len, check_rows, Error, Result};
use crate::par::Par;
use crate::rows::{Blocks, Split};
use crate::simd::{dispatch, reduce_lanes, sum_pairs, LANES};

const OP_FWD: &str = "softmax";
const OP_BWD: &str = "softmax_backward";

/// Checks `scale` (finite) and that `len` is whole rows of `cols`; returns the rows.
pub fn check(op: &'static str, len: usize, cols: usize, scale: f64) -> Result<usize> {
    if !scale.is_finite() {
        return Err(Error::Shape { op, arg: "scale", msg: format!("must be finite, got {scale}") });
    }
    check_rows(op, len, cols, 0.0)
}

/// Forward: `out = softmax(x * scale)` row by row.
pub fn forward<T: Element>(x: &[T], out: &mut [T], cols: usize, scale: f64, par: Par<'_>) -> Result<()> {
    let rows = check(OP_FWD, x.len(), cols, scale)?;
    check_len(OP_FWD, "out", out.len(), x.len())?;
    if rows == 0 {
        return Ok(());
    }
    let scale = T::Acc::from_f64(scale);
    let blocks = Blocks::new(&par, rows, cols);
    let ys = Split::new(out, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let mut y = ys.get(b);
        let x = &x[blocks.rows(b).start * cols..][..y.len()];
        let mut scratch = vec![T::Acc::ZERO; cols];
        dispatch(
            #[inline(always)]
            || {
                for (x, y) in x.chunks_exact(cols).zip(y.chunks_exact_mut(cols)) {
                    forward_row(x, y, &mut scratch, scale);
                }
            },
        );
    });
    Ok(())
}

/// Backward: `grad_input = scale * y * (grad_out - sum(grad_out * y))`, from
/// the forward's output `y`.
pub fn backward<T: Element>(
    grad_out: &[T],
    y: &[T],
    grad_input: &mut [T],
    cols: usize,
    scale: f64,
    par: Par<'_>,
) -> Result<()> {
    let rows = check(OP_BWD, y.len(), cols, scale)?;
    check_len(OP_BWD, "grad_out", grad_out.len(), y.len())?;
    check_len(OP_BWD, "grad_input", grad_input.len(), y.len())?;
    if rows == 0 {
        return Ok(());
    }
    let scale = T::Acc::from_f64(scale);
    let blocks = Blocks::new(&par, rows, cols);
    let dxs = Split::new(grad_input, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let mut dx = dxs.get(b);
        let at = blocks.rows(b).start * cols;
        let (y, dy) = (&y[at..][..dx.len()], &grad_out[at..][..dx.len()]);
        dispatch(
            #[inline(always)]
            || {
                for ((y, dy), dx) in y.chunks_exact(cols).zip(dy.chunks_exact(cols)).zip(dx.chunks_exact_mut(cols)) {
                    let dot = sum_pairs(dy, y, |g, y| g * y);
                    T::write_acc(
                        dx,
                        #[inline(always)]
                        |at, dx| {
                            let (y, dy) = (&y[at..][..dx.len()], &dy[at..][..dx.len()]);
                            for ((dx, y), dy) in dx.iter_mut().zip(y).zip(dy) {
                                *dx = scale * y.to_acc() * (dy.to_acc() - dot);
                            }
                        },
                    );
                }
            },
        );
    });
    Ok(())
}

/// `max(x_i * scale)` over a row with `LANES` accumulators (NaN is skipped
/// here; it reaches the output through the sum).
#[inline(always)]
pub(crate) fn row_max<T: Element>(x: &[T], scale: T::Acc) -> T::Acc {
    let neg_inf = T::Acc::from_f64(f64::NEG_INFINITY);
    let mut m = [neg_inf; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            m[i] = m[i].max(c[i].to_acc() * scale);
        }
    }
    let mut best = neg_inf;
    for v in m.iter().copied().chain(rest.iter().map(|v| v.to_acc() * scale)) {
        best = best.max(v);
    }
    best
}

/// `e_i = exp(x_i * scale - m)` into `e`, returning their sum (`LANES` accumulators).
#[inline(always)]
pub(crate) fn exp_into<T: Element>(x: &[T], e: &mut [T::Acc], scale: T::Acc, m: T::Acc) -> T::Acc {
    let mut acc = [T::Acc::ZERO; LANES];
    let (cx, ce) = (x.chunks_exact(LANES), e.chunks_exact_mut(LANES));
    let rx = cx.remainder();
    let mut tail = T::Acc::ZERO;
    for (cx, ce) in cx.zip(ce) {
        for i in 0..LANES {
            let v = (cx[i].to_acc() * scale - m).exp();
            ce[i] = v;
            acc[i] = acc[i] + v;
        }
    }
    let at = x.len() - rx.len();
    for (x, e) in rx.iter().zip(&mut e[at..]) {
        *e = (x.to_acc() * scale - m).exp();
        tail = tail + *e;
    }
    reduce_lanes(acc) + tail
}

/// `sum(exp(x_i * scale - m))` with `LANES` accumulators, nothing stored.
#[inline(always)]
pub(crate) fn exp_sum<T: Element>(x: &[T], scale: T::Acc, m: T::Acc) -> T::Acc {
    let mut acc = [T::Acc::ZERO; LANES];
    let cx = x.chunks_exact(LANES);
    let mut tail = T::Acc::ZERO;
    for v in cx.remainder() {
        tail = tail + (v.to_acc() * scale - m).exp();
    }
    for cx in cx {
        for i in 0..LANES {
            acc[i] = acc[i] + (cx[i].to_acc() * scale - m).exp();
        }
    }
    reduce_lanes(acc) + tail
}

#[inline(always)]
fn forward_row<T: Element>(x: &[T], y: &mut [T], scratch: &mut [T::Acc], scale: T::Acc) {
    let m = row_max(x, scale);
    let s = exp_into(x, scratch, scale, m);
    let inv = T::Acc::ONE / s;
    // Plain `from_acc` here: through `write_acc`'s blocks this loop measured
    // 7% slower in bf16 (the row is bound by `exp`, not by the rounding).
    for (y, e) in y.iter_mut().zip(scratch.iter()) {
        *y = T::from_acc(*e * inv);
    }
}

/// Reference forward in f64 (max-subtracted).
pub fn forward_ref<T: Element>(x: &[T], cols: usize, scale: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols.max(1)) {
        let v: Vec<f64> = row.iter().map(|x| x.to_f64() * scale).collect();
        let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = v.iter().map(|v| (v - m).exp()).sum();
        out.extend(v.iter().map(|v| (v - m).exp() / s));
    }
    out
}

/// Reference backward in f64, from the output `y`.
pub fn backward_ref<T: Element>(grad_out: &[T], y: &[T], cols: usize, scale: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(y.len());
    for (y, dy) in y.chunks(cols.max(1)).zip(grad_out.chunks(cols.max(1))) {
        let dot: f64 = y.iter().zip(dy).map(|(y, g)| y.to_f64() * g.to_f64()).sum();
        out.extend(y.iter().zip(dy).map(|(y, g)| scale * y.to_f64() * (g.to_f64() - dot)));
    }
    out
}
