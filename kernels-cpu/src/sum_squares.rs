//! `sum(x_i^2)` over a row (rms_norm's reduction), written with AVX-512
//! intrinsics where the CPU has them.
//!
//! The other reductions leave vectorisation to LLVM (lane arrays in
//! [`crate::simd`]). For this one that proved unstable: the same source gave
//! full-width code in one build and scalar or two-lane code in another, the
//! outcome changing with unrelated edits elsewhere in the crate and even with
//! the directory the crate was built in (rms_norm bf16 forward, 4096x4096,
//! one source: 1.8 ms built in one checkout, 2.5-3.3 ms in another). Here the
//! vector code is explicit, so every build runs the same instructions.
//!
//! Order of the sum: four 16-lane accumulators with fused multiply-adds over
//! groups of 64, a masked last group, then a tree over the lanes. The
//! fallback ([`sum_map`]) sums the same squares in another order; both are
//! within f32 accumulation error of the exact sum, as the tests check.
use crate::element::Element;
use crate::simd::sum_map;
use half::{bf16, f16};

/// The lane loop, for types without explicit code (f64) and CPUs without
/// AVX-512.
#[inline(always)]
pub(crate) fn generic<T: Element>(x: &[T]) -> T::Acc {
    sum_map(x, |a| a * a)
}

/// Defines `$name(x: &[$t]) -> f32` with the AVX-512 loader `$load`.
macro_rules! with_avx512 {
    ($name:ident, $t:ty, $load:ident) => {
        /// `sum(x_i^2)` in f32: AVX-512 where the CPU has it, else [`generic`].
        #[inline(always)]
        pub(crate) fn $name(x: &[$t]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            if crate::simd::has_v4_bf16() {
                // SAFETY: `has_v4_bf16` found AVX512F, BW and VL and FMA, the
                // features `x86::sum_sq` and the loader are compiled for; the
                // loaders read only the lanes they are given.
                return unsafe {
                    x86::sum_sq(
                        x,
                        #[inline(always)]
                        |p, n| x86::$load(p, n),
                    )
                };
            }
            generic(x)
        }
    };
}

with_avx512!(f32s, f32, load_f32);
with_avx512!(bf16s, bf16, load_bf16);
with_avx512!(f16s, f16, load_f16);

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// The mask of the first `n <= 16` lanes.
    #[inline(always)]
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    }

    /// # Safety
    /// AVX512F; `p..p + n` readable.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn load_f32(p: *const f32, n: usize) -> __m512 {
        // SAFETY: the masked load reads only the first `n` lanes.
        unsafe { _mm512_maskz_loadu_ps(lanes(n), p) }
    }

    /// bf16 to f32: the 16 bits become the high half of each lane (exact).
    ///
    /// # Safety
    /// AVX512F, BW and VL; `p..p + n` readable.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub(super) unsafe fn load_bf16(p: *const bf16, n: usize) -> __m512 {
        // SAFETY: as `load_f32`.
        let h = unsafe { _mm256_maskz_loadu_epi16(lanes(n), p.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// f16 to f32 with `vcvtph2ps` (exact).
    ///
    /// # Safety
    /// AVX512F, BW and VL; `p..p + n` readable.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    pub(super) unsafe fn load_f16(p: *const f16, n: usize) -> __m512 {
        // SAFETY: as `load_f32`.
        let h = unsafe { _mm256_maskz_loadu_epi16(lanes(n), p.cast()) };
        _mm512_cvtph_ps(h)
    }

    /// `sum(x_i^2)`, `load(p, n)` widening the first `n <= 16` values at
    /// `p` to f32 (the other lanes 0).
    ///
    /// # Safety
    /// The CPU must have the features of `load`, and `load` must read no more
    /// than the `n` values it is given.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn sum_sq<T>(x: &[T], load: impl Fn(*const T, usize) -> __m512) -> f32 {
        let p = x.as_ptr();
        let z = _mm512_setzero_ps();
        let mut acc = [z; 4];
        let mut at = 0;
        // SAFETY (all loads): `at + 16 * k + 16 <= x.len()` in the loop, and
        // the last loads read `x.len() - at` values from `at`.
        unsafe {
            while at + 64 <= x.len() {
                for (k, a) in acc.iter_mut().enumerate() {
                    let v = load(p.add(at + 16 * k), 16);
                    *a = _mm512_fmadd_ps(v, v, *a);
                }
                at += 64;
            }
            let mut k = 0;
            while at < x.len() {
                let v = load(p.add(at), x.len() - at);
                acc[k] = _mm512_fmadd_ps(v, v, acc[k]);
                at += 16;
                k += 1;
            }
        }
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(s)
    }
}

#[cfg(test)]
mod tests {
    use crate::element::Element;
    use crate::simd::dispatch;
    use half::{bf16, f16};

    /// Against the f64 sum, for every length up to 200 (whole groups of 64,
    /// partial groups, a masked last load) and a row of 4099, from an offset
    /// of 0 to 2 (unaligned loads); the bound is f32 accumulation error.
    fn check<T: Element<Acc = f32>>() {
        let data: Vec<T> = (0..4200).map(|i| T::from_f64(((i * 37 % 101) as f64 - 50.0) / 7.0)).collect();
        for off in 0..3 {
            for n in (0..=200).chain([4099]) {
                let x = &data[off..off + n];
                let got = dispatch(
                    #[inline(always)]
                    || T::sum_squares(x),
                );
                let want: f64 = x.iter().map(|v| v.to_f64() * v.to_f64()).sum();
                let tol = 1e-6 * want * (n as f64).sqrt().max(1.0);
                assert!((got as f64 - want).abs() <= tol, "{} n={n} off={off}: {got} vs {want}", T::NAME);
            }
        }
    }

    #[test]
    fn sum_squares_matches_f64() {
        check::<f32>();
        check::<bf16>();
        check::<f16>();
    }

    /// Specials reach the sum: NaN gives NaN, infinity infinity, in the
    /// masked tail as in whole groups.
    #[test]
    fn sum_squares_propagates_specials() {
        for n in [5usize, 64, 70] {
            for at in [0, n - 1] {
                let mut x = vec![1.0f32; n];
                x[at] = f32::NAN;
                assert!(f32::sum_squares(&x).is_nan(), "n={n} at={at}");
                x[at] = f32::NEG_INFINITY;
                assert_eq!(f32::sum_squares(&x), f32::INFINITY, "n={n} at={at}");
                let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                assert_eq!(bf16::sum_squares(&b), f32::INFINITY, "bf16 n={n} at={at}");
            }
        }
    }
}
