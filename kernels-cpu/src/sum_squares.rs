//! `sum(x_i^2)` over a row (rms_norm's reduction), written with explicit
//! AVX-512 or AVX2 code where the CPU has either ([`crate::wide`]).
//!
//! The other reductions leave vectorisation to LLVM (lane arrays in
//! [`crate::simd`]). For this one that proved unstable: the same source gave
//! full-width code in one build and scalar or two-lane code in another, the
//! outcome changing with unrelated edits elsewhere in the crate and even with
//! the directory the crate was built in (rms_norm bf16 forward, 4096x4096,
//! one source: 1.8 ms built in one checkout, 2.5-3.3 ms in another). Here the
//! vector code is explicit, so every build runs the same instructions.
//!
//! Order of the sum: four vector accumulators (16 or 8 lanes) with fused
//! multiply-adds over groups of four vectors, then the whole vectors left,
//! then a part vector, then a tree over the lanes. The
//! fallback ([`sum_map`]) sums the same squares in another order; both are
//! within f32 accumulation error of the exact sum, as the tests check.
use crate::element::Element;
use crate::simd::sum_map;
use half::{bf16, f16};

/// The lane loop, for types without explicit code (f64) and CPUs with
/// neither AVX-512 nor AVX2.
#[inline(always)]
pub(crate) fn generic<T: Element>(x: &[T]) -> T::Acc {
    sum_map(x, |a| a * a)
}

/// Defines `$name(x: &[$t]) -> f32`, the explicit code where the CPU has
/// some (see [`crate::wide`]).
macro_rules! explicit {
    ($name:ident, $t:ty) => {
        /// `sum(x_i^2)` in f32: explicit AVX-512 or AVX2 where the CPU has
        /// it, else [`generic`].
        #[inline(always)]
        pub(crate) fn $name(x: &[$t]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            if let Some(s) = crate::wide::x86::run(x86::SumSq(x)) {
                return s;
            }
            generic(x)
        }
    };
}

explicit!(f32s, f32);
explicit!(bf16s, bf16);
explicit!(f16s, f16);

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use crate::wide::x86::{Kernel, Lanes};

    /// `sum(x_i^2)` for `T` in f32, bf16, f16 (the macro's types).
    pub(crate) struct SumSq<'a, T>(pub(crate) &'a [T]);

    impl<T: 'static> Kernel for SumSq<'_, T> {
        type Output = f32;
        #[inline(always)]
        fn run<L: Lanes>(self, l: L) -> f32 {
            let (x, n) = (self.0, L::N);
            let p = x.as_ptr();
            let mut acc = [l.splat(0.0); 4];
            let mut at = 0;
            // SAFETY (all loads): `at + n * k + n <= x.len()` in the first
            // loop; the second reads `n` values while whole ones are left,
            // then the `x.len() - at < n` values left. `T` is one of the
            // types `load` reads (the macro's).
            unsafe {
                while at + 4 * n <= x.len() {
                    for (k, a) in acc.iter_mut().enumerate() {
                        let v = l.load(p.add(at + n * k));
                        *a = l.fmadd(v, v, *a);
                    }
                    at += 4 * n;
                }
                let mut k = 0;
                while at + n <= x.len() {
                    let v = l.load(p.add(at));
                    acc[k] = l.fmadd(v, v, acc[k]);
                    at += n;
                    k += 1;
                }
                if at < x.len() {
                    // The other lanes load as 0 and add 0.
                    let v = l.load_part(p.add(at), x.len() - at);
                    acc[k] = l.fmadd(v, v, acc[k]);
                }
            }
            l.reduce_add(l.add(l.add(acc[0], acc[1]), l.add(acc[2], acc[3])))
        }
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

    /// Each width the CPU has, not only the best, against the f64 sum.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_width_matches_f64() {
        use crate::wide::x86::{every_width, run_with, Width};
        fn at<L: Width>(l: L) {
            let data: Vec<bf16> = (0..300).map(|i| bf16::from_f64(((i * 37 % 101) as f64 - 50.0) / 7.0)).collect();
            let wide: Vec<f32> = data.iter().map(|v| v.to_f32()).collect();
            for n in 0..=300 {
                let want: f64 = wide[..n].iter().map(|&v| v as f64 * v as f64).sum();
                let tol = 1e-6 * want * (n as f64).sqrt().max(1.0);
                let b = run_with(l, super::x86::SumSq(&data[..n]));
                let f = run_with(l, super::x86::SumSq(&wide[..n]));
                assert!((b as f64 - want).abs() <= tol && (f as f64 - want).abs() <= tol, "n={n}: {b} {f} vs {want}");
            }
        }
        every_width!(at);
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
