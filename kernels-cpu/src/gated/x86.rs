//! The gated ops (silu_and_mul, gelu_and_mul exact and tanh), forward and
//! backward, in explicit SIMD written once for AVX-512 and AVX2
//! ([`crate::wide`]); the forward prefetches the next row.
//!
//! The lane loops in `gated.rs` are compute-bound in bf16 and f16 on an AVX2
//! CPU (criterion, 4096x8192: silu forward bf16 8.1 ms, f16 13.6, where
//! f32, twice the bytes, takes 6.9; backward f16 19-27 ms, where f32 takes
//! 13-17). Here the constants of `exp` and `erf` are broadcast once per
//! block, f16 goes through F16C, and every step is full width. criterion,
//! same CPU, old/new alternated: silu forward f16 13.6 -> 6.8 ms, bf16 8.1
//! -> 7.7, f32 unchanged (it moves 192 MB at about a copy's bandwidth); the
//! other figures are in docs/BENCHMARKS.md (session 15).
//!
//! The values are the lane loop's, bit for bit: the functions of
//! [`crate::wide::x86::math`] and each activation's `f` and `f_df`
//! operation for operation, then the products in the lane loop's order (the
//! tests compare every activation, dtype and direction at every width the
//! CPU has).
use super::{
    narrow, Act, Activation, Gelu, GeluTanh, Silu, FRAC_1_SQRT_2, FRAC_1_SQRT_2PI, GELU_C, GELU_TANH_SATURATED,
    SQRT_8_PI,
};
use crate::element::{Acc, Element};
use crate::narrow::BLOCK;
use crate::rows::{row_and_after, Order};
use crate::wide::x86::math::{Erf, Exp, ExpNarrow, ExpNonposFn, ExpNonposNarrow};
use crate::wide::x86::write_row::{load_bf16_pair, store_bf16_pair_arithmetic, write_row, RowValues};
use crate::wide::x86::{load_n, run, Kernel, Lanes};
use crate::wide::{cast_mut, is};
use half::bf16;
use std::marker::PhantomData;

/// Runs the explicit forward of `A` over `x` into `y` (whole rows of `2d`
/// and `d`), storing in `order`; false (without running) where there is
/// none: `T` not f32, bf16 or f16, or a CPU without AVX2 (with FMA and F16C).
#[inline(always)]
pub(super) fn forward<A: Act, T: Element>(x: &[T], y: &mut [T], d: usize, order: Order) -> bool {
    if !crate::wide::has_lanes::<T>() {
        return false;
    }
    match A::KIND {
        Activation::Silu => run(GatedMul::<T, Silu> { x, y, d, order, act: PhantomData }).is_some(),
        Activation::Gelu => run(GatedMul::<T, Gelu> { x, y, d, order, act: PhantomData }).is_some(),
        Activation::GeluTanh => run(GatedMul::<T, GeluTanh> { x, y, d, order, act: PhantomData }).is_some(),
    }
}

/// An activation on [`Lanes`] vectors, with the constants it broadcasts.
///
/// `narrow` is the scalar `Act`'s: [`narrow`] of the element type, a
/// constant wherever these are inlined, so each kernel keeps one `exp`
/// (and broadcasts only its constants).
trait WideAct {
    /// Whether the forward's bf16 rows round in registers on AVX2, with no
    /// NaN check ([`RowValues::ARITHMETIC`]: the values of every activation
    /// allow it). False where that measured slower than the blocks.
    const AVX2_PAIRS: bool = true;
    /// The broadcast constants.
    type C<V: Copy>;
    /// Broadcasts them (once per block of rows).
    fn consts<L: Lanes>(l: L) -> Self::C<L::V>;
    /// The activation of each lane, as the scalar `Act::f` computes it.
    fn f<L: Lanes>(l: L, c: &Self::C<L::V>, a: L::V, narrow: bool) -> L::V;
    /// The activation and its derivative, as the scalar `Act::f_df`.
    fn f_df<L: Lanes>(l: L, c: &Self::C<L::V>, a: L::V, narrow: bool) -> (L::V, L::V);
}

/// The `exp` of a sigmoid's `1 + e^x`, f32-accurate and narrow, as the
/// scalar `exp_for`.
struct SigmoidExp<V> {
    full: Exp<V>,
    narrow: ExpNarrow<V>,
}

impl<V: Copy> SigmoidExp<V> {
    #[inline(always)]
    fn new<L: Lanes<V = V>>(l: L) -> Self {
        SigmoidExp { full: Exp::new(l), narrow: ExpNarrow::new(l) }
    }
    /// `1 + e^x`.
    #[inline(always)]
    fn one_plus<L: Lanes<V = V>>(&self, l: L, x: V, narrow: bool) -> V {
        let e = if narrow { self.narrow.eval(l, x) } else { self.full.eval(l, x) };
        l.add(l.splat(1.0), e)
    }
}

impl WideAct for Silu {
    type C<V: Copy> = SigmoidExp<V>;
    #[inline(always)]
    fn consts<L: Lanes>(l: L) -> SigmoidExp<L::V> {
        SigmoidExp::new(l)
    }
    /// `a / (1 + e^-a)`.
    #[inline(always)]
    fn f<L: Lanes>(l: L, e: &SigmoidExp<L::V>, a: L::V, narrow: bool) -> L::V {
        l.div(a, e.one_plus(l, l.sub(l.splat(0.0), a), narrow))
    }
    /// `s = 1 / (1 + e^-a)`: `(a s, s (1 + a (1 - s)))`.
    #[inline(always)]
    fn f_df<L: Lanes>(l: L, e: &SigmoidExp<L::V>, a: L::V, narrow: bool) -> (L::V, L::V) {
        let one = l.splat(1.0);
        let s = l.div(one, e.one_plus(l, l.sub(l.splat(0.0), a), narrow));
        (l.mul(a, s), l.mul(s, l.add(one, l.mul(a, l.sub(one, s)))))
    }
}

/// Gelu's constants: `erf`, and the pdf's `exp`, f32-accurate and narrow.
type GeluC<V> = (Erf<V>, Exp<V>, ExpNonposNarrow<V>);

impl WideAct for Gelu {
    type C<V: Copy> = GeluC<V>;
    #[inline(always)]
    fn consts<L: Lanes>(l: L) -> GeluC<L::V> {
        (Erf::new(l), Exp::new(l), ExpNonposNarrow::new(l))
    }
    /// `h + h erf(a / sqrt 2)`, `h = 0.5 a`.
    #[inline(always)]
    fn f<L: Lanes>(l: L, (e, _, _): &GeluC<L::V>, a: L::V, _narrow: bool) -> L::V {
        let erf = e.eval(l, l.mul(a, l.splat(FRAC_1_SQRT_2 as f32)));
        let h = l.mul(l.splat(0.5), a);
        l.fmadd(h, erf, h)
    }
    /// `cdf = 0.5 + 0.5 erf(a / sqrt 2)`, `pdf = e^(-0.5 a a) / sqrt(2 pi)`:
    /// `(a cdf, cdf + a pdf)`.
    #[inline(always)]
    fn f_df<L: Lanes>(l: L, (e, x, xn): &GeluC<L::V>, a: L::V, narrow: bool) -> (L::V, L::V) {
        let half = l.splat(0.5);
        let cdf = l.fmadd(half, e.eval(l, l.mul(a, l.splat(FRAC_1_SQRT_2 as f32))), half);
        let arg = l.sub(l.splat(0.0), l.mul(l.mul(half, a), a));
        let ex = if narrow { xn.eval(l, arg) } else { x.eval(l, arg) };
        let pdf = l.mul(ex, l.splat(FRAC_1_SQRT_2PI as f32));
        (l.mul(a, cdf), l.add(cdf, l.mul(a, pdf)))
    }
}

impl WideAct for GeluTanh {
    /// Its forward measured slower in registers (AVX2, a 2-core Zen 3,
    /// `[4096, 8192]` bf16, two threads, fresh huge pages and memory faulted
    /// in before, old and new alternated in one process, medians of 40-100
    /// rounds: 1.04-1.10x the time; silu 0.95-0.98x, gelu 0.91-0.94x;
    /// BENCHMARKS.md, session 55). perf (session 56, one thread): both
    /// loops wait on `vdivps`, but with two vectors in flight the registers
    /// run out: the pair loop spilled a vector, reloaded two pointers from
    /// the stack and broadcast one constant three times per 16 values,
    /// where the block loop keeps its constants in registers.
    const AVX2_PAIRS: bool = false;
    type C<V: Copy> = SigmoidExp<V>;
    #[inline(always)]
    fn consts<L: Lanes>(l: L) -> SigmoidExp<L::V> {
        SigmoidExp::new(l)
    }
    /// `a / (1 + e^-v)`, `-v = a (-k - k c a a)` as the scalar `minus_v`.
    #[inline(always)]
    fn f<L: Lanes>(l: L, e: &SigmoidExp<L::V>, a: L::V, narrow: bool) -> L::V {
        l.div(a, e.one_plus(l, minus_v(l, a), narrow))
    }
    /// `s = 1 / (1 + e^-v)`, `v' = k + 3 k c a a` with `a` clamped to
    /// `GELU_TANH_SATURATED` (as the scalar one): `(a s, s + a s (1 - s) v')`.
    #[inline(always)]
    fn f_df<L: Lanes>(l: L, e: &SigmoidExp<L::V>, a: L::V, narrow: bool) -> (L::V, L::V) {
        let (one, k) = (l.splat(1.0), l.splat(SQRT_8_PI as f32));
        let s = l.div(one, e.one_plus(l, minus_v(l, a), narrow));
        let lim = GELU_TANH_SATURATED as f32;
        let ac = l.min(l.max(a, l.splat(-lim)), l.splat(lim));
        let dv = l.fmadd(l.mul(ac, ac), l.splat((3.0 * SQRT_8_PI * GELU_C) as f32), k);
        (l.mul(a, s), l.add(s, l.mul(l.mul(l.mul(a, s), l.sub(one, s)), dv)))
    }
}

/// gelu_tanh's `-v = a (-k - k c a a)`, as the scalar `minus_v`.
#[inline(always)]
fn minus_v<L: Lanes>(l: L, a: L::V) -> L::V {
    let (nkc, nk) = ((-SQRT_8_PI * GELU_C) as f32, -SQRT_8_PI as f32);
    l.mul(a, l.fmadd(l.mul(a, a), l.splat(nkc), l.splat(nk)))
}

/// `act(a) * g` over rows of `2d` inputs (`a` then `g`) into rows of `d`
/// outputs, `x` and `y` holding whole rows. For `T` in f32, bf16, f16 only
/// (checked by [`forward`]).
///
/// Each row goes through [`write_row`], which rounds bf16 in registers
/// where the width can: through a scratch block of f32, as before, the
/// bf16 forward stored and loaded every value once more (perf put the
/// block's stores and loads among the hottest instructions of gelu bf16).
struct GatedMul<'a, T, A> {
    x: &'a [T],
    y: &'a mut [T],
    d: usize,
    /// The order of the rows, and of each row's stores.
    order: Order,
    act: PhantomData<A>,
}

impl<T: Element, A: WideAct> Kernel for GatedMul<'_, T, A> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let GatedMul { x, y, d, order, .. } = self;
        let c = A::consts(l);
        order.each(
            y.len() / d.max(1),
            #[inline(always)]
            |r| {
                let (row, next) = row_and_after(x, r, 2 * d, order);
                let (a, g) = row.split_at(d);
                let (a_next, g_next) = next.split_at(next.len().min(d));
                let row = GatedRow::<T, A, L::V> { a: a.as_ptr(), g: g.as_ptr(), c: &c, len: d, act: PhantomData };
                write_row(l, row, &mut y[r * d..][..d], &[a_next, g_next], order);
            },
        );
    }
}

/// One row's `a` and `g` (each `len` long) and the activation's constants.
struct GatedRow<'c, T, A: WideAct, V: Copy> {
    a: *const T,
    g: *const T,
    c: &'c A::C<V>,
    len: usize,
    act: PhantomData<A>,
}

impl<T, A: WideAct, V: Copy> Clone for GatedRow<'_, T, A, V> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}

impl<T, A: WideAct, V: Copy> Copy for GatedRow<'_, T, A, V> {}

impl<L: Lanes, T: 'static, A: WideAct> RowValues<L> for GatedRow<'_, T, A, L::V> {
    /// `act(a) g` ends with a multiply, and the activations are float
    /// arithmetic, clamps, selects and lane masks, with `exp`'s integer
    /// step building only a `2^n` (a zero mantissa: never NaN); the tests
    /// give bf16 rows quiet and signalling NaN with payloads. Where the
    /// activation gains by it ([`WideAct::AVX2_PAIRS`]).
    const ARITHMETIC: bool = A::AVX2_PAIRS;
    #[inline(always)]
    fn len(self) -> usize {
        self.len
    }
    /// `act(a) g`.
    #[inline(always)]
    unsafe fn value(self, l: L, i: usize, count: usize) -> L::V {
        // SAFETY: `i + count <= len` (the caller's), and `a`, `g` hold `len`
        // values; `T` is f32, bf16 or f16 (checked by `forward`).
        unsafe { l.mul(A::f(l, self.c, load_n(l, self.a, i, count), narrow::<T>()), load_n(l, self.g, i, count)) }
    }
    #[inline(always)]
    unsafe fn pair(self, l: L, i: usize) -> (L::V, L::V) {
        // SAFETY: `i + 2 N <= len` and the inputs are bf16 (the caller's).
        unsafe {
            let ((a0, a1), (g0, g1)) = (load_bf16_pair(l, self.a.add(i)), load_bf16_pair(l, self.g.add(i)));
            let t = narrow::<T>();
            (l.mul(A::f(l, self.c, a0, t), g0), l.mul(A::f(l, self.c, a1, t), g1))
        }
    }
}

/// Runs the explicit backward of `A`: `x` and `dx` whole rows of `2d`, `dy`
/// rows of `d`, storing in `order`; false (without running) where there is
/// none, as [`forward`].
#[inline(always)]
pub(super) fn backward<A: Act, T: Element>(x: &[T], dy: &[T], dx: &mut [T], d: usize, order: Order) -> bool {
    if !crate::wide::has_lanes::<T>() {
        return false;
    }
    match A::KIND {
        Activation::Silu => run(GatedMulBack::<T, Silu> { x, dy, dx, d, order, act: PhantomData }).is_some(),
        Activation::Gelu => run(GatedMulBack::<T, Gelu> { x, dy, dx, d, order, act: PhantomData }).is_some(),
        Activation::GeluTanh => run(GatedMulBack::<T, GeluTanh> { x, dy, dx, d, order, act: PhantomData }).is_some(),
    }
}

/// The backward over rows: `da = dy g act'(a)` and `dg = dy act(a)`, each
/// multiplied left to right as in `backward_row`. f32 is stored in place;
/// bf16 is rounded in registers ([`back_bf16_pair`]); the rest of a bf16
/// row, and f16, go through a block of f32 and [`Element::from_acc_slice`]
/// ([`back_span`]).
struct GatedMulBack<'a, T, A> {
    x: &'a [T],
    dy: &'a [T],
    dx: &'a mut [T],
    d: usize,
    /// The order of the rows, and of each row's stores.
    order: Order,
    act: PhantomData<A>,
}

impl<T: Element, A: WideAct> Kernel for GatedMulBack<'_, T, A> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let GatedMulBack { x, dy, dx, d, order, .. } = self;
        let c = A::consts(l);
        let mut bufs = [[T::Acc::ZERO; BLOCK]; 2];
        let n = 2 * L::N;
        order.each(
            dy.len() / d.max(1),
            #[inline(always)]
            |r| {
                let (a, g) = x[r * 2 * d..][..2 * d].split_at(d);
                let (da, dg) = dx[r * 2 * d..][..2 * d].split_at_mut(d);
                let src = [a, g, &dy[r * d..][..d]];
                // bf16 rounds its whole groups of `2 N` in registers;
                // blocks of f32 take the rest.
                let whole = if is::<T, bf16>() { d / n * n } else { 0 };
                match order {
                    Order::Ascending => {
                        if let (Some(da), Some(dg)) = (cast_mut::<T, bf16>(da), cast_mut::<T, bf16>(dg)) {
                            for i in (0..whole).step_by(n) {
                                back_bf16_pair::<L, A, T>(l, &c, src, da, dg, i);
                            }
                        }
                        for at in (whole..d).step_by(BLOCK) {
                            back_span::<L, A, T>(l, &c, src, [&mut *da, &mut *dg], at..(at + BLOCK).min(d), &mut bufs);
                        }
                    }
                    Order::Descending => {
                        for at in (whole..d).step_by(BLOCK).rev() {
                            back_span::<L, A, T>(l, &c, src, [&mut *da, &mut *dg], at..(at + BLOCK).min(d), &mut bufs);
                        }
                        if let (Some(da), Some(dg)) = (cast_mut::<T, bf16>(da), cast_mut::<T, bf16>(dg)) {
                            for i in (0..whole).step_by(n).rev() {
                                back_bf16_pair::<L, A, T>(l, &c, src, da, dg, i);
                            }
                        }
                    }
                }
            },
        );
    }
}

/// Values `at` of one row's `da` and `dg` from `[a, g, dy]` (each holding
/// the row): f32 stored in place, other types through `bufs` and
/// [`Element::from_acc_slice`].
#[inline(always)]
fn back_span<L: Lanes, A: WideAct, T: Element>(
    l: L,
    c: &A::C<L::V>,
    [a, g, dy]: [&[T]; 3],
    [da, dg]: [&mut [T]; 2],
    at: std::ops::Range<usize>,
    bufs: &mut [[T::Acc; BLOCK]; 2],
) {
    let len = at.len();
    assert!(len <= BLOCK, "gated x86: a span is longer than a block");
    let (a, g, dy) = (a[at.clone()].as_ptr(), g[at.clone()].as_ptr(), dy[at.clone()].as_ptr());
    let (da, dg) = (&mut da[at.clone()], &mut dg[at]);
    if is::<T, f32>() {
        // SAFETY: `T` is f32; `a`, `g`, `dy` hold `len` values, as do the
        // outputs.
        unsafe { back_block::<L, A, T>(l, c, [a, g, dy], [da.as_mut_ptr().cast(), dg.as_mut_ptr().cast()], len) };
    } else {
        let [ta, tg] = bufs;
        let e = "gated x86: T::Acc is f32 for f32, bf16, f16";
        let oa = cast_mut::<T::Acc, f32>(&mut ta[..len]).expect(e).as_mut_ptr();
        let og = cast_mut::<T::Acc, f32>(&mut tg[..len]).expect(e).as_mut_ptr();
        // SAFETY: as above, into the blocks (`BLOCK >= len`).
        unsafe { back_block::<L, A, T>(l, c, [a, g, dy], [oa, og], len) };
        // A whole block narrows with its length known, which LLVM unrolls.
        if len == BLOCK {
            T::from_acc_slice(&ta[..], &mut da[..BLOCK]);
            T::from_acc_slice(&tg[..], &mut dg[..BLOCK]);
        } else {
            T::from_acc_slice(&ta[..len], da);
            T::from_acc_slice(&tg[..len], dg);
        }
    }
}

/// The group of `2 N` values of a bf16 row's `da` and `dg` at `i`, rounded
/// in registers by [`store_bf16_pair_arithmetic`], as the forward's
/// (`RowValues::ARITHMETIC`: both end with a multiply of such values).
/// Through the f32 blocks instead, each value is stored, loaded and stored
/// again. Panics where a row does not hold the group.
#[inline(always)]
fn back_bf16_pair<L: Lanes, A: WideAct, T: 'static>(
    l: L,
    c: &A::C<L::V>,
    [a, g, dy]: [&[T]; 3],
    da: &mut [bf16],
    dg: &mut [bf16],
    i: usize,
) {
    let n = 2 * L::N;
    let (a, g, dy) = (&a[i..i + n], &g[i..i + n], &dy[i..i + n]);
    let (a, g, dy) = (a.as_ptr(), g.as_ptr(), dy.as_ptr());
    // SAFETY: `a`, `g`, `dy` hold the `2 N` values of `T` (bf16: the
    // caller cast the outputs to it) the slices above checked, in
    // `load_bf16_pair`'s order, which `store_bf16_pair_arithmetic` takes.
    let (lo, hi) = unsafe {
        let ((a0, a1), (g0, g1), (d0, d1)) = (load_bf16_pair(l, a), load_bf16_pair(l, g), load_bf16_pair(l, dy));
        (back_step::<L, A, T>(l, c, a0, g0, d0), back_step::<L, A, T>(l, c, a1, g1, d1))
    };
    store_bf16_pair_arithmetic(l, &mut da[i..i + n], lo.0, hi.0);
    store_bf16_pair_arithmetic(l, &mut dg[i..i + n], lo.1, hi.1);
}

/// `len` values of `da` and `dg` from `[a, g, dy]`.
///
/// # Safety
/// The three inputs hold `len` readable values of `T` (f32, bf16 or f16),
/// the two outputs `len` writable f32.
#[inline(always)]
unsafe fn back_block<L: Lanes, A: WideAct, T: 'static>(
    l: L,
    c: &A::C<L::V>,
    [a, g, dy]: [*const T; 3],
    [oa, og]: [*mut f32; 2],
    len: usize,
) {
    let mut i = 0;
    // SAFETY: whole vectors while they fit, then the `len - i < N` left.
    unsafe {
        while i + L::N <= len {
            let (va, vg) = back_step::<L, A, T>(l, c, l.load(a.add(i)), l.load(g.add(i)), l.load(dy.add(i)));
            l.store(oa.add(i), va);
            l.store(og.add(i), vg);
            i += L::N;
        }
        if i < len {
            let n = len - i;
            let (va, vg) = back_step::<L, A, T>(
                l,
                c,
                l.load_part(a.add(i), n),
                l.load_part(g.add(i), n),
                l.load_part(dy.add(i), n),
            );
            l.store_part(oa.add(i), va, n);
            l.store_part(og.add(i), vg, n);
        }
    }
}

/// `(dy g act'(a), dy act(a))` for elements `T`. A function, not a
/// closure: a closure left out of line runs without the vector features.
#[inline(always)]
fn back_step<L: Lanes, A: WideAct, T>(l: L, c: &A::C<L::V>, a: L::V, g: L::V, dy: L::V) -> (L::V, L::V) {
    let (f, df) = A::f_df(l, c, a, narrow::<T>());
    (l.mul(l.mul(dy, g), df), l.mul(dy, f))
}

#[cfg(test)]
mod tests {
    use super::{GatedMul, GatedMulBack, WideAct};
    use crate::element::Element;
    use crate::gated::{narrow, Act, Gelu, GeluTanh, Silu};
    use crate::rows::ORDERS;
    use crate::testing::{same_or_nan, BF16_NANS};
    use crate::wide::cast_mut;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};
    use std::marker::PhantomData;

    /// `a` values across the ranges of `exp` and `erf` and past them (the
    /// clamps, 0 and the subnormal flush, overflow to inf, erf's `±1` from
    /// `|a| = 3.92 sqrt 2`), specials, and a sweep; `g` varied. `±1e-38`
    /// and `±2e-39` give outputs that are f32 subnormals and round to
    /// nonzero bf16 (the hardware rounding would flush them).
    fn inputs(d: usize) -> Vec<f32> {
        let special = [
            0.0, -0.0, 1e-40, -1e-40, 1e-38, -1e-38, 2e-39, -2e-39, 87.2, -87.2, 87.4, -87.4, 88.5, -88.5, 89.5, -89.5,
            200.0, -200.0, 88.37, -88.37, 88.38, -88.38,
        ];
        let erf = [5.543, -5.543, 5.544, -5.544, 5.657, -5.657, 5.66, -5.66, 44.3, -44.3];
        let special = special.into_iter().chain(erf).chain([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX]);
        // The sweep alternates between +-30 (the tails) and +-4 (the curve).
        let sweep = (0..).map(|i| (i as f32 * 0.7331).sin() * if i % 2 == 0 { 30.0 } else { 4.0 });
        let a: Vec<f32> = special.chain(sweep).take(d).collect();
        let g: Vec<f32> = (0..d).map(|i| 1.5 - (i % 7) as f32 * 0.5).collect();
        [a, g].concat()
    }

    /// bf16 NaN, quiet and signalling, with and without payloads, of both
    /// signs (the bf16 rows on AVX2 round with no NaN check:
    /// `RowValues::ARITHMETIC`), put into `v` at every 11th value from 40
    /// (past the specials of [`inputs`]); other types are left as they are.
    fn with_nans<T: 'static>(mut v: Vec<T>, d: usize) -> Vec<T> {
        if let Some(b) = cast_mut::<T, half::bf16>(&mut v) {
            for (i, v) in b.iter_mut().enumerate().filter(|&(i, _)| i % 11 == 3 && i % d >= 40) {
                *v = bf16::from_bits(BF16_NANS[i / 11 % BF16_NANS.len()]);
            }
        }
        v
    }

    /// The kernel against `A::f(a) * g` (the lane loop's scalar code) bit
    /// for bit (NaN as NaN), at one width, for row widths with and without
    /// a part vector, two rows.
    fn check<A: Act + WideAct, T: Element<Acc = f32>, L: Width>(l: L) {
        for d in [1, 7, 8, 16, 19, 33, 130, 300, 2000] {
            let row: Vec<T> = with_nans(inputs(d).into_iter().map(T::from_acc).collect(), d);
            let x = [row.clone(), row].concat();
            for order in ORDERS {
                let mut y = vec![T::from_acc(-7.0); 2 * d];
                run_with(l, GatedMul::<T, A> { x: &x, y: &mut y, d, order, act: PhantomData });
                for (i, y) in y.iter().enumerate() {
                    let r = &x[(i / d) * 2 * d..];
                    let want = T::from_acc(<A as Act>::f(r[i % d].to_acc(), narrow::<T>()) * r[d + i % d].to_acc());
                    let (got, want) = (y.to_acc(), want.to_acc());
                    let same = same_or_nan(got, want);
                    let name = A::KIND.name();
                    assert!(
                        same,
                        "{name} {} d={d} i={i} {order:?}: a={} got {got} want {want}",
                        T::NAME,
                        r[i % d].to_acc()
                    );
                }
            }
        }
    }

    /// The backward kernel against `backward_row`'s scalar code (`(dy g)
    /// df` and `dy f` from `Act::f_df`) bit for bit, as [`check`]; row
    /// widths past one block, with a part block and a part vector.
    fn check_back<A: Act + WideAct, T: Element<Acc = f32>, L: Width>(l: L) {
        for d in [1, 7, 8, 19, 32, 33, 130, 300, 2000] {
            let row: Vec<T> = with_nans(inputs(d).into_iter().map(T::from_acc).collect(), d);
            let x = [row.clone(), row].concat();
            let dy: Vec<T> = (0..2 * d).map(|i| T::from_acc(0.75 - (i % 11) as f32 * 0.25)).collect();
            // NaN in `dy` 5 values before those of `a` and `g`.
            let mut dy = with_nans(dy, d);
            let len = dy.len();
            dy.rotate_left(5 % len);
            for order in ORDERS {
                let mut dx = vec![T::from_acc(-7.0); 4 * d];
                run_with(l, GatedMulBack::<T, A> { x: &x, dy: &dy, dx: &mut dx, d, order, act: PhantomData });
                for (i, got) in dx.iter().enumerate() {
                    let (r, j) = (i / (2 * d), i % (2 * d));
                    let (a, g, dy) =
                        (x[r * 2 * d + j % d].to_acc(), x[r * 2 * d + d + j % d].to_acc(), dy[r * d + j % d].to_acc());
                    let (f, df) = <A as Act>::f_df(a, narrow::<T>());
                    let want = T::from_acc(if j < d { dy * g * df } else { dy * f });
                    let (got, want) = (got.to_acc(), want.to_acc());
                    let same = same_or_nan(got, want);
                    let name = A::KIND.name();
                    assert!(same, "{name} backward {} d={d} i={i} {order:?}: a={a} got {got} want {want}", T::NAME);
                }
            }
        }
    }

    fn every_type<A: Act + WideAct, L: Width>(l: L) {
        check::<A, f32, L>(l);
        check::<A, bf16, L>(l);
        check::<A, f16, L>(l);
        check_back::<A, f32, L>(l);
        check_back::<A, bf16, L>(l);
        check_back::<A, f16, L>(l);
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
