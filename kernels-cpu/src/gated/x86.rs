//! The gated forwards (silu_and_mul, gelu_and_mul exact and tanh) in
//! explicit SIMD, written once for AVX-512 and AVX2 ([`crate::wide`]),
//! prefetching the next row.
//!
//! The lane loop in `gated.rs` is compute-bound in bf16 and f16 on an AVX2
//! CPU (criterion, 4096x8192: silu bf16 8.1 ms, f16 13.6, where f32, twice
//! the bytes, takes 6.9). Here the constants of `exp` and `erf` are
//! broadcast once per block, f16 goes through F16C, and every step is full
//! width. criterion, same CPU, old/new alternated: silu f16 13.6 -> 6.8 ms,
//! bf16 8.1 -> 7.7 ms, f32 unchanged (it moves 192 MB at about a copy's
//! bandwidth); gelu figures in docs/BENCHMARKS.md (session 15).
//!
//! The values are the lane loop's, bit for bit: the functions of
//! [`crate::wide::x86::math`] and each activation's `f` operation for
//! operation, then `f(a) * g` (the tests compare both at every width the
//! CPU has).
use super::{Act, Activation, Gelu, GeluTanh, Silu, FRAC_1_SQRT_2, GELU_C, SQRT_8_PI};
use crate::element::Element;
use crate::narrow::BLOCK;
use crate::rows::row_and_next;
use crate::simd::prefetch_part;
use crate::wide::cast_mut;
use crate::wide::x86::math::{Erf, Exp};
use crate::wide::x86::{run, Kernel, Lanes};
use std::marker::PhantomData;

/// Runs the explicit forward of `A` over `x` into `y` (whole rows of `2d`
/// and `d`); false (without running) where there is none: `T` not f32,
/// bf16 or f16, or a CPU without AVX2 (with FMA and F16C).
#[inline(always)]
pub(super) fn forward<A: Act, T: Element>(x: &[T], y: &mut [T], d: usize) -> bool {
    if !crate::wide::has_lanes::<T>() {
        return false;
    }
    match A::KIND {
        Activation::Silu => run(GatedMul::<T, Silu> { x, y, d, act: PhantomData }).is_some(),
        Activation::Gelu => run(GatedMul::<T, Gelu> { x, y, d, act: PhantomData }).is_some(),
        Activation::GeluTanh => run(GatedMul::<T, GeluTanh> { x, y, d, act: PhantomData }).is_some(),
    }
}

/// An activation on [`Lanes`] vectors, with the constants it broadcasts.
trait WideAct {
    /// The broadcast constants.
    type C<V: Copy>;
    /// Broadcasts them (once per block of rows).
    fn consts<L: Lanes>(l: L) -> Self::C<L::V>;
    /// The activation of each lane, as the scalar `Act::f` computes it.
    fn f<L: Lanes>(l: L, c: &Self::C<L::V>, a: L::V) -> L::V;
}

impl WideAct for Silu {
    type C<V: Copy> = Exp<V>;
    #[inline(always)]
    fn consts<L: Lanes>(l: L) -> Exp<L::V> {
        Exp::new(l)
    }
    /// `a / (1 + e^-a)`.
    #[inline(always)]
    fn f<L: Lanes>(l: L, e: &Exp<L::V>, a: L::V) -> L::V {
        l.div(a, l.add(l.splat(1.0), e.eval(l, l.sub(l.splat(0.0), a))))
    }
}

impl WideAct for Gelu {
    type C<V: Copy> = Erf<V>;
    #[inline(always)]
    fn consts<L: Lanes>(l: L) -> Erf<L::V> {
        Erf::new(l)
    }
    /// `0.5 a (1 + erf(a / sqrt 2))`, multiplied left to right.
    #[inline(always)]
    fn f<L: Lanes>(l: L, e: &Erf<L::V>, a: L::V) -> L::V {
        let erf = e.eval(l, l.mul(a, l.splat(FRAC_1_SQRT_2 as f32)));
        l.mul(l.mul(l.splat(0.5), a), l.add(l.splat(1.0), erf))
    }
}

impl WideAct for GeluTanh {
    type C<V: Copy> = Exp<V>;
    #[inline(always)]
    fn consts<L: Lanes>(l: L) -> Exp<L::V> {
        Exp::new(l)
    }
    /// `a / (1 + e^-v)`, `v = 2 sqrt(2/pi) (a + c a a a)` multiplied left
    /// to right.
    #[inline(always)]
    fn f<L: Lanes>(l: L, e: &Exp<L::V>, a: L::V) -> L::V {
        let cube = l.mul(l.mul(l.mul(l.splat(GELU_C as f32), a), a), a);
        let v = l.mul(l.splat(SQRT_8_PI as f32), l.add(a, cube));
        l.div(a, l.add(l.splat(1.0), e.eval(l, l.sub(l.splat(0.0), v))))
    }
}

/// `act(a) * g` over rows of `2d` inputs (`a` then `g`) into rows of `d`
/// outputs, `x` and `y` holding whole rows. For `T` in f32, bf16, f16 only
/// (checked by [`forward`]).
struct GatedMul<'a, T, A> {
    x: &'a [T],
    y: &'a mut [T],
    d: usize,
    act: PhantomData<A>,
}

impl<T: Element, A: WideAct> Kernel for GatedMul<'_, T, A> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let GatedMul { x, y, d, .. } = self;
        let c = A::consts(l);
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
                    let out = cast_mut::<T::Acc, f32>(out).expect("gated x86: T::Acc is f32 for f32, bf16, f16");
                    let len = out.len();
                    let (a, g, o) = (a[at..][..len].as_ptr(), g[at..][..len].as_ptr(), out.as_mut_ptr());
                    let mut i = 0;
                    // SAFETY: whole vectors while they fit in `out` (`a` and
                    // `g` hold `len` values from here), then the `len - i < N`
                    // values left; `T` is f32, bf16 or f16.
                    unsafe {
                        while i + L::N <= len {
                            l.store(o.add(i), l.mul(A::f(l, &c, l.load(a.add(i))), l.load(g.add(i))));
                            i += L::N;
                        }
                        if i < len {
                            let n = len - i;
                            let v = l.mul(A::f(l, &c, l.load_part(a.add(i), n)), l.load_part(g.add(i), n));
                            l.store_part(o.add(i), v, n);
                        }
                    }
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{GatedMul, WideAct};
    use crate::element::Element;
    use crate::gated::{Act, Gelu, GeluTanh, Silu};
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};
    use std::marker::PhantomData;

    /// `a` values across the ranges of `exp` and `erf` and past them (the
    /// clamps, 0 and the subnormal flush, overflow to inf, erf's `±1` from
    /// `|a| = 3.92 sqrt 2`), specials, and a sweep; `g` varied.
    fn inputs(d: usize) -> Vec<f32> {
        let special = [0.0, -0.0, 1e-40, -1e-40, 87.2, -87.2, 87.4, -87.4, 88.5, -88.5, 89.5, -89.5, 200.0, -200.0];
        let erf = [5.543, -5.543, 5.544, -5.544, 5.657, -5.657, 5.66, -5.66, 44.3, -44.3];
        let special = special.into_iter().chain(erf).chain([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX]);
        // The sweep alternates between +-30 (the tails) and +-4 (the curve).
        let sweep = (0..).map(|i| (i as f32 * 0.7331).sin() * if i % 2 == 0 { 30.0 } else { 4.0 });
        let a: Vec<f32> = special.chain(sweep).take(d).collect();
        let g: Vec<f32> = (0..d).map(|i| 1.5 - (i % 7) as f32 * 0.5).collect();
        [a, g].concat()
    }

    /// The kernel against `A::f(a) * g` (the lane loop's scalar code) bit
    /// for bit (NaN as NaN), at one width, for row widths with and without
    /// a part vector, two rows.
    fn check<A: Act + WideAct, T: Element<Acc = f32>, L: Width>(l: L) {
        for d in [1, 7, 8, 16, 19, 33, 130, 300, 2000] {
            let row: Vec<T> = inputs(d).into_iter().map(T::from_acc).collect();
            let x = [row.clone(), row].concat();
            let mut y = vec![T::from_acc(-7.0); 2 * d];
            run_with(l, GatedMul::<T, A> { x: &x, y: &mut y, d, act: PhantomData });
            for (i, y) in y.iter().enumerate() {
                let r = &x[(i / d) * 2 * d..];
                let want = T::from_acc(<A as Act>::f(r[i % d].to_acc()) * r[d + i % d].to_acc());
                let (got, want) = (y.to_acc(), want.to_acc());
                let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
                let name = A::KIND.name();
                assert!(same, "{name} {} d={d} i={i}: a={} got {got} want {want}", T::NAME, r[i % d].to_acc());
            }
        }
    }

    fn every_type<A: Act + WideAct, L: Width>(l: L) {
        check::<A, f32, L>(l);
        check::<A, bf16, L>(l);
        check::<A, f16, L>(l);
    }

    fn every_act<L: Width>(l: L) {
        every_type::<Silu, L>(l);
        every_type::<Gelu, L>(l);
        every_type::<GeluTanh, L>(l);
    }

    #[test]
    fn every_width_matches_the_lane_loop() {
        every_width!(every_act);
    }
}
