//! silu_and_mul's forward in explicit SIMD, written once for AVX-512 and
//! AVX2 ([`crate::wide`]), prefetching the next row.
//!
//! The lane loop in `gated.rs` is compute-bound in bf16 and f16 on an AVX2
//! CPU (criterion, 4096x8192: bf16 8.1 ms, f16 13.6, where f32, twice the
//! bytes, takes 6.9). Here `exp`'s constants are broadcast once per block,
//! f16 goes through F16C, and every step is full width. criterion, same
//! CPU, old/new alternated: f16 13.6 -> 6.8 ms, bf16 8.1 -> 7.7 ms, f32
//! unchanged (it moves 192 MB at about a copy's bandwidth).
//!
//! The values are the lane loop's, bit for bit: [`crate::math::exp_f32`]
//! operation for operation, then `a / (1 + e^-a) * g` (the tests compare
//! both, and the `exp` alone, at every width the CPU has).
use crate::element::Element;
use crate::math::{EXP7_C, EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E, ROUND_MAGIC};
use crate::narrow::BLOCK;
use crate::rows::row_and_next;
use crate::simd::prefetch_part;
use crate::wide::cast_mut;
use crate::wide::x86::{Kernel, Lanes};

/// `silu(a) * g` over rows of `2d` inputs (`a` then `g`) into rows of `d`
/// outputs, `x` and `y` holding whole rows. For `T` in f32, bf16, f16 only
/// (the callers check [`crate::wide::has_lanes`]).
pub(super) struct SiluMul<'a, T> {
    pub(super) x: &'a [T],
    pub(super) y: &'a mut [T],
    pub(super) d: usize,
}

impl<T: Element> Kernel for SiluMul<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let SiluMul { x, y, d } = self;
        let e = Exp::new(l);
        for (r, y) in y.chunks_exact_mut(d).enumerate() {
            let (row, next) = row_and_next(x, r, 2 * d);
            let (a, g) = row.split_at(d);
            let (a_next, g_next) = next.split_at(next.len().min(d));
            T::write_acc(
                y,
                #[inline(always)]
                |at, out| {
                    prefetch_part::<T, false>(a_next, at / BLOCK, BLOCK);
                    prefetch_part::<T, false>(g_next, at / BLOCK, BLOCK);
                    let out = cast_mut::<T::Acc, f32>(out).expect("silu x86: T::Acc is f32 for f32, bf16, f16");
                    let len = out.len();
                    let (a, g, o) = (a[at..][..len].as_ptr(), g[at..][..len].as_ptr(), out.as_mut_ptr());
                    let mut i = 0;
                    // SAFETY: whole vectors while they fit in `out` (`a` and
                    // `g` hold `len` values from here), then the `len - i < N`
                    // values left; `T` is f32, bf16 or f16.
                    unsafe {
                        while i + L::N <= len {
                            l.store(o.add(i), silu_mul(l, &e, l.load(a.add(i)), l.load(g.add(i))));
                            i += L::N;
                        }
                        if i < len {
                            let n = len - i;
                            let v = silu_mul(l, &e, l.load_part(a.add(i), n), l.load_part(g.add(i), n));
                            l.store_part(o.add(i), v, n);
                        }
                    }
                },
            );
        }
    }
}

/// `a / (1 + e^-a) * g`, as `Silu::f(a) * g`. A function, not a closure: a
/// closure left out of line runs without the vector features.
#[inline(always)]
fn silu_mul<L: Lanes>(l: L, e: &Exp<L::V>, a: L::V, g: L::V) -> L::V {
    let one = l.splat(1.0);
    l.mul(l.div(a, l.add(one, e.eval(l, l.sub(l.splat(0.0), a)))), g)
}

/// The constants of [`crate::math::exp_f32`], broadcast.
struct Exp<V> {
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
    #[inline(always)]
    fn new<L: Lanes<V = V>>(l: L) -> Self {
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

    /// `exp_f32` on every lane, operation for operation.
    #[inline(always)]
    fn eval<L: Lanes<V = V>>(&self, l: L, x0: V) -> V {
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

#[cfg(test)]
mod tests {
    use super::SiluMul;
    use crate::element::Element;
    use crate::gated::{Act, Silu};
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// `a` values across `exp`'s range and past it (its clamps, 0 and the
    /// subnormal flush, overflow to inf), specials, and a sweep; `g` varied.
    fn inputs(d: usize) -> Vec<f32> {
        let special = [0.0, -0.0, 1e-40, -1e-40, 87.2, -87.2, 87.4, -87.4, 88.5, -88.5, 89.5, -89.5, 200.0, -200.0];
        let special = special.into_iter().chain([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN]);
        let a: Vec<f32> = special.chain((0..).map(|i| (i as f32 * 0.7331).sin() * 30.0)).take(d).collect();
        let g: Vec<f32> = (0..d).map(|i| 1.5 - (i % 7) as f32 * 0.5).collect();
        [a, g].concat()
    }

    /// The kernel against `Silu::f(a) * g` bit for bit (NaN as NaN), at
    /// one width, for row widths with and without a part vector, two rows.
    fn check<T: Element<Acc = f32>, L: Width>(l: L) {
        for d in [1, 7, 8, 16, 19, 33, 130, 300] {
            let row: Vec<T> = inputs(d).into_iter().map(T::from_acc).collect();
            let x = [row.clone(), row].concat();
            let mut y = vec![T::from_acc(-7.0); 2 * d];
            run_with(l, SiluMul { x: &x, y: &mut y, d });
            for (i, y) in y.iter().enumerate() {
                let r = &x[(i / d) * 2 * d..];
                let want = T::from_acc(Silu::f(r[i % d].to_acc()) * r[d + i % d].to_acc());
                let (got, want) = (y.to_acc(), want.to_acc());
                let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
                assert!(same, "{} d={d} i={i}: a={} got {got} want {want}", T::NAME, r[i % d].to_acc());
            }
        }
    }

    /// `Exp::eval` against `math::exp_f32` bit for bit (NaN as NaN).
    struct ExpAll<'a>(&'a [f32], &'a mut [f32]);
    impl crate::wide::x86::Kernel for ExpAll<'_> {
        type Output = ();
        #[inline(always)]
        fn run<L: crate::wide::x86::Lanes>(self, l: L) {
            let e = super::Exp::new(l);
            for (x, y) in self.0.chunks_exact(L::N).zip(self.1.chunks_exact_mut(L::N)) {
                // SAFETY: `N` values each.
                unsafe { l.store(y.as_mut_ptr(), e.eval(l, l.load(x.as_ptr()))) };
            }
        }
    }

    fn exp_matches<L: Width>(l: L) {
        let mut x = inputs(4096);
        x.extend((0..4096).map(|i| -100.0 + i as f32 * 0.05));
        let mut y = vec![0f32; x.len()];
        run_with(l, ExpAll(&x, &mut y));
        for (x, y) in x.iter().zip(&y) {
            let want = crate::math::exp_f32(*x);
            assert!(y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()), "exp({x}): {y} vs {want}");
        }
    }

    fn every_type<L: Width>(l: L) {
        exp_matches(l);
        check::<f32, L>(l);
        check::<bf16, L>(l);
        check::<f16, L>(l);
    }

    #[test]
    fn every_width_matches_the_lane_loop() {
        every_width!(every_type);
    }
}
