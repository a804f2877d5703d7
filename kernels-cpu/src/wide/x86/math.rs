//! The functions of [`crate::math`] on [`Lanes`] vectors, operation for
//! operation, so that an explicit kernel gives the lane loop's values bit
//! for bit (the tests compare every function with its scalar one at every
//! width the CPU has).
//!
//! Each holds its constants broadcast: a kernel makes one per block of rows,
//! outside its loops (left to LLVM, the lane loops broadcast them from
//! memory again on every step).
use super::Lanes;
use crate::math::{
    ERF_P, ERF_Q, EXP2_C, EXP4_C, EXP7_C, EXP_C, EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E, NORMAL_CUTOFF, ROUND_MAGIC,
    ROUND_MAGIC_BIASED,
};

/// [`crate::math::exp_f32`].
pub(crate) struct Exp<V> {
    lo: V,
    hi: V,
    log2e: V,
    magic: V,
    bias: V,
    ln2_hi: V,
    ln2_lo: V,
    c: [V; 6],
}

impl<V: Copy> Exp<V> {
    /// The constants, broadcast.
    #[inline(always)]
    pub(crate) fn new<L: Lanes<V = V>>(l: L) -> Self {
        Self {
            lo: l.splat(EXP_LO),
            hi: l.splat(EXP_HI),
            log2e: l.splat(LOG2E),
            magic: l.splat(ROUND_MAGIC),
            bias: l.splat(127.0),
            ln2_hi: l.splat(LN2_HI),
            ln2_lo: l.splat(LN2_LO),
            c: EXP7_C.map(|c| l.splat(c)),
        }
    }

    /// `exp_f32` on every lane.
    #[inline(always)]
    pub(crate) fn eval<L: Lanes<V = V>>(&self, l: L, x0: V) -> V {
        // `clamp`: the bound as the first operand, so a NaN `x0` comes
        // through both (`vmaxps`/`vminps` give the second operand then).
        let x = l.min(self.hi, l.max(self.lo, x0));
        let t = l.fmadd(x, self.log2e, self.magic);
        let n = l.sub(t, self.magic);
        // `n * -c + x` as `x - n * c`: the same value.
        let r = l.fnmadd(n, self.ln2_lo, l.fnmadd(n, self.ln2_hi, x));
        let mut p = self.c[0];
        for &c in &self.c[1..] {
            p = l.fmadd(p, r, c);
        }
        let y = l.add(l.fmadd(l.mul(p, r), r, r), l.splat(1.0));
        // 2^n: `t + 127` is exact (an integer below 2^24), and its low
        // mantissa bits hold `n + 127`, in 1..=255 after the clamp.
        let v = l.mul(y, l.shl23(l.add(t, self.bias)));
        // 0 below the range; NaN compares "not less" and stays NaN.
        l.zero_below(x0, self.lo, v)
    }
}

/// An `exp` for arguments `<= 0` on vectors ([`ExpNonpos`] or
/// [`ExpNonposNarrow`]), for the passes written once for either.
pub(crate) trait ExpNonposFn<L: Lanes> {
    /// `e^x` on every lane.
    fn eval(&self, l: L, x: L::V) -> L::V;
}

/// [`crate::math::exp_nonpos_f32`].
pub(crate) struct ExpNonpos<V> {
    log2e: V,
    magic: V,
    ln2_hi: V,
    ln2_lo: V,
    c: [V; 5],
    one: V,
    cutoff: V,
}

impl<V: Copy> ExpNonpos<V> {
    /// The constants, broadcast.
    #[inline(always)]
    pub(crate) fn new<L: Lanes<V = V>>(l: L) -> Self {
        Self {
            log2e: l.splat(LOG2E),
            magic: l.splat(ROUND_MAGIC_BIASED),
            ln2_hi: l.splat(LN2_HI),
            ln2_lo: l.splat(LN2_LO),
            c: EXP_C.map(|c| l.splat(c)),
            one: l.splat(1.0),
            cutoff: l.splat(NORMAL_CUTOFF),
        }
    }
}

/// `exp_nonpos_f32` on every lane.
impl<L: Lanes> ExpNonposFn<L> for ExpNonpos<L::V> {
    #[inline(always)]
    fn eval(&self, l: L, x: L::V) -> L::V {
        let k = l.fmadd(x, self.log2e, self.magic);
        let s = l.shl23(k);
        let n = l.sub(k, self.magic);
        // `n * -c + x` as `x - n * c`: the same value.
        let t = l.fnmadd(n, self.ln2_hi, x);
        let t = l.fnmadd(n, self.ln2_lo, t);
        let mut p = l.fmadd(self.c[4], t, self.c[3]);
        p = l.fmadd(p, t, self.c[2]);
        p = l.fmadd(p, t, self.c[1]);
        p = l.fmadd(p, t, self.c[0]);
        let v = l.mul_pow2(l.fmadd(t, p, self.one), n, s);
        // 0 below the cutoff; NaN compares "not less" and stays NaN.
        l.zero_below(x, self.cutoff, v)
    }
}

/// The degree-4 `e^x` that [`ExpNonposNarrow`] and [`ExpNarrow`] share:
/// `x = n ln 2 + t` with one constant, `e^t ~ 1 + t p(t)`.
struct Exp4<V> {
    log2e: V,
    magic: V,
    ln2: V,
    c: [V; 4],
    one: V,
}

impl<V: Copy> Exp4<V> {
    #[inline(always)]
    fn new<L: Lanes<V = V>>(l: L) -> Self {
        Self {
            log2e: l.splat(LOG2E),
            magic: l.splat(ROUND_MAGIC_BIASED),
            ln2: l.splat(std::f32::consts::LN_2),
            c: EXP4_C.map(|c| l.splat(c)),
            one: l.splat(1.0),
        }
    }

    /// `(1 + t p(t), n, 2^n)` for `x`, the parts of the scalar `exp4`; `2^n`
    /// from the bits of `n + 127` (`+inf` at `n = 128`).
    #[inline(always)]
    fn parts<L: Lanes<V = V>>(&self, l: L, x: V) -> (V, V, V) {
        let k = l.fmadd(x, self.log2e, self.magic);
        let s = l.shl23(k);
        let n = l.sub(k, self.magic);
        let t = l.fnmadd(n, self.ln2, x);
        let mut p = l.fmadd(self.c[3], t, self.c[2]);
        p = l.fmadd(p, t, self.c[1]);
        p = l.fmadd(p, t, self.c[0]);
        (l.fmadd(t, p, self.one), n, s)
    }
}

/// [`crate::math::exp_nonpos_narrow_f32`].
pub(crate) struct ExpNonposNarrow<V> {
    e: Exp4<V>,
    cutoff: V,
}

impl<V: Copy> ExpNonposNarrow<V> {
    /// The constants, broadcast, with 0 below `NORMAL_CUTOFF` (where the
    /// scaling by `2^n` stops being exact), as `exp_nonpos_narrow_f32`.
    #[inline(always)]
    pub(crate) fn new<L: Lanes<V = V>>(l: L) -> Self {
        Self { e: Exp4::new(l), cutoff: l.splat(NORMAL_CUTOFF) }
    }
}

/// `exp_nonpos_narrow_f32` on every lane.
impl<L: Lanes> ExpNonposFn<L> for ExpNonposNarrow<L::V> {
    #[inline(always)]
    fn eval(&self, l: L, x: L::V) -> L::V {
        let (y, n, s) = self.e.parts(l, x);
        let v = l.mul_pow2(y, n, s);
        // 0 below the cutoff; NaN compares "not less" and stays NaN.
        l.zero_below(x, self.cutoff, v)
    }
}

/// [`crate::math::exp_shifted_narrow_f32`]: `e^(x - m)` of softmax's bf16
/// and f16 rows, as `2^t`, `t = x log2(e) - m log2(e)`.
pub(crate) struct ExpShiftedNarrow<V> {
    log2e: V,
    /// `-m log2(e)`, rounded once.
    neg_m_log2e: V,
    cutoff: V,
    c: [V; 5],
}

impl<V: Copy> ExpShiftedNarrow<V> {
    /// The constants, broadcast, for a row whose maximum `m` has
    /// `m log2(e)` = `m_log2e`; 0 where `t < cutoff` (at least -126).
    #[inline(always)]
    pub(crate) fn new<L: Lanes<V = V>>(l: L, m_log2e: f32, cutoff: f32) -> Self {
        debug_assert!(cutoff >= -126.0);
        let (log2e, neg_m_log2e, cutoff) = (l.splat(LOG2E), l.splat(-m_log2e), l.splat(cutoff));
        Self { log2e, neg_m_log2e, cutoff, c: EXP2_C.map(|c| l.splat(c)) }
    }

    /// `exp_shifted_narrow_f32` on every lane.
    #[inline(always)]
    pub(crate) fn eval<L: Lanes<V = V>>(&self, l: L, x: V) -> V {
        let t = l.fmadd(x, self.log2e, self.neg_m_log2e);
        let f = l.frac_floor(t);
        let mut p = l.fmadd(self.c[4], f, self.c[3]);
        p = l.fmadd(p, f, self.c[2]);
        p = l.fmadd(p, f, self.c[1]);
        p = l.fmadd(p, f, self.c[0]);
        // 0 below the cutoff (and the lanes the scaling leaves undefined
        // there); NaN compares "not less" and stays NaN.
        l.zero_below(t, self.cutoff, l.mul_pow2_floor(p, t))
    }
}

/// [`crate::math::exp_narrow_f32`].
pub(crate) struct ExpNarrow<V> {
    e: Exp4<V>,
    lo: V,
    hi: V,
}

impl<V: Copy> ExpNarrow<V> {
    /// The constants, broadcast.
    #[inline(always)]
    pub(crate) fn new<L: Lanes<V = V>>(l: L) -> Self {
        Self { e: Exp4::new(l), lo: l.splat(NORMAL_CUTOFF), hi: l.splat(EXP_HI) }
    }

    /// `exp_narrow_f32` on every lane.
    #[inline(always)]
    pub(crate) fn eval<L: Lanes<V = V>>(&self, l: L, x0: V) -> V {
        // The clamp as in `Exp::eval`: a NaN comes through.
        let x = l.min(self.hi, l.max(self.lo, x0));
        let (y, _, s) = self.e.parts(l, x);
        // A multiply by `2^n`, not `mul_pow2`: at `n = 128` (from 88.38)
        // `s` is `+inf` at every width, where AVX-512's `vscalefps` would
        // give finite values up to 88.72.
        l.mul(y, s)
    }
}

/// [`crate::math::erf_f32`].
pub(crate) struct Erf<V> {
    big: V,
    one: V,
    p: [V; 7],
    q: [V; 5],
}

impl<V: Copy> Erf<V> {
    /// The constants, broadcast.
    #[inline(always)]
    pub(crate) fn new<L: Lanes<V = V>>(l: L) -> Self {
        Self {
            big: l.splat(crate::math::ERF_ONE_FROM),
            one: l.splat(1.0),
            p: ERF_P.map(|c| l.splat(c)),
            q: ERF_Q.map(|c| l.splat(c)),
        }
    }

    /// `erf_f32` on every lane.
    #[inline(always)]
    pub(crate) fn eval<L: Lanes<V = V>>(&self, l: L, x0: V) -> V {
        // Unclamped, as the scalar one: past 3.92 the select below
        // replaces whatever the rational function gave (NaN included).
        let x = x0;
        let x2 = l.mul(x, x);
        let mut p = self.p[0];
        for &c in &self.p[1..] {
            p = l.fmadd(p, x2, c);
        }
        let mut q = self.q[0];
        for &c in &self.q[1..] {
            q = l.fmadd(q, x2, c);
        }
        let v = l.div(l.mul(x, p), q);
        // ±1 from |x| = 3.92 on; NaN is not "at least" and keeps `v`.
        l.select_ge(l.abs(x0), self.big, l.copysign(self.one, x0), v)
    }
}

#[cfg(test)]
mod tests {
    use super::{Erf, Exp, ExpNarrow, ExpNonpos, ExpNonposFn, ExpNonposNarrow, ExpShiftedNarrow};
    use crate::math::{
        erf_f32, exp_f32, exp_narrow_f32, exp_nonpos_f32, exp_nonpos_narrow_f32, exp_shifted_narrow_f32,
    };
    use crate::wide::x86::{every_width, run_with, Kernel, Lanes, Width};

    /// Which function [`All`] evaluates.
    #[derive(Clone, Copy, Debug)]
    enum F {
        Exp,
        ExpNonpos,
        ExpNonposNarrow,
        ExpNarrow,
        /// At [`SHIFT`]'s maximum and cutoff.
        ExpShiftedNarrow,
        Erf,
    }

    /// `m log2 e` for the row maximum 2.5, and the cutoff, that
    /// [`F::ExpShiftedNarrow`] runs at: its `t` spans the cutoff and every
    /// binade above.
    const SHIFT: (f32, f32) = (2.5 * std::f32::consts::LOG2_E, -120.5);

    /// One function over whole vectors of `x` into `y`.
    struct All<'a>(F, &'a [f32], &'a mut [f32]);
    impl Kernel for All<'_> {
        type Output = ();
        #[inline(always)]
        fn run<L: Lanes>(self, l: L) {
            let (e, n, r) = (Exp::new(l), ExpNonpos::new(l), Erf::new(l));
            let (nn, en) = (ExpNonposNarrow::new(l), ExpNarrow::new(l));
            let sn = ExpShiftedNarrow::new(l, SHIFT.0, SHIFT.1);
            for (x, y) in self.1.chunks_exact(L::N).zip(self.2.chunks_exact_mut(L::N)) {
                // SAFETY: `N` values each.
                unsafe {
                    let x = l.load(x.as_ptr());
                    let v = match self.0 {
                        F::Exp => e.eval(l, x),
                        F::ExpNonpos => n.eval(l, x),
                        F::ExpNonposNarrow => nn.eval(l, x),
                        F::ExpNarrow => en.eval(l, x),
                        F::ExpShiftedNarrow => sn.eval(l, x),
                        F::Erf => r.eval(l, x),
                    };
                    l.store(y.as_mut_ptr(), v);
                }
            }
        }
    }

    /// Specials, each function's clamps and cutoffs, and dense sweeps.
    fn inputs() -> Vec<f32> {
        let mut x = vec![0.0, -0.0, 1e-40, -1e-40, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN];
        x.extend([f32::MAX, f32::MIN, 87.2, -87.2, 87.4, -87.4, 88.5, -88.5, 89.5, -89.5, 200.0, -200.0]);
        x.extend([88.37, 88.375, 88.376, 88.38, 88.72, 88.73, 89.0, -89.0]);
        x.extend([3.919_999_8, -3.919_999_8, 3.92, -3.92, 3.99, 4.0, -4.0, 4.01, -4.01, -87.336_54, -87.34]);
        x.extend((0..8192).map(|i| -100.0 + i as f32 * 0.025));
        x.extend((0..4096).map(|i| (i as f32 * 0.7331).sin() * 5.0));
        x.truncate(x.len() / 16 * 16);
        x
    }

    fn each<L: Width>(l: L) {
        let x = inputs();
        type Scalar = fn(f32) -> f32;
        let scalar: [(F, Scalar); 6] = [
            (F::Exp, exp_f32),
            (F::ExpNonpos, exp_nonpos_f32),
            (F::ExpNonposNarrow, exp_nonpos_narrow_f32),
            (F::ExpNarrow, exp_narrow_f32),
            (F::ExpShiftedNarrow, |x| exp_shifted_narrow_f32(x, SHIFT.0, SHIFT.1)),
            (F::Erf, erf_f32),
        ];
        for (f, want) in scalar {
            let mut y = vec![0f32; x.len()];
            run_with(l, All(f, &x, &mut y));
            for (x, y) in x.iter().zip(&y) {
                // `exp_nonpos` is defined for `x <= 0` and NaN only (above
                // 0 AVX-512's `vscalefps` scales where AVX2's shift wraps).
                if matches!(f, F::ExpNonpos | F::ExpNonposNarrow) && *x > 0.0 {
                    continue;
                }
                // The shifted one for `x <= m` (`t` below 1).
                if matches!(f, F::ExpShiftedNarrow) && *x > 2.5 {
                    continue;
                }
                let want = want(*x);
                let same = y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan());
                assert!(same, "{f:?}({x}) at width {}: {y} vs {want}", L::N);
            }
        }
    }

    #[test]
    fn every_function_matches_its_scalar_one_bit_for_bit() {
        every_width!(each);
    }
}
