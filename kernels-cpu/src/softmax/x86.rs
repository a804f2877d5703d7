//! Softmax's two row passes in explicit SIMD, written once for AVX-512 and
//! AVX2 ([`crate::wide`]): the row's maximum, and `exp(x_i * scale - m)`
//! with its sum (stored or not). Cross-entropy runs them too.
//!
//! The lane loops in `softmax.rs` vectorised, but LLVM broadcast the ten
//! constants of `exp` from memory again on every step and, with AVX2's 16
//! registers, spilled the accumulators to the stack (about a fifth of the
//! instructions of the `exp` pass); it also split the maximum's accumulators
//! into `xmm`, `ymm` and scalar pieces in some builds. Here the constants
//! are broadcast once per row and every step is full width.
//!
//! The values are those of the lane loops, bit for bit: `x * scale - m`
//! multiplied then subtracted, and [`crate::math::exp_nonpos_f32`]'s
//! operations in its order. Only the order of the sum differs (two vector
//! accumulators, a part last step, then a tree over the lanes).
use crate::element::Element;
use crate::math::{LOG2E, NORMAL_CUTOFF, SHIFT_FUSED_MAX};
use crate::simd::prefetch_part;
use crate::wide::x86::math::{ExpNonpos, ExpNonposFn, ExpShiftedNarrow};
use crate::wide::x86::{run, Kernel, Lanes};
use crate::wide::{cast_mut, has_lanes, is};
use half::bf16;
use std::marker::PhantomData;

/// `max(x_i * scale)` (NaN skipped, `-inf` for an empty row), or `None`
/// where there is no explicit code (neither AVX-512 nor AVX2, or `T` not
/// f32, bf16, f16).
#[inline(always)]
pub(super) fn row_max<T: 'static>(x: &[T], scale: f32) -> Option<f32> {
    if !has_lanes::<T>() {
        return None;
    }
    run(Max { x, scale })
}

/// `e_i = exp(x_i * scale - m)` into `e` (when `STORE`; `e` is then as long
/// as `x`), returning their sum; prefetches the same part of `ahead` (and,
/// when `STORE`, of `ahead_w` for writing) at each step, as the lane loop
/// does. `None` where [`row_max`] is.
#[inline(always)]
pub(super) fn exp_sum<T: 'static, const STORE: bool>(
    x: &[T],
    e: &mut [f32],
    (scale, m): (f32, f32),
    ahead: &[T],
    ahead_w: &[T],
) -> Option<f32> {
    if !has_lanes::<T>() {
        return None;
    }
    run(ExpSum::<T, T, STORE>::new(x, e, (scale, m), (ahead, ahead_w)))
}

/// For bf16 and f16 rows: `w_i = x_i * scale` widened into `w` (as long as
/// `x`), returning their maximum (NaN skipped, `-inf` for an empty row) and
/// the length `g` of the groups `w` holds in the even/odd order (0: `w` is
/// in order); `None` for other types or where there is no explicit code.
/// With [`exp_sum_in_place`] after it, softmax widens each value once
/// instead of in both passes: two instructions per 16 bf16 values taken out
/// of the compute-bound `exp` pass for a store in the maximum's.
///
/// bf16 rows that [`scale_bf16`] takes (up to 2^24 values) on AVX2, where
/// the width does not convert, are written in [`Lanes::load_pair_unordered`]'s
/// order: each whole group of `g = 2 N` values from the row's start as its
/// `N` even values then its `N` odd ones, the last `< 2 N` in order. The
/// `exp` pass works value by value, so its values are the same (only its
/// sum's order changes), and [`scale_bf16`] stores the groups back in
/// place with a blend ([`Lanes::store_bf16_pair_normal_even_odd`]); where
/// it refuses,
/// [`from_even_odd`](crate::wide::x86::even_odd::from_even_odd) puts `w`
/// back in order.
#[inline(always)]
pub(super) fn widen_max<T: 'static>(x: &[T], w: &mut [f32], scale: f32) -> Option<(f32, usize)> {
    if !has_lanes::<T>() || is::<T, f32>() {
        return None;
    }
    assert_eq!(w.len(), x.len(), "widen_max: w and x differ in length");
    run(WidenMax { x, w, scale })
}

/// `e_i = exp(e_i - m)` in place, returning their sum, prefetching `ahead`
/// (and `ahead_w` for writing) as [`exp_sum`] does; `None` where there is no
/// explicit code. For rows whose results are rounded to bf16 or f16: the
/// `exp` is [`crate::math::exp_shifted_narrow_f32`] (`2^t`, within 2.7e-6
/// relative and `t`'s rounding; 13% faster than `exp_nonpos_narrow_f32`
/// of `x - m` on AVX-512, 9% with AVX2), 0 where `t` is below
/// [`narrow_cutoff`].
#[inline(always)]
pub(super) fn exp_sum_in_place<A: 'static>(e: &mut [f32], m: f32, ahead: &[A], ahead_w: &[A]) -> Option<f32> {
    run(ExpSum::<f32, A, true, true>::in_place(e, m, (ahead, ahead_w)))
}

/// Where [`exp_sum_in_place`] over a row of `len` values stops, in the
/// units of its `t = (x - m) log2(e)`: `exp` is 0 below
/// `(NORMAL_CUTOFF + ln(len) + 1) log2(e)`, about `-126 + log2(len) + 1.44`
/// (terms under `2.7 len 2^-126`, 3.2e-38 per value: 1.3e-34 for rows of
/// 4096), so that every term left, divided by the sum (at most `len`), is
/// still a normal f32, and [`scale_bf16`] may round without checking for
/// subnormals. A bf16 softmax output under `1.3e-34 / sum` is 0 where it
/// would be that tiny value; f16 cannot hold such values anyway.
#[inline(always)]
pub(super) fn narrow_cutoff(len: usize) -> f32 {
    (NORMAL_CUTOFF + (len.max(1) as f32).ln() + 1.0) * LOG2E
}

/// The longest row [`scale_bf16`] takes: the margin of [`narrow_cutoff`]
/// (a factor `e`) then covers the sum's rounding many times over.
const SCALE_BF16_MAX: usize = 1 << 24;

/// `y_i = bf16(e_i * inv)`, `2 N` values at a time with
/// [`Lanes::store_bf16_pair_normal`] (the CPU's conversion, or on AVX2 the
/// integer rounding with no NaN fix-up), for `e` from [`exp_sum_in_place`]
/// and `inv` one over its sum (no product is then an f32 subnormal: see
/// [`narrow_cutoff`]; where `inv` is finite, no term and no product is NaN
/// either); the values `from_acc` gives. `g` is [`widen_max`]'s: where it
/// is not 0, `e`'s whole groups of `g` are in the even/odd order, and are
/// stored back in place. False, writing nothing, where `T` is not bf16, the
/// row is longer than 2^24, or on AVX2 where `inv` is not finite (a row
/// holding NaN).
#[inline(always)]
pub(super) fn scale_bf16<T: 'static>(e: &[f32], inv: f32, y: &mut [T], g: usize) -> bool {
    match cast_mut::<T, bf16>(y) {
        Some(y) if e.len() <= SCALE_BF16_MAX => {
            run(ScaleBf16::<false> { e, scale: inv, shift: 0.0, y, g }).unwrap_or(false)
        }
        _ => false,
    }
}

/// `y_i = bf16(e_i * scale - shift)`, a multiply then a subtract as in
/// [`crate::Element::from_acc_slice_affine`], rounded as [`scale_bf16`]
/// rounds on AVX2 (integer round to nearest even, 2 N values at a time,
/// f32 subnormals rounded as `from_acc` rounds them), and on AVX2 only:
/// that rounding has no NaN fix-up, and the AVX512-BF16 conversion, which
/// flushes subnormals, is left to the caller's [`crate::narrow`] pass (which
/// checks for them). The caller's `e` holds no NaN and no infinity (the
/// terms of a finite sum, as cross_entropy's backward has them); with
/// `scale` and `shift` finite no result is NaN then. False, writing
/// nothing, where `T` is not bf16, `scale` or `shift` is not finite, or the
/// CPU has AVX512-BF16.
#[inline(always)]
pub(crate) fn affine_bf16<T: 'static>(e: &[f32], (scale, shift): (f32, f32), y: &mut [T]) -> bool {
    // The width that runs there rounds with the instruction, which the
    // kernel refuses: asked here, without entering it (cross_entropy's
    // backward asks once per row).
    if crate::simd::has_v4_bf16() {
        return false;
    }
    match cast_mut::<T, bf16>(y) {
        Some(y) => run(ScaleBf16::<true> { e, scale, shift, y, g: 0 }).unwrap_or(false),
        None => false,
    }
}

/// [`scale_bf16`]'s pass (`scale` is `inv`), and [`affine_bf16`]'s
/// (`AFFINE`: `shift` subtracted after the multiply).
struct ScaleBf16<'a, const AFFINE: bool> {
    e: &'a [f32],
    scale: f32,
    /// Subtracted from each product where `AFFINE` (0 otherwise).
    shift: f32,
    /// As long as `e`.
    y: &'a mut [bf16],
    /// The groups of `e` in the even/odd order (0: none), as [`widen_max`]
    /// gives them: 0 or `2 N` of the width that runs.
    g: usize,
}

impl<const AFFINE: bool> Kernel for ScaleBf16<'_, AFFINE> {
    type Output = bool;
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) -> bool {
        let ScaleBf16 { e, scale, shift, y, g } = self;
        assert!(g == 0 || (g == 2 * L::N && !L::ROUNDS_BF16), "scale_bf16: groups of {g} at this width");
        // The affine map's values may be f32 subnormals, which the
        // conversion instruction would flush: that width keeps the caller's
        // pass, which checks for them.
        if AFFINE && L::ROUNDS_BF16 {
            return false;
        }
        // Without the conversion instruction the rounding has no NaN
        // fix-up: a softmax row holding NaN (its sum NaN) goes to
        // `from_acc`.
        if !(L::ROUNDS_BF16 || (scale.is_finite() && shift.is_finite())) {
            return false;
        }
        assert_eq!(e.len(), y.len(), "scale_bf16: e and y differ in length");
        let (n, st) = (2 * L::N, (l.splat(scale), l.splat(shift)));
        let whole = e.len() / n * n;
        let (p, q) = (e.as_ptr(), y.as_mut_ptr());
        let mut i = 0;
        // SAFETY: `i + 2 N <= whole <= len` of both slices.
        unsafe {
            while i < whole {
                let (lo, hi) =
                    (affine::<L, AFFINE>(l, l.load(p.add(i)), st), affine::<L, AFFINE>(l, l.load(p.add(i + L::N)), st));
                if g == 0 {
                    l.store_bf16_pair_normal(q.add(i), lo, hi);
                } else {
                    l.store_bf16_pair_normal_even_odd(q.add(i), lo, hi);
                }
                i += n;
            }
        }
        for (y, &e) in y[whole..].iter_mut().zip(&e[whole..]) {
            *y = bf16::from_acc(if AFFINE { e * scale - shift } else { e * scale });
        }
        true
    }
}

/// `v * scale`, minus `shift` where `AFFINE`. A function, not a closure,
/// so that it is always inlined into the code compiled for the width.
#[inline(always)]
fn affine<L: Lanes, const AFFINE: bool>(l: L, v: L::V, (scale, shift): (L::V, L::V)) -> L::V {
    if AFFINE {
        l.sub(l.mul(v, scale), shift)
    } else {
        l.mul(v, scale)
    }
}

/// The maximum's pass.
pub(super) struct Max<'a, T> {
    pub(super) x: &'a [T],
    pub(super) scale: f32,
}

impl<T: 'static> Kernel for Max<'_, T> {
    type Output = f32;
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) -> f32 {
        // For `s > 0`, `max(x_i s) = max(x_i) s` exactly (rounding is
        // monotone, NaN is skipped either way, and the largest `x_i` gives
        // the largest product): one multiply per row rather than one per
        // value. Other scales (negative: the order flips) multiply each.
        if self.scale > 0.0 {
            max_of::<L, T, false, false, false>(l, self.x, &mut [], 1.0) * self.scale
        } else {
            max_of::<L, T, true, false, false>(l, self.x, &mut [], self.scale)
        }
    }
}

/// `max(x_i * scale)` (`max(x_i)` when not `SCALED`), also writing each
/// scaled value to `w` when `WRITE` (`w` is then as long as `x`, else
/// unused): in order, or with `EVEN_ODD` each whole group of `2 N` from the
/// start in [`Lanes::load_pair_unordered`]'s order (see [`widen_max`]).
/// Without `WRITE` the order is free, so bf16 takes the pair loads.
#[inline(always)]
fn max_of<L: Lanes, T: 'static, const SCALED: bool, const WRITE: bool, const EVEN_ODD: bool>(
    l: L,
    x: &[T],
    w: &mut [f32],
    scale: f32,
) -> f32 {
    assert!(!WRITE || w.len() == x.len(), "softmax x86: w and x differ in length");
    let (p, len, q, n) = (x.as_ptr(), x.len(), w.as_mut_ptr(), L::N);
    let s = l.splat(scale);
    let scaled = |v| if SCALED { l.mul(v, s) } else { v };
    let mut m = [l.splat(f32::NEG_INFINITY); 4];
    let mut at = 0;
    // `vmaxps` gives its second operand when either is NaN: `max(v, m)`
    // keeps `m` where `v` is NaN, so no lane of `m` is ever NaN.
    // SAFETY (loads, stores): `at + n k + n <= len` in the first loop; the
    // second reads whole vectors while they fit, then the `len - at < n`
    // values left; `w` is as long as `x` when written (asserted); `T` is
    // f32, bf16 or f16 (checked by the callers).
    unsafe {
        while at + 4 * n <= len {
            let vs = if WRITE && !EVEN_ODD {
                // Written out: an array `map` closure was left out of line,
                // without the vector features (2.8x slower, measured).
                let a = p.add(at);
                [l.load(a), l.load(a.add(n)), l.load(a.add(2 * n)), l.load(a.add(3 * n))]
            } else {
                // In any order: the maximum does not depend on it.
                let (a, b) = l.load_pair_unordered(p.add(at));
                let (c, d) = l.load_pair_unordered(p.add(at + 2 * n));
                [a, b, c, d]
            };
            for (k, (m, v)) in m.iter_mut().zip(vs).enumerate() {
                let v = scaled(v);
                if WRITE {
                    l.store(q.add(at + n * k), v);
                }
                *m = l.max(v, *m);
            }
            at += 4 * n;
        }
        if WRITE && EVEN_ODD && at + 2 * n <= len {
            // The last whole group, as the loop above writes its two.
            let (a, b) = l.load_pair_unordered(p.add(at));
            for (k, v) in [a, b].into_iter().enumerate() {
                let v = scaled(v);
                l.store(q.add(at + n * k), v);
                m[k] = l.max(v, m[k]);
            }
            at += 2 * n;
        }
        while at + n <= len {
            let v = scaled(l.load(p.add(at)));
            if WRITE {
                l.store(q.add(at), v);
            }
            m[1] = l.max(v, m[1]);
            at += n;
        }
        if at < len {
            let v = scaled(l.load_part(p.add(at), len - at));
            if WRITE {
                l.store_part(q.add(at), v, len - at);
            }
            m[0] = l.max_part(m[0], v, len - at);
        }
    }
    l.reduce_max(l.max(l.max(m[0], m[1]), l.max(m[2], m[3])))
}

/// [`widen_max`]'s pass.
struct WidenMax<'a, T> {
    x: &'a [T],
    /// As long as `x`.
    w: &'a mut [f32],
    scale: f32,
}

impl<T: 'static> Kernel for WidenMax<'_, T> {
    /// The maximum, and the groups of `w` in the even/odd order (0: none).
    type Output = (f32, usize);
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) -> (f32, usize) {
        let WidenMax { x, w, scale } = self;
        // Where `scale_bf16` will store the row with the integer rounding.
        let g = if is::<T, bf16>() && !L::ROUNDS_BF16 && x.len() <= SCALE_BF16_MAX { 2 * L::N } else { 0 };
        let m = match (scale == 1.0, g > 0) {
            (true, false) => max_of::<L, T, false, true, false>(l, x, w, scale),
            (false, false) => max_of::<L, T, true, true, false>(l, x, w, scale),
            (true, true) => max_of::<L, T, false, true, true>(l, x, w, scale),
            (false, true) => max_of::<L, T, true, true, true>(l, x, w, scale),
        };
        (m, g)
    }
}

/// The `exp` pass, storing each value when `STORE`: from a row of `T`
/// into `e`, or in place in `e` (`T` f32); `A` is the element type of the
/// rows it prefetches. `NARROW` takes the `exp` for 16-bit results.
pub(super) struct ExpSum<'a, T, A, const STORE: bool, const NARROW: bool = false> {
    x: *const T,
    len: usize,
    /// `len` values, when `STORE`.
    e: *mut f32,
    scale: f32,
    m: f32,
    /// Below this `t` (`(x - m) log2(e)`) `exp` is 0 (`NARROW` only).
    cutoff: f32,
    ahead: &'a [A],
    ahead_w: &'a [A],
    /// The borrows of `x` and `e`.
    rows: PhantomData<(&'a [T], &'a mut [f32])>,
}

impl<'a, T, A, const STORE: bool> ExpSum<'a, T, A, STORE, false> {
    /// From `x` into `e` (as long as `x` when `STORE`, else unused).
    pub(super) fn new(
        x: &'a [T],
        e: &'a mut [f32],
        (scale, m): (f32, f32),
        (ahead, ahead_w): (&'a [A], &'a [A]),
    ) -> Self {
        assert!(!STORE || e.len() == x.len(), "exp_sum: e and x differ in length");
        let (x, len, e) = (x.as_ptr(), x.len(), e.as_mut_ptr());
        ExpSum { x, len, e, scale, m, cutoff: NORMAL_CUTOFF, ahead, ahead_w, rows: PhantomData }
    }
}

impl<'a, A> ExpSum<'a, f32, A, true, true> {
    /// In place: `e` is read as the row (already scaled) and overwritten.
    /// Each vector is loaded before the same lanes are stored. With the
    /// `exp` for 16-bit results (`NARROW`), 0 below [`narrow_cutoff`].
    ///
    /// A row whose maximum is past [`SHIFT_FUSED_MAX`] (rare: logits are
    /// not that large) has it subtracted first, here, and goes on with a
    /// maximum of 0.
    pub(super) fn in_place(e: &'a mut [f32], m: f32, (ahead, ahead_w): (&'a [A], &'a [A])) -> Self {
        let m = if m.abs() <= SHIFT_FUSED_MAX {
            m
        } else {
            e.iter_mut().for_each(|v| *v -= m);
            0.0
        };
        let (len, e) = (e.len(), e.as_mut_ptr());
        ExpSum { x: e, len, e, scale: 1.0, m, cutoff: narrow_cutoff(len), ahead, ahead_w, rows: PhantomData }
    }
}

impl<T: 'static, A, const STORE: bool, const NARROW: bool> Kernel for ExpSum<'_, T, A, STORE, NARROW> {
    type Output = f32;
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) -> f32 {
        // `x * 1` is `x`: at scale 1 (the usual call, and cross-entropy's)
        // one multiply fewer per vector, in a pass that is compute-bound.
        let (m, cutoff) = (self.m, self.cutoff);
        let exact = || Shifted { exp: ExpNonpos::new(l), m: l.splat(m) };
        let narrow = || ExpShiftedNarrow::new(l, m * LOG2E, cutoff);
        match (self.scale == 1.0, NARROW) {
            (true, false) => self.exp_sum::<L, false, _>(l, exact()),
            (false, false) => self.exp_sum::<L, true, _>(l, exact()),
            (true, true) => self.exp_sum::<L, false, _>(l, narrow()),
            (false, true) => self.exp_sum::<L, true, _>(l, narrow()),
        }
    }
}

/// `e^(v - m)` for the values `v` of a row whose maximum is `m`, as the
/// `exp` pass takes it.
trait Term<L: Lanes> {
    /// On every lane.
    fn term(&self, l: L, v: L::V) -> L::V;
}

/// For f32 results: [`crate::math::exp_nonpos_f32`] of `v - m`.
struct Shifted<V> {
    exp: ExpNonpos<V>,
    m: V,
}

impl<L: Lanes> Term<L> for Shifted<L::V> {
    #[inline(always)]
    fn term(&self, l: L, v: L::V) -> L::V {
        self.exp.eval(l, l.sub(v, self.m))
    }
}

impl<L: Lanes> Term<L> for ExpShiftedNarrow<L::V> {
    #[inline(always)]
    fn term(&self, l: L, v: L::V) -> L::V {
        self.eval(l, v)
    }
}

impl<T: 'static, A, const STORE: bool, const NARROW: bool> ExpSum<'_, T, A, STORE, NARROW> {
    /// The pass with the terms `c`, multiplying by the scale first only
    /// when `SCALED`.
    #[inline(always)]
    fn exp_sum<L: Lanes, const SCALED: bool, E: Term<L>>(self, l: L, c: E) -> f32 {
        let (p, len, q, n) = (self.x, self.len, self.e, L::N);
        // Prefetches go by 32 values (one call per 64 or 128 bytes of `x`,
        // whatever the width), as the lane loop's.
        const PART: usize = 32;
        let s = l.splat(self.scale);
        let arg = |v| if SCALED { l.mul(v, s) } else { v };
        // Two accumulators with AVX-512's 32 registers; one with AVX2's 16,
        // where the ten constants, the scale and the maximum leave no room
        // for a second (it was spilled, and reloaded on every step).
        let u = if L::REGS >= 32 { 2 } else { 1 };
        let mut acc = [l.splat(0.0); 2];
        let mut at = 0;
        // SAFETY (loads, stores): `at + u n <= len` in the first loop; then
        // whole vectors while they fit, then the `len - at < n` values left;
        // `x` holds `len` values, and so does `e` when written (`new`
        // asserts it; in place they are one row, each vector loaded before
        // its lanes are stored); `T` is f32, bf16 or f16 (the callers check).
        unsafe {
            while at + u * n <= len {
                if at % PART == 0 {
                    prefetch_part::<A, false>(self.ahead, at / PART, PART);
                    if STORE {
                        prefetch_part::<A, true>(self.ahead_w, at / PART, PART);
                    }
                }
                for (k, a) in acc.iter_mut().take(u).enumerate() {
                    let v = c.term(l, arg(l.load(p.add(at + n * k))));
                    if STORE {
                        l.store(q.add(at + n * k), v);
                    }
                    *a = l.add(*a, v);
                }
                at += u * n;
            }
            while at + n <= len {
                let v = c.term(l, arg(l.load(p.add(at))));
                if STORE {
                    l.store(q.add(at), v);
                }
                acc[1] = l.add(acc[1], v);
                at += n;
            }
            if at < len {
                let v = c.term(l, arg(l.load_part(p.add(at), len - at)));
                if STORE {
                    l.store_part(q.add(at), v, len - at);
                }
                acc[0] = l.add_part(acc[0], v, len - at);
            }
        }
        l.reduce_add(l.add(acc[0], acc[1]))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{exp_into_lanes, exp_sum_lanes, row_max_lanes};
    use super::{ExpSum, Max, ScaleBf16, WidenMax};
    use crate::element::Element;
    use crate::math::{exp_shifted_narrow_f32, LOG2E, SHIFT_FUSED_MAX};
    use crate::simd::dispatch;
    use crate::wide::is;
    use crate::wide::x86::even_odd::from_even_odd;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// The explicit passes at width `l` against the lane loops, for every
    /// length up to 100 (whole steps, part steps, a part last vector) and
    /// 4099, at offsets 0 to 2: the same maximum, the same `exp` values bit
    /// for bit, and sums within f32 accumulation error of each other; for
    /// bf16 and f16, `widen_max` and the in-place pass with the 16-bit
    /// `exp` against its scalar function.
    fn check<T: Element<Acc = f32>, L: Width>(l: L) {
        let data: Vec<T> = (0..4200).map(|i| T::from_f64(((i * 53 % 199) as f64 - 99.0) / 9.0)).collect();
        let (mut e, mut e_ref) = (vec![0f32; 4200], vec![0f32; 4200]);
        for off in 0..3 {
            for n in (0..=100).chain([4099]) {
                let x = &data[off..off + n];
                for scale in [1.0f32, 0.37, -0.75] {
                    let m = run_with(l, Max { x, scale });
                    assert_eq!(m, dispatch(|| row_max_lanes(x, scale)), "{} n={n} off={off}", T::NAME);
                    let (e, e_ref) = (&mut e[..n], &mut e_ref[..n]);
                    let none: &[T] = &[];
                    let s = run_with(l, ExpSum::<T, T, true>::new(x, &mut *e, (scale, m), (none, none)));
                    let s_ref = dispatch(|| exp_into_lanes(x, e_ref, scale, m, &[], &[]));
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(e), bits(e_ref), "{} n={n} off={off} scale={scale}", T::NAME);
                    let tol = 1e-6 * s_ref.abs() * (n as f32).sqrt().max(1.0);
                    assert!((s - s_ref).abs() <= tol, "{} n={n}: sum {s} vs {s_ref}", T::NAME);
                    let s2 = run_with(l, ExpSum::<T, T, false>::new(x, &mut [], (scale, m), (none, none)));
                    assert_eq!(s2, s, "{} n={n}: exp_sum without the store", T::NAME);
                    assert!((s2 - dispatch(|| exp_sum_lanes(x, scale, m, &[]))).abs() <= tol);
                    // bf16 and f16: widened once (the same maximum), then
                    // the 16-bit `exp` in place: its scalar values bit for
                    // bit, and a sum within its error of the f32 one.
                    if !is::<T, f32>() {
                        let mut w = vec![0f32; n];
                        let (mw, g) = run_with(l, WidenMax { x, w: &mut w, scale });
                        assert_eq!(mw, m, "{} n={n}: widen_max", T::NAME);
                        let even_odd = is::<T, bf16>() && !L::ROUNDS_BF16;
                        assert_eq!(g, if even_odd { 2 * L::N } else { 0 }, "{} n={n}: groups", T::NAME);
                        let s3 = run_with(l, ExpSum::<f32, T, true, true>::in_place(&mut w, mw, (none, none)));
                        // bf16 on AVX2: `y` stored back in place from the
                        // groups in the even/odd order, `from_acc` bit for bit.
                        if even_odd && n > 0 {
                            let mut y = vec![bf16::ZERO; n];
                            let inv = 1.0 / s3;
                            assert!(run_with(l, ScaleBf16::<false> { e: &w, scale: inv, shift: 0.0, y: &mut y, g }));
                            from_even_odd(&mut w, g);
                            let want: Vec<u16> = w.iter().map(|&v| bf16::from_acc(v * inv).to_bits()).collect();
                            assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "n={n} off={off}: y");
                        }
                        let cut = super::narrow_cutoff(n);
                        let narrow = |v: f32| exp_shifted_narrow_f32(v, m * LOG2E, cut);
                        let want: Vec<f32> = x.iter().map(|v| narrow(v.to_acc() * scale)).collect();
                        assert_eq!(bits(&w), bits(&want), "{} n={n} off={off} scale={scale}: in place", T::NAME);
                        // The fit (2.7e-6), the rounding of each `t` (here
                        // |t| < 48: 2.9e-6) and of `m log2 e` (|m| < 12:
                        // 0.7e-6), relative.
                        assert!((s3 - s).abs() <= 6.3e-6 * s + tol, "{} n={n}: in-place sum {s3} vs {s}", T::NAME);
                    }
                }
            }
        }
    }

    /// bf16 rows with maxima near and past `SHIFT_FUSED_MAX` (up to bf16's
    /// largest): the in-place pass gives the reference's values bit for bit
    /// (past it, of `x - m` against a maximum of 0), the largest term 1 to
    /// within 2^-8 and no `inf` or NaN; a row with `+inf` sums to NaN.
    fn far_rows<L: Width>(l: L) {
        let offsets: Vec<f32> = (0..77).map(|i| -((i * 37 % 101) as f32) / 7.0).collect();
        for m in [60000.0f32, -65536.0, 65792.0, 1e5, -3e9, 1e20, -3e30, 3.3e38] {
            let x: Vec<bf16> = offsets.iter().map(|d| bf16::from_f32(m + d * m.abs().max(1.0) * 1e-3)).collect();
            let mut w = vec![0f32; x.len()];
            let (mw, g) = run_with(l, WidenMax { x: &x, w: &mut w, scale: 1.0 });
            let cut = super::narrow_cutoff(x.len());
            // Past `SHIFT_FUSED_MAX`: of `x - m`, against a maximum of 0.
            let term = |v: f32| {
                if mw.abs() <= SHIFT_FUSED_MAX {
                    exp_shifted_narrow_f32(v, mw * LOG2E, cut)
                } else {
                    exp_shifted_narrow_f32(v - mw, 0.0, cut)
                }
            };
            let want: Vec<f32> = x.iter().map(|v| term(v.to_f32())).collect();
            let none: &[bf16] = &[];
            let s = run_with(l, ExpSum::<f32, bf16, true, true>::in_place(&mut w, mw, (none, none)));
            from_even_odd(&mut w, g);
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&w), bits(&want), "m={m}");
            let top = w.iter().copied().fold(0f32, f32::max);
            assert!((top - 1.0).abs() <= 2f32.powi(-8), "m={m}: largest term {top}");
            assert!(s.is_finite() && s >= top, "m={m}: sum {s}");
        }
        let mut x = vec![bf16::from_f32(1e30); 40];
        x[17] = bf16::INFINITY;
        let mut w = vec![0f32; x.len()];
        let (mw, _) = run_with(l, WidenMax { x: &x, w: &mut w, scale: 1.0 });
        let none: &[bf16] = &[];
        assert!(run_with(l, ExpSum::<f32, bf16, true, true>::in_place(&mut w, mw, (none, none))).is_nan());
    }

    /// NaN is skipped by the maximum (in whole steps and in the part tail)
    /// and comes out of `exp`; a row of `-inf` has maximum `-inf`, and an
    /// empty row too.
    fn specials<L: Width>(l: L) {
        for n in [5usize, 64, 70] {
            for at in [0, n - 1] {
                let mut x = vec![1.0f32; n];
                x[at] = f32::NAN;
                x[n / 2] = 3.0;
                let m = run_with(l, Max { x: &x, scale: 1.0 });
                assert_eq!(m, if n / 2 == at { 1.0 } else { 3.0 }, "n={n} at={at}");
                let mut e = vec![0f32; n];
                let none: &[f32] = &[];
                let s = run_with(l, ExpSum::<f32, f32, true>::new(&x, &mut e, (1.0, m), (none, none)));
                assert!(s.is_nan() && e[at].is_nan(), "n={n} at={at}");
            }
        }
        let x = vec![f32::NEG_INFINITY; 20];
        assert_eq!(run_with(l, Max { x: &x, scale: 1.0 }), f32::NEG_INFINITY);
        assert_eq!(run_with(l, Max::<f32> { x: &[], scale: 1.0 }), f32::NEG_INFINITY);
    }

    /// After the in-place pass, no term divided by the sum is an f32
    /// subnormal, even at the worst: every other value at the maximum (the
    /// largest sum) and one whose `t` is at the cutoff or a few steps either
    /// side of it (the smallest term), at several row lengths; a `t` below
    /// gives 0; and `scale_bf16` then rounds as `from_acc`.
    fn narrow_products<L: Width>(l: L) {
        for n in [1usize, 2, 33, 100, 4096, 70_000] {
            let cut = super::narrow_cutoff(n);
            let at_cut = cut / LOG2E;
            let near = (-3..=3).map(|k: i32| f32::from_bits((at_cut.to_bits() as i32 + k) as u32));
            for tail in near.chain([at_cut + 0.5, at_cut - 0.5, -200.0]) {
                let mut e = vec![0.0f32; n];
                e[n - 1] = if n > 1 { tail } else { 0.0 };
                let none: &[bf16] = &[];
                let s = run_with(l, ExpSum::<f32, bf16, true, true>::in_place(&mut e, 0.0, (none, none)));
                let inv = 1.0 / s;
                for (i, &v) in e.iter().enumerate() {
                    let y = v * inv;
                    assert!(y == 0.0 || y >= f32::MIN_POSITIVE, "n={n} tail={tail} i={i}: {v} / {s} = {y:e}");
                }
                if n > 1 {
                    // `t` as the pass makes it (`m log2 e` is 0 here).
                    let below = tail.mul_add(LOG2E, -0.0) < cut;
                    assert_eq!(e[n - 1] == 0.0, below, "n={n} tail={tail}: 0 exactly below the cutoff");
                }
                let mut y = vec![bf16::ZERO; n];
                if run_with(l, ScaleBf16::<false> { e: &e, scale: inv, shift: 0.0, y: &mut y, g: 0 }) {
                    let want: Vec<u16> = e.iter().map(|&v| bf16::from_acc(v * inv).to_bits()).collect();
                    assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "n={n} tail={tail}");
                }
            }
        }
        // Rounding at every position of whole pairs and the tail, values
        // spread over many binades.
        let e: Vec<f32> = (0..1000).map(|i| ((i * 7919 % 1000) as f32 / 997.0).powi(9)).collect();
        for len in [0usize, 1, 31, 32, 33, 64, 1000] {
            let mut y = vec![bf16::ZERO; len];
            if run_with(l, ScaleBf16::<false> { e: &e[..len], scale: 0.37, shift: 0.0, y: &mut y, g: 0 }) {
                let want: Vec<u16> = e[..len].iter().map(|&v| bf16::from_acc(v * 0.37).to_bits()).collect();
                assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "len={len}");
            }
        }
    }

    /// `scale_bf16`'s rounding at `inv` 1 (the products are the values):
    /// `from_acc` bit for bit for every bf16 exponent and sign with low
    /// halves at, around and away from the halfway point, 0 and the
    /// infinities, also where the carry makes the next binade or `inf`;
    /// where `inv` is NaN, false and nothing written, or (with the
    /// conversion instruction) NaN out.
    fn scale_rounding<L: Width>(l: L) {
        let e: Vec<f32> = (0..=0xffffu32)
            .filter(|h| h & 0x7f80 != 0 && h & 0x7fff < 0x7f80)
            .flat_map(|h| [0, 0x7fff, 0x8000, 0x8001, 0xffff].map(|lo| f32::from_bits(h << 16 | lo)))
            .chain([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE])
            .collect();
        let mut y = vec![bf16::ZERO; e.len()];
        assert!(
            run_with(l, ScaleBf16::<false> { e: &e, scale: 1.0, shift: 0.0, y: &mut y, g: 0 }),
            "every width rounds where inv is finite"
        );
        for (v, y) in e.iter().zip(&y) {
            assert_eq!(y.to_bits(), bf16::from_acc(*v).to_bits(), "{v:e} ({:#x})", v.to_bits());
        }
        let mut y = vec![bf16::ONE; 70];
        if run_with(l, ScaleBf16::<false> { e: &e[..70], scale: f32::NAN, shift: 0.0, y: &mut y, g: 0 }) {
            assert!(y.iter().all(|v| v.is_nan()));
        } else {
            assert!(y.iter().all(|&v| v == bf16::ONE), "nothing written");
        }
    }

    #[test]
    fn scale_bf16_rounds_as_from_acc_at_every_width() {
        every_width!(scale_rounding);
    }

    /// `affine_bf16`'s pass: on AVX2, `from_acc(e * scale - shift)` bit for
    /// bit, f32 subnormals included (every bf16 pattern that is not NaN,
    /// with low halves at, around and away from the halfway point, through
    /// the identity map), and for a map that moves the values, at every
    /// length about whole pairs; refused, nothing written, where `scale` or
    /// `shift` is not finite. With the conversion instruction (which would
    /// flush subnormals) always refused.
    fn affine_rounding<L: Width>(l: L) {
        let bits = |e: &[f32], map: (f32, f32)| {
            let mut y = vec![bf16::ONE; e.len()];
            let ran = run_with(l, ScaleBf16::<true> { e, scale: map.0, shift: map.1, y: &mut y, g: 0 });
            (ran, y.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
        };
        let all: Vec<f32> = (0..=0xffffu32)
            .filter(|h| h & 0x7fff <= 0x7f80)
            .flat_map(|h| [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff].map(|lo| f32::from_bits(h << 16 | lo)))
            .filter(|v| !v.is_nan())
            .collect();
        assert!(all.iter().any(|v| v.is_subnormal()) && all.iter().any(|v| v.is_infinite()));
        let spread: Vec<f32> = (0..1000).map(|i| ((i * 7919 % 1000) as f32 / 997.0).powi(9)).collect();
        let mut cases = vec![(&all[..], (1.0, 0.0))];
        cases.extend([0usize, 1, 31, 32, 33, 64, 1000].map(|n| (&spread[..n], (0.37f32, 0.0125f32))));
        for (e, map) in cases {
            let (ran, got) = bits(e, map);
            if L::ROUNDS_BF16 {
                assert!(!ran && got.iter().all(|&b| b == bf16::ONE.to_bits()), "refused, nothing written");
                continue;
            }
            assert!(ran, "AVX2 rounds where the map is finite");
            let want: Vec<u16> = e.iter().map(|&v| bf16::from_acc(v * map.0 - map.1).to_bits()).collect();
            assert_eq!(got, want, "len {} map {map:?}", e.len());
        }
        for map in [(f32::NAN, 0.0), (1.0, f32::INFINITY), (f32::INFINITY, 0.0)] {
            let (ran, got) = bits(&spread[..70], map);
            assert!(!ran && got.iter().all(|&b| b == bf16::ONE.to_bits()), "{map:?}: refused, nothing written");
        }
    }

    #[test]
    fn affine_bf16_rounds_as_from_acc_on_avx2_and_leaves_avx512_to_its_caller() {
        every_width!(affine_rounding);
    }

    #[test]
    fn narrow_products_are_normal_and_round_as_from_acc_at_every_width() {
        every_width!(narrow_products);
    }

    fn at_width<L: Width>(l: L) {
        check::<f32, L>(l);
        check::<bf16, L>(l);
        check::<f16, L>(l);
        specials(l);
        far_rows(l);
    }

    #[test]
    fn explicit_passes_match_the_lane_loops_at_every_width() {
        every_width!(at_width);
    }

    /// No explicit code for f64: the callers take the lane loops.
    #[test]
    fn f64_has_no_explicit_code() {
        assert!(super::row_max::<f64>(&[1.0], 1.0).is_none());
        assert!(super::exp_sum::<f64, false>(&[1.0], &mut [], (1.0, 1.0), &[], &[]).is_none());
    }
}
