//! Softmax over the last dimension of `x * scale`, and its backward.
//!
//! For a row `x` of `n` elements: `y = exp(s x - max(s x)) / sum(exp(s x - max(s x)))`
//! with `s = scale`, the same as `torch.softmax(x * scale, -1)`.
//!
//! - Shapes: `x`, `out`, `grad_out`, `grad_input` hold `rows * cols` elements.
//! - Numerics: max-subtracted, `exp` and sums in `T::Acc`, one rounding to `T`.
//!   For f32 the `exp` is a degree-5 one for arguments <= 0, within 2.2 ulp
//!   (`Acc::exp_nonpos`); terms under `exp(-87.34)` (1.2e-38) count as 0.
//!   bf16 and f16 rows on x86 (AVX2 or AVX-512) take `2^t` for
//!   `t = (s x - m) log2 e` with a degree-4 polynomial, within 2.7e-6
//!   relative and `t`'s rounding (`math::exp_shifted_narrow_f32`; torch's
//!   `fexp_u20` makes the same trade for 16-bit outputs): outputs within one
//!   unit in the last place of the exact value, and rounded as it would be
//!   in all but a few (measured on normal rows of 4096: 0.03-0.05% of bf16
//!   outputs, 0.05-0.22% of f16, as with the degree-4 `e^x` before it).
//!   Elsewhere (the lane loops) they take the f32 one.
//!   A row whose every `s x` is `-inf` gives NaN (as torch), as does a row with a
//!   NaN or `+inf`.
//! - Backward (from the output `y`): `dx = s y (dy - sum(dy y))`.
//! - Passes: max, then `exp` into a row-sized `Acc` scratch (L1/L2-resident)
//!   with its sum, then the scaled store: the input is read from memory once.
//!   bf16 and f16 rows on x86 are widened into the scratch by the max's pass
//!   and the `exp` runs there in place.
use crate::element::{Acc, Element};
use crate::error::{check_len, check_rows, Error, Result};
use crate::par::Par;
use crate::rows::{next_row, row_and_next, Blocks, Split};
use crate::simd::{dispatch, prefetch_part, reduce2, sum_pairs};
#[cfg(target_arch = "x86_64")]
use crate::wide::cast_mut;

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_backward;

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
                let rows = x.len() / cols;
                for r in 0..rows {
                    let (x, ahead) = row_and_next(x, r, cols);
                    let (y, ahead_w) = y[r * cols..].split_at_mut(cols);
                    forward_row(x, y, &mut scratch, scale, ahead, next_row(ahead_w, cols));
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
        #[cfg(target_arch = "x86_64")]
        if x86_backward::backward_rows(y, dy, &mut dx, cols, scale.to_f64() as f32) {
            return;
        }
        dispatch(
            #[inline(always)]
            || backward_rows_lanes(y, dy, &mut dx, cols, scale),
        );
    });
    Ok(())
}

/// The backward over whole rows, left to LLVM's vectoriser (the fallback of
/// `softmax/x86_backward.rs`): `dot = sum(dy y)`, then `dx = (s y) (dy - dot)`.
#[inline(always)]
fn backward_rows_lanes<T: Element>(y: &[T], dy: &[T], dx: &mut [T], cols: usize, scale: T::Acc) {
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
}

/// `max(x_i * scale)` over a row (NaN is skipped here; it reaches the output
/// through the sum): explicit AVX-512 where there is some (`softmax/x86.rs`),
/// else [`row_max_lanes`].
#[inline(always)]
pub(crate) fn row_max<T: Element>(x: &[T], scale: T::Acc) -> T::Acc {
    #[cfg(target_arch = "x86_64")]
    if let Some(m) = x86::row_max(x, scale.to_f64() as f32) {
        return T::Acc::from_f64(m.into());
    }
    row_max_lanes(x, scale)
}

/// [`row_max`] with four vector accumulators left to LLVM.
///
/// Four named arrays of 16 rather than one array: LLVM keeps each in a
/// register, where a 64-lane array went to the stack; and a compare-select
/// (one `vmaxps`) rather than `Acc::max`, whose NaN fix-up made two chains of
/// dependent instructions. Together 9% faster softmax bf16.
#[inline(always)]
fn row_max_lanes<T: Element>(x: &[T], scale: T::Acc) -> T::Acc {
    const W: usize = 16;
    let neg_inf = T::Acc::from_f64(f64::NEG_INFINITY);
    let (mut m0, mut m1, mut m2, mut m3) = ([neg_inf; W], [neg_inf; W], [neg_inf; W], [neg_inf; W]);
    let chunks = x.chunks_exact(4 * W);
    let rest = chunks.remainder();
    #[inline(always)]
    fn step<T: Element>(m: &mut [T::Acc; W], c: &[T], scale: T::Acc) {
        for i in 0..W {
            let v = c[i].to_acc() * scale;
            m[i] = max_select(v, m[i]);
        }
    }
    for c in chunks {
        step::<T>(&mut m0, &c[..W], scale);
        step::<T>(&mut m1, &c[W..2 * W], scale);
        step::<T>(&mut m2, &c[2 * W..3 * W], scale);
        step::<T>(&mut m3, &c[3 * W..], scale);
    }
    for i in 0..W {
        m0[i] = max_select(max_select(m0[i], m1[i]), max_select(m2[i], m3[i]));
    }
    let mut best = neg_inf;
    for v in m0.iter().copied().chain(rest.iter().map(|v| v.to_acc() * scale)) {
        best = best.max(v);
    }
    best
}

/// `e_i = exp(x_i * scale - m)` into `e`, returning their sum: explicit
/// AVX-512 where there is some, else [`exp_into_lanes`].
#[inline(always)]
pub(crate) fn exp_into<T: Element>(
    x: &[T],
    e: &mut [T::Acc],
    scale: T::Acc,
    m: T::Acc,
    ahead: &[T],
    ahead_w: &[T],
) -> T::Acc {
    #[cfg(target_arch = "x86_64")]
    if let Some(e) = cast_mut::<T::Acc, f32>(&mut *e) {
        let sm = (scale.to_f64() as f32, m.to_f64() as f32);
        if let Some(s) = x86::exp_sum::<T, true>(x, e, sm, ahead, ahead_w) {
            return T::Acc::from_f64(s.into());
        }
    }
    exp_into_lanes(x, e, scale, m, ahead, ahead_w)
}

/// [`exp_into`] with lane arrays left to LLVM.
///
/// `m` must be the row's maximum (the arguments of `exp` are then <= 0, see
/// [`Acc::exp_nonpos`]). While this compute-bound pass runs from cache, it
/// prefetches `ahead` (the next row's input, which `row_max` would otherwise
/// wait on) and, for writing, `ahead_w` (the next row's output); either may
/// be empty. That made softmax fwd 30% faster (bf16 4096x4096: 30.5 to 40.9
/// GiB/s).
#[inline(always)]
fn exp_into_lanes<T: Element>(
    x: &[T],
    e: &mut [T::Acc],
    scale: T::Acc,
    m: T::Acc,
    ahead: &[T],
    ahead_w: &[T],
) -> T::Acc {
    const W: usize = 16;
    // Two named accumulators of one vector each: kept in registers (an
    // array of `LANES` lived on the stack here, beside exp's constants).
    let (mut a0, mut a1) = ([T::Acc::ZERO; W], [T::Acc::ZERO; W]);
    #[inline(always)]
    fn step<T: Element>(a: &mut [T::Acc; W], x: &[T], e: &mut [T::Acc], scale: T::Acc, m: T::Acc) {
        for i in 0..W {
            let v = (x[i].to_acc() * scale - m).exp_nonpos();
            e[i] = v;
            a[i] = a[i] + v;
        }
    }
    let (cx, ce) = (x.chunks_exact(2 * W), e.chunks_exact_mut(2 * W));
    let rx = cx.remainder();
    for (k, (cx, ce)) in cx.zip(ce).enumerate() {
        prefetch_part::<T, false>(ahead, k, 2 * W);
        prefetch_part::<T, true>(ahead_w, k, 2 * W);
        let (e0, e1) = ce.split_at_mut(W);
        step::<T>(&mut a0, &cx[..W], e0, scale, m);
        step::<T>(&mut a1, &cx[W..], e1, scale, m);
    }
    let mut tail = T::Acc::ZERO;
    let at = x.len() - rx.len();
    for (x, e) in rx.iter().zip(&mut e[at..]) {
        *e = (x.to_acc() * scale - m).exp_nonpos();
        tail = tail + *e;
    }
    reduce2(a0, a1) + tail
}

/// `sum(exp(x_i * scale - m))`, nothing stored; prefetches `ahead` as
/// [`exp_into`] does. Explicit AVX-512 where there is some, else
/// [`exp_sum_lanes`].
#[inline(always)]
pub(crate) fn exp_sum<T: Element>(x: &[T], scale: T::Acc, m: T::Acc, ahead: &[T]) -> T::Acc {
    #[cfg(target_arch = "x86_64")]
    if let Some(s) = x86::exp_sum::<T, false>(x, &mut [], (scale.to_f64() as f32, m.to_f64() as f32), ahead, &[]) {
        return T::Acc::from_f64(s.into());
    }
    exp_sum_lanes(x, scale, m, ahead)
}

/// [`exp_sum`] with lane arrays left to LLVM.
#[inline(always)]
fn exp_sum_lanes<T: Element>(x: &[T], scale: T::Acc, m: T::Acc, ahead: &[T]) -> T::Acc {
    const W: usize = 16;
    let (mut a0, mut a1) = ([T::Acc::ZERO; W], [T::Acc::ZERO; W]);
    #[inline(always)]
    fn step<T: Element>(a: &mut [T::Acc; W], x: &[T], scale: T::Acc, m: T::Acc) {
        for i in 0..W {
            a[i] = a[i] + (x[i].to_acc() * scale - m).exp_nonpos();
        }
    }
    let cx = x.chunks_exact(2 * W);
    let mut tail = T::Acc::ZERO;
    for v in cx.remainder() {
        tail = tail + (v.to_acc() * scale - m).exp_nonpos();
    }
    for (k, cx) in cx.enumerate() {
        prefetch_part::<T, false>(ahead, k, 2 * W);
        step::<T>(&mut a0, &cx[..W], scale, m);
        step::<T>(&mut a1, &cx[W..], scale, m);
    }
    reduce2(a0, a1) + tail
}

/// `y_i = T(e_i * scale - shift)`, as [`Element::from_acc_slice_affine`]
/// computes it, with the AVX2 rounding that has no NaN fix-up (see
/// `x86::affine_bf16`); true where it ran: bf16 on an AVX2 CPU without
/// AVX512-BF16, `scale` and `shift` finite. The caller's `e` holds no NaN
/// and no infinity (the terms of a finite sum). False, writing nothing,
/// elsewhere: the caller narrows as before.
#[inline(always)]
pub(crate) fn affine_bf16<T: Element>(e: &[T::Acc], (scale, shift): (T::Acc, T::Acc), y: &mut [T]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::wide::is::<T::Acc, f32>() {
        // `T::Acc` is f32: the round trips change nothing.
        let map = (scale.to_f64() as f32, shift.to_f64() as f32);
        return x86::affine_bf16(crate::wide::cast(e), map, y);
    }
    let _ = (e, scale, shift, y);
    false
}

#[inline(always)]
fn forward_row<T: Element>(x: &[T], y: &mut [T], scratch: &mut [T::Acc], scale: T::Acc, ahead: &[T], ahead_w: &[T]) {
    // bf16 and f16 rows on x86: widened (and scaled) once into `scratch`
    // by the maximum's pass, then `exp` in place, the same values as below.
    #[cfg(target_arch = "x86_64")]
    if let Some(w) = cast_mut::<T::Acc, f32>(&mut *scratch) {
        if let Some((m, g)) = x86::widen_max(x, w, scale.to_f64() as f32) {
            let s = x86::exp_sum_in_place(w, m, ahead, ahead_w).expect("softmax: widen_max ran, so exp runs");
            let inv = 1.0 / s;
            if !x86::scale_bf16(w, inv, y, g) {
                crate::wide::x86::even_odd::from_even_odd(w, g);
                T::from_acc_slice_affine(scratch, (T::Acc::from_f64(inv.into()), T::Acc::ZERO), y);
            }
            return;
        }
    }
    let m = row_max(x, scale);
    let s = exp_into(x, scratch, scale, m, ahead, ahead_w);
    // Scaled and narrowed in one pass (through `write_acc`'s blocks this
    // measured 13% slower in bf16, and scaling `scratch` in place then
    // narrowing it whole no faster).
    T::from_acc_slice_affine(scratch, (T::Acc::ONE / s, T::Acc::ZERO), y);
}

/// The larger of `a` and `b`, `b` when either is NaN: one `vmaxps`.
#[inline(always)]
fn max_select<A: Acc>(a: A, b: A) -> A {
    if a > b {
        a
    } else {
        b
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
