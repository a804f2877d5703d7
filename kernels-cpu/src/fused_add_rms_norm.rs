//! `s = x + residual` and `rms_norm(s) * w` in one pass over memory: the
//! pre-norm step of every transformer block (vLLM's `fused_add_rms_norm`,
//! out of place, and in place as vLLM has it: [`forward_inplace`]).
//!
//! - Forward writes `out = rms_norm(s) * w` and `sum = s`, where `s` is
//!   rounded to `T` first, exactly as `s = x + r; F.rms_norm(s)` in torch, so
//!   `out` is the rms_norm of the `sum` returned.
//! - Both forwards take a [`Rounding`]: [`Rounding::BeforeWeight`] rounds
//!   `s / rms` to `T` before the weight, as vLLM's kernel does.
//! - Backward: `grad_sum = rms_norm_backward(grad_out, s, w) + grad_sum_out`,
//!   which is the gradient of both `x` and `residual`; `grad_weight` as for
//!   rms_norm. It is [`crate::rms_norm`]'s backward with the extra addend.
use crate::element::{Acc, Element};
use crate::error::{check_len, Result};
use crate::layout::RowLayout;
use crate::par::Par;
use crate::rms_norm::{self, forward_row, rounds_first, Rounding};
use crate::rows::{Blocks, Split};
use crate::simd::dispatch;

#[cfg(target_arch = "x86_64")]
mod x86;

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

/// Forward: `sum = x + residual` (rounded to `T`), `out = rms_norm(sum) *
/// weight`, rounded as `rounding` says.
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Element>(
    x: &[T],
    residual: &[T],
    weight: Option<&[T]>,
    out: &mut [T],
    sum: &mut [T],
    cols: usize,
    eps: f64,
    rounding: Rounding,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_forward(x.len(), residual.len(), weight.map(<[T]>::len), out.len(), sum.len(), cols, eps)?;
    if rows == 0 {
        return Ok(());
    }
    let eps = T::Acc::from_f64(eps);
    let round = rounds_first::<T>(weight, rounding);
    let blocks = Blocks::new(&par, rows, cols);
    let ys = Split::new(out, blocks.per * cols);
    let ss = Split::new(sum, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let (mut y, mut s) = (ys.get(b), ss.get(b));
        let at = blocks.rows(b).start * cols;
        let (x, r) = (&x[at..][..y.len()], &residual[at..][..y.len()]);
        #[cfg(target_arch = "x86_64")]
        if crate::wide::has_lanes::<T>() {
            let k = x86::Forward { x, r, w: weight, y: &mut y, s: &mut s, cols, eps: eps.to_f64() as f32, round };
            if crate::wide::x86::run(k).is_some() {
                return;
            }
        }
        dispatch(
            #[inline(always)]
            || {
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
                    forward_row(s, weight, y, eps, round, &[]);
                }
            },
        );
    });
    Ok(())
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
    rounding: Rounding,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_forward(x.len(), residual.len(), weight.map(<[T]>::len), x.len(), residual.len(), cols, eps)
        .map_err(|e| e.renamed(OP_INPLACE))?;
    if rows == 0 {
        return Ok(());
    }
    let eps = T::Acc::from_f64(eps);
    let round = rounds_first::<T>(weight, rounding);
    let blocks = Blocks::new(&par, rows, cols);
    let xs = Split::new(x, blocks.per * cols);
    let rs = Split::new(residual, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let (mut x, mut r) = (xs.get(b), rs.get(b));
        #[cfg(target_arch = "x86_64")]
        if crate::wide::has_lanes::<T>() {
            let k = x86::ForwardInplace { x: &mut x, r: &mut r, w: weight, cols, eps: eps.to_f64() as f32, round };
            if crate::wide::x86::run(k).is_some() {
                return;
            }
        }
        dispatch(
            #[inline(always)]
            || {
                for (x, r) in x.chunks_exact_mut(cols).zip(r.chunks_exact_mut(cols)) {
                    add_into(x, r);
                    forward_row(r, weight, x, eps, round, &[]);
                }
            },
        );
    });
    Ok(())
}

/// `r = x + r`, rounded to `T`: the in-place forward's sum, in the lane
/// loop (and in `x86.rs`'s kernel for f32 and bf16, so both round alike).
#[inline(always)]
fn add_into<T: Element>(x: &[T], r: &mut [T]) {
    T::update_acc(
        r,
        #[inline(always)]
        |at, s| {
            for (s, x) in s.iter_mut().zip(&x[at..]) {
                *s = x.to_acc() + *s;
            }
        },
    );
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
/// kernel does, and `out` rounded as `rounding` says
/// ([`rms_norm::forward_ref_rounded`]).
pub fn forward_ref<T: Element>(
    x: &[T],
    residual: &[T],
    weight: Option<&[T]>,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> (Vec<f64>, Vec<T>) {
    let s: Vec<T> = x.iter().zip(residual).map(|(a, b)| T::from_f64(a.to_f64() + b.to_f64())).collect();
    (rms_norm::forward_ref_rounded(&s, weight, cols, eps, rounding), s)
}
