//! `exp` and `erf` for f32, written branch-free so that they vectorise
//! inside the SIMD-dispatched loops (the libm calls do not).
//!
//! Accuracy (checked by the tests below against f64 on a dense grid): `exp`
//! within 2 ulp over its range, `erf` within 5e-7 absolute. NaN in,
//! NaN out. `exp` is `+inf` from `x = 88.38` on (at `+inf` too), as IEEE
//! `expf` is once `e^x` overflows f32 at 88.72, so that `silu(-inf)` is NaN as
//! in torch and in the CUDA kernels; between 88.38 and 88.72 that is early,
//! and below -87.3 it returns 0: the activations that use it cannot tell
//! either from the true values in f32.
//!
//! The polynomials use `mul_add`: inside the SIMD-dispatched loops (AVX2+FMA,
//! AVX-512, NEON) each step is one fused multiply-add instead of a multiply
//! and an add (Rust does not contract `a * b + c` by itself). On an x86 CPU
//! without FMA (before 2013) pulp runs the scalar path, where `mul_add` is a
//! correct but slow library call.

pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so that `x - n ln2` is exact for the `n` that occur.
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding it rounds an f32 below 2^22 to an integer (ties to even)
/// and leaves that integer in the low mantissa bits.
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0;
/// Range of [`exp_f32`]: 0 below `EXP_LO`, its input clamped to both.
pub(crate) const EXP_LO: f32 = -87.3;
/// See [`EXP_LO`].
pub(crate) const EXP_HI: f32 = 89.0;
/// The Cephes `expf` polynomial of [`exp_f32`] on `[-ln2/2, ln2/2]`, highest
/// degree first.
pub(crate) const EXP7_C: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// `e^x`.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let flush = x < EXP_LO;
    // From 88.38 on, n = 128 below and 2^n's exponent field is all ones:
    // +inf, with no select (one cost silu's backward 15%).
    let x = x.clamp(EXP_LO, EXP_HI);
    let t = x.mul_add(LOG2E, ROUND_MAGIC);
    let n = t - ROUND_MAGIC;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let c = EXP7_C;
    let mut p = c[0];
    p = p.mul_add(r, c[1]);
    p = p.mul_add(r, c[2]);
    p = p.mul_add(r, c[3]);
    p = p.mul_add(r, c[4]);
    p = p.mul_add(r, c[5]);
    let y = (p * r).mul_add(r, r) + 1.0;
    // 2^n from the integer left in t's mantissa.
    let n_int = t.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()) as i32;
    let v = y * f32::from_bits(((n_int + 127) as u32) << 23);
    if flush {
        0.0
    } else {
        v
    }
}

/// Below this, `e^x` is an f32 subnormal (`-126 ln 2`); [`exp_nonpos_f32`]
/// returns 0 there.
pub(crate) const NORMAL_CUTOFF: f32 = -87.336_54;
/// 1.5 * 2^23 + 127: adding it rounds to an integer `k` and leaves `k + 127`
/// (the biased exponent of `2^k`) in the low mantissa bits.
pub(crate) const ROUND_MAGIC_BIASED: f32 = 12_583_039.0;
/// Minimax coefficients (relative error 8.4e-8 in exact arithmetic) of
/// `e^t ~ 1 + t (C1 + t (C2 + t (C3 + t (C4 + t C5))))` on `[-ln2/2, ln2/2]`,
/// fitted for Keel by linear programming on 20001 points and rounded to f32.
pub(crate) const EXP_C: [f32; 5] = [0.999_999_76, 0.499_991_45, 0.166_676_54, 0.041_898_746, 0.008_286_256];

/// `e^x` for `x <= 0` (and NaN, which it returns): the `exp` of softmax and
/// cross-entropy after the row maximum is subtracted. A degree-5 polynomial
/// where [`exp_f32`]'s is degree 7, and no clamping: about 14 vector
/// instructions per 16 values against 23. Within 2.2 ulp of `e^x` down to
/// `-87.34` (checked once over every f32 there; the test samples 5 million
/// points against 3 ulp), 0 below (where `e^x` is subnormal, under
/// `1.2e-38`) and at `-inf`.
///
/// Positive `x` below 88 still gets `e^x` within 3 ulp, but the function is
/// not meant for them; from 88.7 on the result is garbage.
#[inline(always)]
pub(crate) fn exp_nonpos_f32(x: f32) -> f32 {
    let k = x.mul_add(LOG2E, ROUND_MAGIC_BIASED);
    // 2^round(x log2 e): the biased exponent moved into place.
    let s = f32::from_bits(k.to_bits() << 23);
    let n = k - ROUND_MAGIC_BIASED;
    let t = n.mul_add(-LN2_HI, x);
    let t = n.mul_add(-LN2_LO, t);
    let mut p = EXP_C[4].mul_add(t, EXP_C[3]);
    p = p.mul_add(t, EXP_C[2]);
    p = p.mul_add(t, EXP_C[1]);
    p = p.mul_add(t, EXP_C[0]);
    // `(1 + t p) 2^n`: the sum rounded once, then scaled exactly (`s` is a
    // normal power of two from the cutoff up), so that AVX-512 can scale
    // with one `vscalefps` (`wide::x86::Lanes::mul_pow2`). The same value
    // as `(t s) p + s` wherever `t s` is exact.
    let v = t.mul_add(p, 1.0) * s;
    if x < NORMAL_CUTOFF {
        0.0
    } else {
        v
    }
}

/// Minimax coefficients (relative error 2.8e-6 in exact arithmetic) of
/// `e^t ~ 1 + t (C1 + t (C2 + t (C3 + t C4)))` on `[-ln2/2, ln2/2]`, fitted
/// for Keel (Lawson's iteration on 20001 points) and rounded to f32.
pub(crate) const EXP4_C: [f32; 4] = [0.999_966_86, 0.500_030_16, 0.167_874_75, 0.041_513_857];

/// [`exp_nonpos_f32`] for results that are then rounded to 16 bits (bf16 or
/// f16): a degree-4 polynomial, and `x - n ln 2` with one constant
/// (one fused multiply-add, where the f32-accurate version splits `ln 2` in
/// two), so two vector instructions fewer per 16 values. Within 3.2e-6 of
/// `e^x`, relative, down to `-87.34` (the test samples 5 million points),
/// 0 below and at `-inf`, NaN for NaN; `x <= 0` only.
///
/// 3.2e-6 is 1/600 of bf16's rounding step and 1/150 of f16's: outputs
/// stay within one unit in the last place, and round as the exact value
/// would in all but ~0.3% (bf16) or ~1.3% (f16) of them. PyTorch's CPU
/// kernels make the same trade (`Vectorized<float>::fexp_u20`, "for cases
/// where outputs will be downcasted to FP16 / BF16").
///
/// gelu's backward pdf takes it: the explicit code on x86
/// (`wide::x86::math::ExpNonposNarrow`, which the tests hold to this bit
/// for bit), the lane loop through `Acc::exp_nonpos_narrow`. Softmax's bf16
/// and f16 rows on x86 take [`exp_shifted_narrow_f32`], faster for the
/// same accuracy where the argument is `x - max`.
#[inline(always)]
pub(crate) fn exp_nonpos_narrow_f32(x: f32) -> f32 {
    let v = exp4(x);
    if x < NORMAL_CUTOFF {
        0.0
    } else {
        v
    }
}

/// `e^x` for any `x`, for a sigmoid `1 / (1 + e^x)` whose result is then
/// rounded to 16 bits (the gated activations' bf16 and f16): the reduction
/// and degree-4 polynomial of [`exp_nonpos_narrow_f32`], with `x` clamped
/// to `[NORMAL_CUTOFF, EXP_HI]` (NaN stays NaN) instead of flushed, four
/// vector instructions fewer per 16 values than [`exp_f32`]'s.
///
/// - Within 3.2e-6 of `e^x`, relative, on `[-87.33, 88.37]` (the test
///   samples every part of it).
/// - Below -87.34 it returns `e^-87.34` (1.2e-38), not less: `1 +` that
///   is 1, as `1 +` the true value is, in f32.
/// - `+inf` from 88.38 on (the clamp's `2^n` is `2^128`, the bits of
///   `+inf`), as [`exp_f32`]: `silu(-inf)` and `gelu_tanh(-inf)` stay NaN.
///
/// The explicit code (`wide::x86::math::ExpNarrow`) gives these values bit
/// for bit at every width (the tests compare them).
#[inline(always)]
pub(crate) fn exp_narrow_f32(x: f32) -> f32 {
    exp4(x.clamp(NORMAL_CUTOFF, EXP_HI))
}

/// The degree-4 `e^x` of the two narrow functions, unguarded: with `x =
/// n ln 2 + t` (one constant), `(1 + t p(t)) 2^n`, where `2^n` comes from
/// the bits of `n + 127` (exact for `n` in -126..=127, `+inf` at 128).
#[inline(always)]
fn exp4(x: f32) -> f32 {
    let k = x.mul_add(LOG2E, ROUND_MAGIC_BIASED);
    let s = f32::from_bits(k.to_bits() << 23);
    let n = k - ROUND_MAGIC_BIASED;
    let t = n.mul_add(-std::f32::consts::LN_2, x);
    let mut p = EXP4_C[3].mul_add(t, EXP4_C[2]);
    p = p.mul_add(t, EXP4_C[1]);
    p = p.mul_add(t, EXP4_C[0]);
    t.mul_add(p, 1.0) * s
}

/// Minimax coefficients (relative error 2.6e-6 in exact arithmetic, 2.7e-6
/// in f32) of `2^f ~ C0 + f (C1 + f (C2 + f (C3 + f C4)))` on `[0, 1]`,
/// fitted for Keel (Lawson's iteration on 20001 points) and rounded to f32.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const EXP2_C: [f32; 5] = [1.000_002_6, 0.693_003_83, 0.241_442_74, 0.052_011_468, 0.013_534_171];

/// The largest row maximum `|m|` whose `m log2(e)` [`exp_shifted_narrow_f32`]
/// may take rounded (to within 2^-8 in `t`); softmax moves rows past it
/// to a maximum of 0 first (every f16 row is within it).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const SHIFT_FUSED_MAX: f32 = 65536.0;

/// `e^(x - m)` for `x <= m` as softmax's bf16 and f16 rows on x86 take it
/// (`wide::x86::math::ExpShiftedNarrow` gives these values bit for bit at
/// every width; this is the tests' reference): `2^t` with
/// `t = x log2(e) - m_log2e` in one fused multiply-add, where `m_log2e` is
/// `m log2(e)` rounded once for the row, and 0 where `t < cutoff` (NaN
/// stays NaN).
///
/// - `2^t = 2^floor(t) p(t - floor(t))`, `p` the degree-4 [`EXP2_C`], with
///   no `ln 2` constants, and `2^floor(t)` by one `vscalefps` on AVX-512.
///   Within 2.7e-6 of `2^t`, relative; `cutoff` must be at least -126, so
///   that every result kept is a normal f32 (exact scaling at every width).
/// - `t` is rounded once: `|t| 2^-24` more, relative (1e-6 at `t = -17`,
///   where the term is 1e-5 of the largest).
/// - The rounding of `m log2(e)` shifts every `t` of the row alike, which
///   the division by the sum takes out, but only while it is small: for
///   `|m|` up to [`SHIFT_FUSED_MAX`] it is under 2^-8 (past about 2^24 it
///   would be more than 1, and the largest term could be `+inf`).
///
/// Against [`exp_nonpos_narrow_f32`] of `x - m`: one vector instruction
/// fewer per 16 values on AVX-512 (12 in the loop with its load, store and
/// sum, from 13; the chain from load to result one shorter), as many with
/// AVX2, and softmax's `exp` pass measured 13% and 9% faster; as accurate
/// for the terms that make up a softmax.
#[cfg(test)]
pub(crate) fn exp_shifted_narrow_f32(x: f32, m_log2e: f32, cutoff: f32) -> f32 {
    let t = x.mul_add(LOG2E, -m_log2e);
    if t < cutoff {
        return 0.0;
    }
    let n = t.floor();
    let f = t - n;
    let mut p = EXP2_C[4].mul_add(f, EXP2_C[3]);
    for c in EXP2_C[..3].iter().rev() {
        p = p.mul_add(f, *c);
    }
    // 2^n from its bits; NaN's `n as i32` is 0, and `p` is NaN anyway.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `erf(x)` is exactly `±1` in f32 from `|x|` = this on.
pub(crate) const ERF_ONE_FROM: f32 = 3.92;
/// The numerator of [`erf_f32`]'s rational function, a polynomial in `x^2`
/// (times `x`), highest degree first.
pub(crate) const ERF_P: [f32; 7] =
    [-2.726_142_3e-10, 2.770_681_4e-8, -2.101_024e-6, -5.692_506_4e-5, -7.349_906e-4, -2.954_600_2e-3, -1.609_603_3e-2];
/// The denominator of [`erf_f32`]'s rational function, highest degree first.
pub(crate) const ERF_Q: [f32; 5] = [-1.456_607_2e-5, -2.133_740_6e-4, -1.682_827e-3, -7.373_329e-3, -1.426_474e-2];

/// `erf(x)`: a rational approximation (the one Eigen and XLA use on [-4,
/// 4]) below |x| = 3.92, and exactly `±1` from there on, where erf rounds
/// to ±1 in f32 (so gelu of a very negative input is exactly 0, as in
/// torch). The rational function is not clamped first: where its terms
/// overflow, |x| is past 3.92 and the result is `±1` anyway (two vector
/// instructions fewer per 16 values than with the clamp, same values).
#[inline(always)]
pub(crate) fn erf_f32(x: f32) -> f32 {
    let big = x.abs() >= ERF_ONE_FROM;
    let sign = 1f32.copysign(x);
    let x2 = x * x;
    let mut p = ERF_P[0];
    for c in &ERF_P[1..] {
        p = p.mul_add(x2, *c);
    }
    let mut q = ERF_Q[0];
    for c in &ERF_Q[1..] {
        q = q.mul_add(x2, *c);
    }
    if big {
        sign
    } else {
        x * p / q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CUDA's `erf_fast` (kernels-cuda/gated.cu, for f16 and bf16 gelu)
    /// repeats [`erf_f32`]'s constants, which CUDA C++ cannot take from
    /// here: its float literals, in order, must be these, bit for bit (a
    /// drift would otherwise show only within the emulated test's tolerance).
    #[test]
    fn cuda_erf_fast_repeats_these_constants() {
        let cu = include_str!("../../kernels-cuda/gated.cu");
        let body = cu.split("float erf_fast(float x) {").nth(1).expect("gated.cu defines erf_fast");
        let body = body.split("\n}").next().unwrap();
        let literals: Vec<f32> = body
            .split(|c: char| !(c.is_ascii_alphanumeric() || "._-".contains(c)))
            .filter_map(|w| w.strip_suffix('f')?.parse().ok())
            .collect();
        let want: Vec<f32> = [-4.0, 4.0].into_iter().chain(ERF_P).chain(ERF_Q).chain([ERF_ONE_FROM, 1.0]).collect();
        assert_eq!(
            literals.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "erf_fast: {literals:?}, want {want:?}"
        );
    }

    fn grid() -> impl Iterator<Item = f32> {
        (-200_000..=200_000).map(|i| i as f32 * 1e-4)
    }

    #[test]
    fn exp_is_within_two_ulp() {
        for x in grid().map(|x| x * 4.35).filter(|x| (-87.0..=88.0).contains(x)) {
            let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
            let ulp = f32::EPSILON as f64 * want;
            assert!((got - want).abs() <= 2.0 * ulp, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!((exp_f32(1000.0), exp_f32(f32::INFINITY)), (f32::INFINITY, f32::INFINITY));
        assert!(exp_f32(88.37).is_finite() && exp_f32(88.38).is_infinite());
        assert_eq!((exp_f32(-1000.0), exp_f32(f32::NEG_INFINITY)), (0.0, 0.0));
    }

    /// Largest error of `f` against `e^x` in units of the f32 ulp at `e^x`,
    /// over `n` evenly spaced points of `[lo, hi]`.
    fn worst_ulp(f: impl Fn(f32) -> f32, lo: f64, hi: f64, n: u32) -> f64 {
        let mut worst = 0f64;
        for i in 0..=n {
            let x = (lo + (hi - lo) * i as f64 / n as f64) as f32;
            let want = (x as f64).exp();
            let ulp = 2f64.powi((want.log2().floor() as i32).max(-126) - 23);
            worst = worst.max((f(x) as f64 - want).abs() / ulp);
        }
        worst
    }

    #[test]
    fn exp_nonpos_is_within_three_ulp() {
        let worst = worst_ulp(exp_nonpos_f32, NORMAL_CUTOFF as f64, 0.0, 4_000_000);
        println!("exp_nonpos: worst {worst:.2} ulp on [{NORMAL_CUTOFF}, 0]");
        assert!(worst <= 3.0, "{worst} ulp");
        // Near 0 (where softmax's largest terms are) the grid is finer.
        assert!(worst_ulp(exp_nonpos_f32, -1.0, 0.0, 1_000_000) <= 3.0);
        assert_eq!(exp_nonpos_f32(0.0), 1.0);
        assert_eq!(exp_nonpos_f32(-0.0), 1.0);
        assert!(exp_nonpos_f32(f32::NAN).is_nan());
        for x in [f32::NEG_INFINITY, -1e30, -104.0, -87.34, f32::MIN] {
            assert_eq!(exp_nonpos_f32(x), 0.0, "exp({x})");
        }
        // Normal results just above the cutoff, not flushed.
        assert!(exp_nonpos_f32(-87.33) > 0.0);
    }

    /// Largest relative error of `f` against `e^x` over `n` evenly spaced
    /// points of `[lo, hi]`.
    fn worst_rel(f: impl Fn(f32) -> f32, lo: f64, hi: f64, n: u32) -> f64 {
        let mut worst = 0f64;
        for i in 0..=n {
            let x = (lo + (hi - lo) * i as f64 / n as f64) as f32;
            let want = (x as f64).exp();
            worst = worst.max((f(x) as f64 / want - 1.0).abs());
        }
        worst
    }

    #[test]
    fn exp_nonpos_narrow_is_within_3_2e_6() {
        let f = exp_nonpos_narrow_f32;
        let worst = worst_rel(f, NORMAL_CUTOFF as f64, 0.0, 4_000_000).max(worst_rel(f, -1.0, 0.0, 1_000_000));
        println!("exp_nonpos_narrow: worst relative error {worst:.3e} on [{NORMAL_CUTOFF}, 0]");
        assert!(worst <= 3.2e-6, "{worst}");
        // Coarser than the f32 one, but not by more than the fit allows.
        assert!(worst >= 1e-6, "{worst}: the test no longer measures the degree-4 fit");
        assert_eq!(exp_nonpos_narrow_f32(0.0), 1.0);
        assert!(exp_nonpos_narrow_f32(f32::NAN).is_nan());
        for x in [f32::NEG_INFINITY, -1e30, -104.0, -87.34] {
            assert_eq!(exp_nonpos_narrow_f32(x), 0.0, "exp({x})");
        }
        assert!(exp_nonpos_narrow_f32(-87.33) > 0.0);
    }

    #[test]
    fn exp_shifted_narrow_is_within_2_7e_6_of_exact_powers_of_two() {
        // `x = 0` makes `t = -m_log2e` exact: the polynomial and the
        // scaling alone, over every binade the cutoff leaves.
        let f = |t: f32| exp_shifted_narrow_f32(0.0, -t, -126.0);
        let mut worst = 0f64;
        for i in 0..=4_000_000u32 {
            let t = (-126.0 + 126.0 * i as f64 / 4e6) as f32;
            worst = worst.max((f(t) as f64 / 2f64.powf(t as f64) - 1.0).abs());
        }
        println!("exp_shifted_narrow: worst relative error {worst:.3e} of 2^t on [-126, 0]");
        assert!(worst <= 2.7e-6, "{worst}");
        assert!(worst >= 1e-6, "{worst}: the test no longer measures the degree-4 fit");
        assert!(f(-126.0) >= f32::MIN_POSITIVE, "normal at the lowest cutoff");
        for t in [-126.001, -200.0, f32::NEG_INFINITY] {
            assert_eq!(f(t), 0.0, "2^{t}");
        }
        assert!(exp_shifted_narrow_f32(f32::NAN, 0.0, -126.0).is_nan());
        assert!(exp_shifted_narrow_f32(1.0, f32::NAN, -126.0).is_nan());
        // A row of -inf (its maximum too) is NaN, as in torch.
        let m_log2e = f32::NEG_INFINITY * LOG2E;
        assert!(exp_shifted_narrow_f32(f32::NEG_INFINITY, m_log2e, -126.0).is_nan());
    }

    /// As softmax calls it, for row maxima up to `SHIFT_FUSED_MAX`: each
    /// term over the row's largest (the ratio a softmax keeps) within the
    /// fit's error twice and the rounding of `t`, of `e^(x - m)`; the
    /// largest itself within 2^-8 of 1.
    #[test]
    fn exp_shifted_narrow_keeps_the_ratios_of_a_row() {
        for m in [0.0f32, 7.3, -250.5, 1000.25, 3.0e4, -SHIFT_FUSED_MAX, SHIFT_FUSED_MAX] {
            let m_log2e = m * LOG2E;
            let top = exp_shifted_narrow_f32(m, m_log2e, -126.0) as f64;
            assert!((top - 1.0).abs() <= 2f64.powi(-8), "m={m}: {top}");
            for i in 0..=200_000u32 {
                let x = (m as f64 - 80.0 * i as f64 / 2e5) as f32;
                let want = (x as f64 - m as f64).exp();
                let t = (x as f64 - m as f64) * std::f64::consts::LOG2_E;
                let tol = 5.4e-6 + t.abs() * 2f64.powi(-24);
                let got = exp_shifted_narrow_f32(x, m_log2e, -126.0) as f64 / top;
                assert!((got / want - 1.0).abs() <= tol, "m={m} x={x}: {got:e} vs {want:e}");
            }
        }
    }

    #[test]
    fn exp_narrow_is_within_3_2e_6() {
        // Both ends (where `n ln 2` is largest) and near 0, finer.
        let f = exp_narrow_f32;
        let worst = worst_rel(f, NORMAL_CUTOFF as f64, 88.37, 8_000_000).max(worst_rel(f, -1.0, 1.0, 1_000_000));
        println!("exp_narrow: worst relative error {worst:.3e} on [{NORMAL_CUTOFF}, 88.37]");
        assert!(worst <= 3.2e-6, "{worst}");
        assert!(worst >= 1e-6, "{worst}: the test no longer measures the degree-4 fit");
        assert_eq!(exp_narrow_f32(0.0), 1.0);
        assert!(exp_narrow_f32(f32::NAN).is_nan());
        assert!(exp_narrow_f32(88.37).is_finite() && exp_narrow_f32(88.38).is_infinite());
        for x in [88.38, 1000.0, f32::MAX, f32::INFINITY] {
            assert_eq!(exp_narrow_f32(x), f32::INFINITY, "exp({x})");
        }
        // Clamped below, not flushed: e^-87.34, the least normal f32 or
        // near it, whose `1 +` is 1.
        let floor = exp_narrow_f32(NORMAL_CUTOFF);
        assert!((f32::MIN_POSITIVE..1.2e-38).contains(&floor), "{floor:e}");
        for x in [-87.34, -104.0, -1e30, f32::MIN, f32::NEG_INFINITY] {
            assert_eq!(exp_narrow_f32(x), floor, "exp({x})");
            assert_eq!(1.0 + exp_narrow_f32(x), 1.0);
        }
    }

    #[test]
    fn erf_is_within_5e7() {
        let mut worst = 0f64;
        for x in grid() {
            worst = worst.max((erf_f32(x) as f64 - libm::erf(x as f64)).abs());
        }
        println!("max abs error of erf on [-20, 20]: {worst:e}");
        assert!(worst <= 5e-7, "erf {worst}");
        assert!(erf_f32(f32::NAN).is_nan());
        assert_eq!((erf_f32(3.92), erf_f32(-100.0)), (1.0, -1.0));
    }
}
