//! `s = x + residual` and `rms_norm(s) * w` in one pass over memory: the
//! pre-norm step of every transformer block (vLLM's `fused_add_rms_norm`,
//! out of place, and in place as vLLM has it: [`forward_inplace`]).
//!
//! - Forward writes `out = rms_norm(s) * w` and `sum = s`, where `s` is
//!   rounded to `T` first, exactly as `s = x + r; F.rms_norm(s)` in torch, so
//!   `out` is the rms_norm of the `sum` returned.
//! - Backward: `grad_sum = rms_norm_backward(grad_out, s, w) + grad_sum_out`,
//!   which is the gradient of both `x` and `residual`; `grad_weight` as for
//!   rms_norm. It is [`crate::rms_norm`]'s backward with the extra addend.
use crate::element::{Acc, Element};
use crate::error::{check_len, Result};
use crate::layout::RowLayout;
use crate::par::Par;
use crate::rms_norm::{self, forward_row};
use crate::rows::{Blocks, Split};
use crate::simd::dispatch;
use crate::wide::{cast, cast_mut};
use crate::widen;
use half::f16;

const OP_FWD: &str = "fused_add_rms_norm";
const OP_BWD: &str = "fused_add_rms_norm_backward";
const OP_INPLACE: &str = "fused_add_rms_norm_";

/// Checks the lengths of a forward call; returns the number of rows.
pub fn check_forward(
    x: usize,
    residual: usize,
    weight: Option<usize>,
    out: usize,
    sum: usize,
    cols: usize,
    eps: f64,
) -> Result<usize> {
    let rows = rms_norm::check_forward(x, weight, out, cols, eps).map_err(|e| e.renamed(OP_FWD))?;
    check_len(OP_FWD, "residual", residual, x)?;
    check_len(OP_FWD, "sum", sum, x)?;
    Ok(rows)
}

/// Checks the lengths of a backward call; returns the number of rows.
#[allow(clippy::too_many_arguments)]
pub fn check_backward(
    grad_out: usize,
    grad_sum_out: Option<usize>,
    sum: usize,
    weight: Option<usize>,
    grad_sum: usize,
    grad_weight: Option<usize>,
    cols: usize,
    eps: f64,
) -> Result<usize> {
    let rows = rms_norm::check_backward(grad_out, sum, weight, grad_sum, grad_weight, cols, eps)
        .map_err(|e| e.renamed(OP_BWD))?;
    if let Some(g) = grad_sum_out {
        check_len(OP_BWD, "grad_sum_out", g, sum)?;
    }
    Ok(rows)
}

/// Forward: `sum = x + residual` (rounded to `T`), `out = rms_norm(sum) * weight`.
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Element>(
    x: &[T],
    residual: &[T],
    weight: Option<&[T]>,
    out: &mut [T],
    sum: &mut [T],
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_forward(x.len(), residual.len(), weight.map(<[T]>::len), out.len(), sum.len(), cols, eps)?;
    if rows == 0 {
        return Ok(());
    }
    let eps = T::Acc::from_f64(eps);
    let blocks = Blocks::new(&par, rows, cols);
    let ys = Split::new(out, blocks.per * cols);
    let ss = Split::new(sum, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let (mut y, mut s) = (ys.get(b), ss.get(b));
        let at = blocks.rows(b).start * cols;
        let (x, r) = (&x[at..][..y.len()], &residual[at..][..y.len()]);
        dispatch(
            #[inline(always)]
            || {
                if widen::applies::<T>() {
                    let (y, s) = (cast_mut::<T, f16>(&mut y), cast_mut::<T, f16>(&mut s));
                    let (y, s) = (y.expect("widen applies to f16 only"), s.expect("widen applies to f16 only"));
                    return forward_rows_f16(cast(x), cast(r), weight.map(cast), y, s, eps.to_f64() as f32, cols);
                }
                for ((x, r), (y, s)) in x
                    .chunks_exact(cols)
                    .zip(r.chunks_exact(cols))
                    .zip(y.chunks_exact_mut(cols).zip(s.chunks_exact_mut(cols)))
                {
                    T::write_acc(
                        s,
                        #[inline(always)]
                        |at, s| {
                            let (x, r) = (&x[at..][..s.len()], &r[at..][..s.len()]);
                            for ((s, x), r) in s.iter_mut().zip(x).zip(r) {
                                *s = x.to_acc() + r.to_acc();
                            }
                        },
                    );
                    // `s` is still in L1: the norm reads it from there.
                    forward_row(s, weight, y, eps, &[]);
                }
            },
        );
    });
    Ok(())
}

/// The forward's rows for f16 where [`widen`] applies: `x` and `residual`
/// widened to f32 (the weight once), then [`f16_row`]. The f16 loop's values,
/// bit for bit.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn forward_rows_f16(
    x: &[f16],
    residual: &[f16],
    weight: Option<&[f16]>,
    out: &mut [f16],
    sum: &mut [f16],
    eps: f32,
    cols: usize,
) {
    let mut bufs: [Vec<f32>; 4] = Default::default();
    let [xs, rs, ss, ws] = &mut bufs;
    let weight = weight.map(|w| widen::to_f32(w, ws).expect(WIDENED));
    for ((x, r), (y, s)) in x
        .chunks_exact(cols)
        .zip(residual.chunks_exact(cols))
        .zip(out.chunks_exact_mut(cols).zip(sum.chunks_exact_mut(cols)))
    {
        let (x, r) = (widen::to_f32(x, xs).expect(WIDENED), widen::to_f32(r, rs).expect(WIDENED));
        f16_row(x, r, weight, y, s, ss, eps);
    }
}

/// [`forward_rows_f16`] in place: each row of `x` and `residual` is widened
/// before either is written.
#[inline(always)]
fn forward_rows_f16_inplace(x: &mut [f16], residual: &mut [f16], weight: Option<&[f16]>, eps: f32, cols: usize) {
    let mut bufs: [Vec<f32>; 4] = Default::default();
    let [xs, rs, ss, ws] = &mut bufs;
    let weight = weight.map(|w| widen::to_f32(w, ws).expect(WIDENED));
    for (x, r) in x.chunks_exact_mut(cols).zip(residual.chunks_exact_mut(cols)) {
        let (xw, rw) = (widen::to_f32(x, xs).expect(WIDENED), widen::to_f32(r, rs).expect(WIDENED));
        f16_row(xw, rw, weight, x, r, ss, eps);
    }
}

const WIDENED: &str = "fused_add_rms_norm: widen applies";

/// One f16 row from widened inputs: their sum rounded to f16 into `sum`,
/// that row widened back (exactly: the norm reads the rounded sum, as the
/// f16 loop does), then [`forward_row`] with f32 inputs and f16 outputs.
#[inline(always)]
fn f16_row(
    x: &[f32],
    r: &[f32],
    weight: Option<&[f32]>,
    out: &mut [f16],
    sum: &mut [f16],
    ss: &mut Vec<f32>,
    eps: f32,
) {
    f16::write_acc(
        sum,
        #[inline(always)]
        |at, s| {
            let (x, r) = (&x[at..][..s.len()], &r[at..][..s.len()]);
            for ((s, x), r) in s.iter_mut().zip(x).zip(r) {
                *s = x + r;
            }
        },
    );
    let s = widen::to_f32(sum, ss).expect(WIDENED);
    forward_row(s, weight, out, eps, &[]);
}

/// In-place forward, as vLLM's `fused_add_rms_norm`: `residual` becomes
/// `x + residual` (rounded to `T`) and `x` becomes `rms_norm(residual) *
/// weight`; bit for bit the `sum` and `out` of [`forward`]. No memory is
/// allocated for outputs: at inference, where nothing keeps the block's
/// input, this saves the page faults of two fresh tensors.
pub fn forward_inplace<T: Element>(
    x: &mut [T],
    residual: &mut [T],
    weight: Option<&[T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_forward(x.len(), residual.len(), weight.map(<[T]>::len), x.len(), residual.len(), cols, eps)
        .map_err(|e| e.renamed(OP_INPLACE))?;
    if rows == 0 {
        return Ok(());
    }
    let eps = T::Acc::from_f64(eps);
    let blocks = Blocks::new(&par, rows, cols);
    let xs = Split::new(x, blocks.per * cols);
    let rs = Split::new(residual, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let (mut x, mut r) = (xs.get(b), rs.get(b));
        dispatch(
            #[inline(always)]
            || {
                if widen::applies::<T>() {
                    let (x, r) = (cast_mut::<T, f16>(&mut x), cast_mut::<T, f16>(&mut r));
                    let (x, r) = (x.expect(WIDENED), r.expect(WIDENED));
                    return forward_rows_f16_inplace(x, r, weight.map(cast), eps.to_f64() as f32, cols);
                }
                for (x, r) in x.chunks_exact_mut(cols).zip(r.chunks_exact_mut(cols)) {
                    T::update_acc(
                        r,
                        #[inline(always)]
                        |at, s| {
                            for (s, x) in s.iter_mut().zip(&x[at..]) {
                                *s = x.to_acc() + *s;
                            }
                        },
                    );
                    forward_row(r, weight, x, eps, &[]);
                }
            },
        );
    });
    Ok(())
}

/// Backward: `grad_sum` (the gradient of both `x` and `residual`) and, when
/// given, `grad_weight`, from the forward's `sum` output. `grad_sum_out` is
/// the gradient arriving at the `sum` output (None for zero).
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
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
    let rows = check_backward(
        grad_out.len(),
        grad_sum_out.map(<[T]>::len),
        sum.len(),
        weight.map(<[T]>::len),
        grad_sum.len(),
        grad_weight.as_deref().map(<[T]>::len),
        cols,
        eps,
    )?;
    let layout = RowLayout::contiguous(rows, cols);
    rms_norm::backward_unchecked(grad_out, grad_sum_out, sum, layout, weight, grad_sum, grad_weight, cols, eps, par);
    Ok(())
}

/// Reference forward in f64: `(out, sum)`, with `sum` rounded to `T` as the
/// kernel does.
pub fn forward_ref<T: Element>(
    x: &[T],
    residual: &[T],
    weight: Option<&[T]>,
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Vec<T>) {
    let s: Vec<T> = x.iter().zip(residual).map(|(a, b)| T::from_f64(a.to_f64() + b.to_f64())).collect();
    (rms_norm::forward_ref(&s, weight, cols, eps), s)
}

#[cfg(test)]
mod tests {
    use super::forward_rows_f16;
    use crate::element::Element;
    use crate::rms_norm::forward_row;
    use crate::simd::dispatch;
    use crate::widen::testing::{bits, runs, wave};
    use half::f16;

    /// The widened f16 forward against the plain f16 one (the loop of
    /// `forward`), bit for bit: `sum` and `out`, with and without weight,
    /// sums that round and overflow.
    #[test]
    fn widened_f16_forward_is_the_plain_one() {
        if !runs() {
            return;
        }
        let (rows, cols) = (16, 300);
        let (x, mut res, w) = (wave(rows * cols, 0.37), wave(rows * cols, 0.53), wave(cols, 1.7));
        res[4] = f16::MAX;
        for weight in [Some(&w[..]), None] {
            let n = rows * cols;
            let (mut y, mut s, mut y_want, mut s_want) =
                (vec![f16::ZERO; n], vec![f16::ZERO; n], vec![f16::ZERO; n], vec![f16::ZERO; n]);
            dispatch(|| forward_rows_f16(&x, &res, weight, &mut y, &mut s, 1e-6, cols));
            dispatch(|| {
                for r in 0..rows {
                    let row = r * cols..(r + 1) * cols;
                    let s = &mut s_want[row.clone()];
                    for ((s, x), r) in s.iter_mut().zip(&x[row.clone()]).zip(&res[row.clone()]) {
                        *s = f16::from_acc(x.to_acc() + r.to_acc());
                    }
                    forward_row(s, weight, &mut y_want[row], 1e-6f32, &[]);
                }
            });
            assert_eq!(bits(&s), bits(&s_want), "sum, weight {}", weight.is_some());
            assert_eq!(bits(&y), bits(&y_want), "out, weight {}", weight.is_some());
        }
    }
}
