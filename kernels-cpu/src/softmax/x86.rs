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
use crate::simd::prefetch_part;
use crate::wide::has_lanes;
use crate::wide::x86::math::ExpNonpos;
use crate::wide::x86::{run, Kernel, Lanes};

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
    assert!(!STORE || e.len() == x.len(), "exp_sum: e and x differ in length");
    run(ExpSum::<T, STORE> { x, e, scale, m, ahead, ahead_w })
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
            max_of::<L, T, false>(l, self.x, 1.0) * self.scale
        } else {
            max_of::<L, T, true>(l, self.x, self.scale)
        }
    }
}

/// `max(x_i * scale)`, or `max(x_i)` when not `SCALED`.
#[inline(always)]
fn max_of<L: Lanes, T: 'static, const SCALED: bool>(l: L, x: &[T], scale: f32) -> f32 {
    let (p, len, n) = (x.as_ptr(), x.len(), L::N);
    let s = l.splat(scale);
    let scaled = |v| if SCALED { l.mul(v, s) } else { v };
    let mut m = [l.splat(f32::NEG_INFINITY); 4];
    let mut at = 0;
    // `vmaxps` gives its second operand when either is NaN: `max(v, m)`
    // keeps `m` where `v` is NaN, so no lane of `m` is ever NaN.
    // SAFETY (loads): `at + n k + n <= len` in the first loop; the second
    // reads whole vectors while they fit, then the `len - at < n` values
    // left; `T` is f32, bf16 or f16 (checked by the callers).
    unsafe {
        while at + 4 * n <= len {
            // In any order: the maximum does not depend on it.
            let (a, b) = l.load_pair_unordered(p.add(at));
            let (c, d) = l.load_pair_unordered(p.add(at + 2 * n));
            for (m, v) in m.iter_mut().zip([a, b, c, d]) {
                *m = l.max(scaled(v), *m);
            }
            at += 4 * n;
        }
        while at + n <= len {
            m[1] = l.max(scaled(l.load(p.add(at))), m[1]);
            at += n;
        }
        if at < len {
            m[0] = l.max_part(m[0], scaled(l.load_part(p.add(at), len - at)), len - at);
        }
    }
    l.reduce_max(l.max(l.max(m[0], m[1]), l.max(m[2], m[3])))
}

/// The `exp` pass, storing each value when `STORE`.
pub(super) struct ExpSum<'a, T, const STORE: bool> {
    pub(super) x: &'a [T],
    /// As long as `x` when `STORE`.
    pub(super) e: &'a mut [f32],
    pub(super) scale: f32,
    pub(super) m: f32,
    pub(super) ahead: &'a [T],
    pub(super) ahead_w: &'a [T],
}

impl<T: 'static, const STORE: bool> Kernel for ExpSum<'_, T, STORE> {
    type Output = f32;
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) -> f32 {
        // `x * 1` is `x`: at scale 1 (the usual call, and cross-entropy's)
        // one multiply fewer per vector, in a pass that is compute-bound.
        if self.scale == 1.0 {
            self.exp_sum::<L, false>(l)
        } else {
            self.exp_sum::<L, true>(l)
        }
    }
}

impl<T: 'static, const STORE: bool> ExpSum<'_, T, STORE> {
    /// The pass, multiplying by the scale only when `SCALED`.
    #[inline(always)]
    fn exp_sum<L: Lanes, const SCALED: bool>(self, l: L) -> f32 {
        let (p, len, q, n) = (self.x.as_ptr(), self.x.len(), self.e.as_mut_ptr(), L::N);
        // Prefetches go by 32 values (one call per 64 or 128 bytes of `x`,
        // whatever the width), as the lane loop's.
        const PART: usize = 32;
        let (s, mv) = (l.splat(self.scale), l.splat(self.m));
        let arg = |v| l.sub(if SCALED { l.mul(v, s) } else { v }, mv);
        let c = ExpNonpos::new(l);
        // Two accumulators with AVX-512's 32 registers; one with AVX2's 16,
        // where the ten constants, the scale and the maximum leave no room
        // for a second (it was spilled, and reloaded on every step).
        let u = if L::REGS >= 32 { 2 } else { 1 };
        let mut acc = [l.splat(0.0); 2];
        let mut at = 0;
        // SAFETY (loads, stores): `at + u n <= len` in the first loop; then
        // whole vectors while they fit, then the `len - at < n` values left;
        // `e` is as long as `x` when written (`exp_sum` asserts it); `T` is
        // f32, bf16 or f16 (checked by the callers).
        unsafe {
            while at + u * n <= len {
                if at % PART == 0 {
                    prefetch_part::<T, false>(self.ahead, at / PART, PART);
                    if STORE {
                        prefetch_part::<T, true>(self.ahead_w, at / PART, PART);
                    }
                }
                for (k, a) in acc.iter_mut().take(u).enumerate() {
                    let v = c.eval(l, arg(l.load(p.add(at + n * k))));
                    if STORE {
                        l.store(q.add(at + n * k), v);
                    }
                    *a = l.add(*a, v);
                }
                at += u * n;
            }
            while at + n <= len {
                let v = c.eval(l, arg(l.load(p.add(at))));
                if STORE {
                    l.store(q.add(at), v);
                }
                acc[1] = l.add(acc[1], v);
                at += n;
            }
            if at < len {
                let v = c.eval(l, arg(l.load_part(p.add(at), len - at)));
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
    use super::{ExpSum, Max};
    use crate::element::Element;
    use crate::simd::dispatch;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// The explicit passes at width `l` against the lane loops, for every
    /// length up to 100 (whole steps, part steps, a part last vector) and
    /// 4099, at offsets 0 to 2: the same maximum, the same `exp` values bit
    /// for bit, and sums within f32 accumulation error of each other.
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
                    let s = run_with(l, ExpSum::<T, true> { x, e: &mut *e, scale, m, ahead: &[], ahead_w: &[] });
                    let s_ref = dispatch(|| exp_into_lanes(x, e_ref, scale, m, &[], &[]));
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(e), bits(e_ref), "{} n={n} off={off} scale={scale}", T::NAME);
                    let tol = 1e-6 * s_ref.abs() * (n as f32).sqrt().max(1.0);
                    assert!((s - s_ref).abs() <= tol, "{} n={n}: sum {s} vs {s_ref}", T::NAME);
                    let s2 = run_with(l, ExpSum::<T, false> { x, e: &mut [], scale, m, ahead: &[], ahead_w: &[] });
                    assert_eq!(s2, s, "{} n={n}: exp_sum without the store", T::NAME);
                    assert!((s2 - dispatch(|| exp_sum_lanes(x, scale, m, &[]))).abs() <= tol);
                }
            }
        }
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
                let s = run_with(l, ExpSum::<f32, true> { x: &x, e: &mut e, scale: 1.0, m, ahead: &[], ahead_w: &[] });
                assert!(s.is_nan() && e[at].is_nan(), "n={n} at={at}");
            }
        }
        let x = vec![f32::NEG_INFINITY; 20];
        assert_eq!(run_with(l, Max { x: &x, scale: 1.0 }), f32::NEG_INFINITY);
        assert_eq!(run_with(l, Max::<f32> { x: &[], scale: 1.0 }), f32::NEG_INFINITY);
    }

    fn at_width<L: Width>(l: L) {
        check::<f32, L>(l);
        check::<bf16, L>(l);
        check::<f16, L>(l);
        specials(l);
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
