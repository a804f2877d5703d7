//! The vector operations the explicit kernels use ([`Lanes`]), their AVX2
//! and AVX-512 implementations, and [`run`], which calls a [`Kernel`] at the
//! best width this CPU has.
//!
//! As in pulp: a [`Lanes`] value is a zero-sized token that exists only when
//! the CPU has its features, so its methods are safe; they are
//! `#[inline(always)]` and only meant to be called inside a [`Kernel`]'s
//! `run`, which [`run`] calls from a function compiled for those features
//! (that is what lets the intrinsics inline).
mod avx2;
mod avx512;
pub(crate) mod even_odd;
pub(crate) mod math;
pub(crate) mod write_row;

pub(crate) use avx2::V8;
pub(crate) use avx512::V16;

/// f32 vectors of one width, with the loads of the element types that have
/// explicit code ([`super::has_lanes`]: f32, bf16, f16).
///
/// Arithmetic is IEEE single precision, lane by lane, with the rounding of
/// the scalar operation of the same name (`fmadd` rounds once).
pub(crate) trait Lanes: Copy {
    /// Lanes per vector.
    const N: usize;
    /// Vector registers of the instruction set (16 for AVX2, 32 for
    /// AVX-512): a kernel unrolls less where it would otherwise spill.
    const REGS: usize;
    /// The vector type.
    type V: Copy;
    /// Whether [`Lanes::store_bf16_pair`] can succeed at this width.
    const ROUNDS_BF16: bool;
    /// Whether loops at this width may ask for their output lines ahead of
    /// their stores ([`crate::simd::prefetch_write_ahead`] and
    /// `prefetch_write_below`): AVX-512, the only width where that was
    /// measured (sessions 61-62). Whether they do is
    /// [`Lanes::writes_ahead`].
    const WRITES_AHEAD: bool;

    /// Whether loops at this width ask for their output lines ahead:
    /// [`Lanes::WRITES_AHEAD`] on a CPU where that pays
    /// ([`crate::simd::writes_ahead`]: Intel's).
    #[inline(always)]
    fn writes_ahead() -> bool {
        Self::WRITES_AHEAD && crate::simd::writes_ahead()
    }

    /// Every lane `v`.
    fn splat(self, v: f32) -> Self::V;
    /// `N` values at `p` widened to f32 (exactly).
    ///
    /// # Safety
    /// `T` is f32, bf16 or f16; `p..p + N` is readable.
    unsafe fn load<T: 'static>(self, p: *const T) -> Self::V;
    /// The first `n < N` values at `p` widened to f32, the other lanes 0.
    ///
    /// # Safety
    /// `T` is f32, bf16 or f16; `p..p + n` is readable.
    unsafe fn load_part<T: 'static>(self, p: *const T, n: usize) -> Self::V;
    /// `2 N` values at `p` widened to f32 (exactly), as two vectors that
    /// hold them in an order of the width's choosing: for reductions whose
    /// result does not depend on the order (a maximum), and for bf16 pairs
    /// computed lane by lane and stored by
    /// [`Lanes::store_bf16_pair_normal_even_odd`]. bf16 takes two
    /// instructions for 32 values this way (the even values shifted up, the
    /// odd ones masked in place) where [`Lanes::load`] takes two for 16: at
    /// both widths, lane `k` of the first vector is value `2 k` and of the
    /// second value `2 k + 1`. f32 and f16 come in order.
    ///
    /// # Safety
    /// As [`Lanes::load`], for `p..p + 2 N`.
    #[inline(always)]
    unsafe fn load_pair_unordered<T: 'static>(self, p: *const T) -> (Self::V, Self::V) {
        // SAFETY: the caller's.
        unsafe { (self.load(p), self.load(p.add(Self::N))) }
    }
    /// Writes the `N` lanes to `p`.
    ///
    /// # Safety
    /// `p..p + N` is writable.
    unsafe fn store(self, p: *mut f32, v: Self::V);
    /// Writes the first `n < N` lanes to `p`.
    ///
    /// # Safety
    /// `p..p + n` is writable.
    unsafe fn store_part(self, p: *mut f32, v: Self::V, n: usize);
    /// Rounds `lo` then `hi` (`2 N` values) to bf16 at `p` with the CPU's
    /// conversion instruction, as [`crate::Element::from_acc`] rounds, and
    /// returns true; returns false, writing nothing, where a lane is an f32
    /// subnormal (which the instruction flushes to zero), or always where
    /// the width has no such instruction (`ROUNDS_BF16` false: AVX2).
    ///
    /// # Safety
    /// `p..p + 2 N` is writable.
    unsafe fn store_bf16_pair(self, p: *mut half::bf16, lo: Self::V, hi: Self::V) -> bool;
    /// [`Lanes::store_bf16_pair`] for values the caller knows are each 0,
    /// a normal f32 or infinite (no subnormal, no NaN), with no check and
    /// at every width: the conversion instruction where `ROUNDS_BF16` (a
    /// subnormal lane would be flushed to zero), else the integer round to
    /// nearest even, `(b + 0x7fff + (b >> 16 & 1)) >> 16`, and one pack (no
    /// NaN fix-up: a NaN lane could come out as another value). Either way
    /// a wrong rounding rather than undefined behaviour.
    ///
    /// # Safety
    /// `p..p + 2 N` is writable.
    unsafe fn store_bf16_pair_normal(self, p: *mut half::bf16, lo: Self::V, hi: Self::V);
    /// [`Lanes::store_bf16_pair_normal`] of `2 N` values held as
    /// [`Lanes::load_pair_unordered`] holds bf16: lane `k` of `even` is
    /// value `2 k`, lane `k` of `odd` value `2 k + 1`. AVX2 rounds each
    /// vector and blends the two halves of each 32-bit lane (where the
    /// order takes a pack and a lane-crossing permute); the default
    /// interleaves through the stack, for the widths that convert in
    /// hardware, whose callers keep the values in order.
    ///
    /// # Safety
    /// As [`Lanes::store_bf16_pair_normal`].
    #[inline(always)]
    unsafe fn store_bf16_pair_normal_even_odd(self, p: *mut half::bf16, even: Self::V, odd: Self::V) {
        let mut t = [0f32; 64];
        // SAFETY: `t` holds `2 N <= 64`; the caller makes `p..p + 2 N`
        // writable.
        unsafe {
            self.store(t.as_mut_ptr(), even);
            self.store(t.as_mut_ptr().add(Self::N), odd);
            even_odd::from_even_odd(&mut t[..2 * Self::N], 2 * Self::N);
            self.store_bf16_pair_normal(p, self.load(t.as_ptr()), self.load(t.as_ptr().add(Self::N)));
        }
    }

    /// `a + b`.
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a - b`.
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b`.
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, rounded once.
    fn fmadd(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `c - a * b`, rounded once.
    fn fnmadd(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `a > b ? a : b` (`vmaxps`): `b` where either is NaN.
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a < b ? a : b` (`vminps`): `b` where either is NaN.
    fn min(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a / b`.
    fn div(self, a: Self::V, b: Self::V) -> Self::V;
    /// `|v|` (the sign bit cleared, NaN stays NaN).
    fn abs(self, v: Self::V) -> Self::V;
    /// `mag`'s magnitude with `sign`'s sign bit, as `f32::copysign`.
    fn copysign(self, mag: Self::V, sign: Self::V) -> Self::V;
    /// `then` where `a >= b`, else `other` (`other` where either is NaN).
    fn select_ge(self, a: Self::V, b: Self::V, then: Self::V, other: Self::V) -> Self::V;
    /// `max(v, acc)` in the first `n < N` lanes, `acc` in the others.
    fn max_part(self, acc: Self::V, v: Self::V, n: usize) -> Self::V;
    /// `acc + v` in the first `n < N` lanes, `acc` in the others.
    fn add_part(self, acc: Self::V, v: Self::V, n: usize) -> Self::V;
    /// Each lane's bits shifted left by 23 (an integer in the low mantissa
    /// bits becomes the exponent field).
    fn shl23(self, v: Self::V) -> Self::V;
    /// `y * 2^n`, rounded once, for `n` a whole number; `pow2` is `2^n`
    /// made by the caller (from [`Lanes::shl23`]). AVX2 multiplies by
    /// `pow2`; AVX-512 scales by `n` (`vscalefps`, and `pow2` is left
    /// unused, so never computed). The two agree wherever `pow2` is `2^n`
    /// exactly, `n` in -126..=127 (not at 128, where `pow2` is
    /// `+inf`: [`math::Exp`] keeps its multiply for that).
    fn mul_pow2(self, y: Self::V, n: Self::V, pow2: Self::V) -> Self::V;
    /// `v` where `x` is not below `cutoff` (NaN included), else 0.
    fn zero_below(self, x: Self::V, cutoff: Self::V, v: Self::V) -> Self::V;
    /// `t - floor(t)` rounded once, to nearest (in `[0, 1]`; NaN for NaN).
    fn frac_floor(self, t: Self::V) -> Self::V;
    /// `y * 2^floor(t)`, rounded once, for `floor(t)` in -126..=127 (lanes
    /// outside may hold anything; callers clear them with
    /// [`Lanes::zero_below`]): AVX-512 scales by `t` itself (`vscalefps`
    /// takes the floor), AVX2 makes `2^floor(t)` from its bits and
    /// multiplies. The two agree wherever the product is a normal f32.
    fn mul_pow2_floor(self, y: Self::V, t: Self::V) -> Self::V;
    /// Each lane rounded to `T` (f32, bf16 or f16) and widened back: the
    /// value [`crate::Element::from_acc`] then `to_acc` gives, subnormals
    /// included (a NaN stays a NaN, not necessarily the same one). f32
    /// lanes come back unchanged. For the norms' rounding of `x / rms`
    /// before the weight (`rms_norm::Rounding::BeforeWeight`).
    fn round_to<T: 'static>(self, v: Self::V) -> Self::V;
    /// `a` and `b` each rounded to bf16 and widened back, the values
    /// [`Lanes::round_to`]`::<bf16>` gives: AVX-512 rounds the two with one
    /// `vcvtne2ps2bf16` where neither holds an f32 subnormal (which it
    /// flushes), in place of eight integer operations per vector.
    #[inline(always)]
    fn round_bf16_pair(self, a: Self::V, b: Self::V) -> (Self::V, Self::V) {
        (self.round_to::<half::bf16>(a), self.round_to::<half::bf16>(b))
    }
    /// The sum of the lanes (in a tree order).
    fn reduce_add(self, v: Self::V) -> f32;
    /// The largest lane (no lane may be NaN).
    fn reduce_max(self, v: Self::V) -> f32;
}

/// A kernel written once for every width: [`run`] calls `run` with the
/// CPU's best [`Lanes`]. Implementations mark `run` `#[inline(always)]`.
pub(crate) trait Kernel {
    /// What the kernel returns.
    type Output;
    /// The kernel's body at width `L`.
    fn run<L: Lanes>(self, l: L) -> Self::Output;
}

/// `count <= N` values at `p + i`, widened (the other lanes 0): a whole
/// vector when `count` is `N`, else a part.
///
/// # Safety
/// `p.add(i)..p.add(i + count)` is readable; `T` is f32, bf16 or f16.
#[inline(always)]
pub(crate) unsafe fn load_n<L: Lanes, T: 'static>(l: L, p: *const T, i: usize, count: usize) -> L::V {
    // SAFETY: the caller's.
    unsafe {
        if count == L::N {
            l.load(p.add(i))
        } else {
            l.load_part(p.add(i), count)
        }
    }
}

/// The first `count <= N` lanes of `v` to `p + i`.
///
/// # Safety
/// `p.add(i)..p.add(i + count)` is writable.
#[inline(always)]
pub(crate) unsafe fn store_n<L: Lanes>(l: L, p: *mut f32, i: usize, v: L::V, count: usize) {
    // SAFETY: the caller's.
    unsafe {
        if count == L::N {
            l.store(p.add(i), v)
        } else {
            l.store_part(p.add(i), v, count)
        }
    }
}

/// Columns `0..cols`: `step(i, count)` for each whole vector (`count` =
/// `N`) and for the last `count < N` values. The column walk of the grouped
/// norm backwards; pass an `#[inline(always)]` closure, so that it is
/// compiled inside the caller's vector features.
#[inline(always)]
pub(crate) fn walk_columns<L: Lanes>(cols: usize, mut step: impl FnMut(usize, usize)) {
    let mut i = 0;
    while i + L::N <= cols {
        step(i, L::N);
        i += L::N;
    }
    if i < cols {
        step(i, cols - i);
    }
}

/// Runs `k` with 16-lane AVX-512 vectors where the CPU has
/// [`crate::simd::has_v4_bf16`]'s features, else with 8-lane AVX2 ones where
/// it has AVX2, FMA and F16C; `None` (without running it) on other CPUs.
#[inline(always)]
pub(crate) fn run<K: Kernel>(k: K) -> Option<K::Output> {
    if let Some(l) = V16::try_new() {
        return Some(run_with(l, k));
    }
    V8::try_new().map(|l| run_with(l, k))
}

/// Runs `k` at the width of `l` (the tests run every width the CPU has).
#[inline(always)]
pub(crate) fn run_with<L: Width, K: Kernel>(l: L, k: K) -> K::Output {
    l.enter(k)
}

/// Runs `$f(l)` (a function generic over [`Width`]) with each width this
/// CPU has, not only the best, and prints which are skipped: the tests' way
/// of checking every width's code on a CPU that has it.
#[cfg(test)]
macro_rules! every_width {
    ($f:expr) => {{
        use $crate::wide::x86::{V16, V8};
        match V8::try_new() {
            Some(l) => $f(l),
            None => println!("skipped AVX2: this CPU lacks AVX2, FMA or F16C, or KEEL_CPU_CAPABILITY is below avx2"),
        }
        match V16::try_new() {
            Some(l) => $f(l),
            None => println!("skipped AVX-512: this CPU lacks has_v4_bf16's features (or KEEL_CPU_CAPABILITY is below avx512), so V16 never runs here"),
        }
    }};
}
#[cfg(test)]
pub(crate) use every_width;

/// A [`Lanes`] that can enter code compiled for its features.
pub(crate) trait Width: Lanes {
    /// Calls `k.run(self)` from a function compiled for this width's
    /// features.
    fn enter<K: Kernel>(self, k: K) -> K::Output;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every lane of `v`, through `store`.
    fn lanes<L: Lanes>(l: L, v: L::V) -> Vec<f32> {
        let mut out = vec![f32::NAN; L::N];
        // SAFETY: `out` holds `N` values.
        unsafe { l.store(out.as_mut_ptr(), v) };
        out
    }

    /// The operations against scalar f32 arithmetic, lane by lane, at one
    /// width.
    struct Ops;
    impl Kernel for Ops {
        type Output = ();
        #[inline(always)]
        fn run<L: Lanes>(self, l: L) {
            let n = L::N;
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 1.25 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 2.5 - i as f32 * 0.5).collect();
            let c: Vec<f32> = (0..n).map(|i| (i as f32).sqrt()).collect();
            // SAFETY: each vector holds `N` values.
            let (va, vb, vc) = unsafe { (l.load(a.as_ptr()), l.load(b.as_ptr()), l.load(c.as_ptr())) };
            let each = |f: fn(f32, f32, f32) -> f32| (0..n).map(|i| f(a[i], b[i], c[i])).collect::<Vec<_>>();
            assert_eq!(lanes(l, l.add(va, vb)), each(|a, b, _| a + b));
            assert_eq!(lanes(l, l.sub(va, vb)), each(|a, b, _| a - b));
            assert_eq!(lanes(l, l.mul(va, vb)), each(|a, b, _| a * b));
            assert_eq!(lanes(l, l.fmadd(va, vb, vc)), each(|a, b, c| a.mul_add(b, c)));
            assert_eq!(lanes(l, l.fnmadd(va, vb, vc)), each(|a, b, c| (-a).mul_add(b, c)));
            assert_eq!(lanes(l, l.max(va, vb)), each(|a, b, _| if a > b { a } else { b }));
            assert_eq!(lanes(l, l.min(va, vb)), each(|a, b, _| if a < b { a } else { b }));
            assert_eq!(lanes(l, l.div(va, vc)), each(|a, _, c| a / c));
            assert_eq!(lanes(l, l.abs(va)), each(|a, _, _| a.abs()));
            assert_eq!(lanes(l, l.copysign(vc, vb)), each(|_, b, c| c.copysign(b)));
            assert_eq!(lanes(l, l.select_ge(va, vb, vc, va)), each(|a, b, c| if a >= b { c } else { a }));
            // NaN in either operand gives the second, for both.
            let nan = l.splat(f32::NAN);
            assert!(lanes(l, l.max(va, nan)).iter().all(|v| v.is_nan()));
            assert_eq!(lanes(l, l.min(nan, va)), a);
            assert_eq!(lanes(l, l.select_ge(nan, va, vb, vc)), c);
            assert_eq!(lanes(l, l.select_ge(va, nan, vb, vc)), c);
            let (neg0, negnan) = (l.splat(-0.0), l.splat(-f32::NAN));
            assert!(lanes(l, l.abs(neg0)).iter().all(|v| v.to_bits() == 0));
            assert!(lanes(l, l.abs(negnan)).iter().all(|v| v.is_nan() && v.is_sign_positive()));
            assert!(lanes(l, l.copysign(va, neg0)).iter().zip(&a).all(|(v, a)| *v == -a.abs()));
            for k in 0..n {
                let want = |f: fn(f32, f32) -> f32| {
                    (0..n).map(|i| if i < k { f(a[i], b[i]) } else { a[i] }).collect::<Vec<_>>()
                };
                assert_eq!(lanes(l, l.max_part(va, vb, k)), want(|a, b| if b > a { b } else { a }), "k={k}");
                assert_eq!(lanes(l, l.add_part(va, vb, k)), want(|a, b| a + b), "k={k}");
                // SAFETY: `k < N` values are read and written.
                let part = unsafe { l.load_part(b.as_ptr(), k) };
                let want: Vec<f32> = (0..n).map(|i| if i < k { b[i] } else { 0.0 }).collect();
                assert_eq!(lanes(l, part), want, "load_part k={k}");
                let mut out = vec![7.0f32; n];
                // SAFETY: `out` holds `N > k` values.
                unsafe { l.store_part(out.as_mut_ptr(), vb, k) };
                assert_eq!(out, (0..n).map(|i| if i < k { b[i] } else { 7.0 }).collect::<Vec<_>>());
            }
            let ints: Vec<f32> = (0..n).map(|i| f32::from_bits(127 + i as u32)).collect();
            // SAFETY: as above.
            let shifted = lanes(l, l.shl23(unsafe { l.load(ints.as_ptr()) }));
            assert_eq!(shifted, (0..n).map(|i| (2.0f32).powi(i as i32)).collect::<Vec<_>>());
            // Normal and subnormal products (rounded once), and 1 * 2^127.
            let ys: Vec<f32> = (0..n).map(|i| 0.7 + 0.05 * i as f32).collect();
            let ns: Vec<f32> = (0..n).map(|i| [-126.0, -3.0, 0.0, 127.0][i % 4]).collect();
            let pow2: Vec<f32> = ns.iter().map(|&n| 2f32.powi(n as i32)).collect();
            // SAFETY: as above.
            let (vy, vn, vp) = unsafe { (l.load(ys.as_ptr()), l.load(ns.as_ptr()), l.load(pow2.as_ptr())) };
            let want: Vec<f32> = ys.iter().zip(&pow2).map(|(y, p)| y * p).collect();
            assert_eq!(lanes(l, l.mul_pow2(vy, vn, vp)), want);
            assert!(want[0] < f32::MIN_POSITIVE && want[0] > 0.0);
            // Fractions and `2^floor(t)` at whole numbers, either side of
            // them, and at the ends of the range; NaN stays NaN.
            let ts: Vec<f32> = (0..n).map(|i| [-125.75, -3.0, -0.25, 0.0, 0.5, -1e-7, 126.99, -2.5][i % 8]).collect();
            // SAFETY: as above.
            let vt = unsafe { l.load(ts.as_ptr()) };
            assert_eq!(lanes(l, l.frac_floor(vt)), ts.iter().map(|t| t - t.floor()).collect::<Vec<_>>());
            let scaled: Vec<f32> = ys.iter().zip(&ts).map(|(y, t)| y * 2f32.powi(t.floor() as i32)).collect();
            assert_eq!(lanes(l, l.mul_pow2_floor(vy, vt)), scaled);
            assert!(lanes(l, l.frac_floor(nan)).iter().all(|v| v.is_nan()));
            let x: Vec<f32> = (0..n).map(|i| [f32::NAN, -1.0, 1.0, -5.0][i % 4]).collect();
            // SAFETY: as above.
            let z = lanes(l, l.zero_below(unsafe { l.load(x.as_ptr()) }, l.splat(-2.0), vc));
            assert_eq!(z, (0..n).map(|i| if x[i] < -2.0 { 0.0 } else { c[i] }).collect::<Vec<_>>());
            assert_eq!(l.reduce_add(va), a.iter().sum::<f32>());
            assert_eq!(l.reduce_max(vb), 2.5);
            // The pair loads hold the same `2 N` values as two loads.
            let many: Vec<f32> = (0..2 * n).map(|i| i as f32 * 1.25 - 7.0).collect();
            let many_bf16: Vec<half::bf16> = many.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let many_f16: Vec<half::f16> = many.iter().map(|&v| half::f16::from_f32(v)).collect();
            fn sorted<L: Lanes>(l: L, (a, b): (L::V, L::V)) -> Vec<f32> {
                let mut v = [lanes(l, a), lanes(l, b)].concat();
                v.sort_by(f32::total_cmp);
                v
            }
            // SAFETY: `2 N` values each.
            unsafe {
                assert_eq!(sorted(l, l.load_pair_unordered(many.as_ptr())), many);
                assert_eq!(sorted(l, l.load_pair_unordered(many_bf16.as_ptr())), many);
                assert_eq!(sorted(l, l.load_pair_unordered(many_f16.as_ptr())), many);
            }
            // bf16 pairs: lane `k` of the two vectors is value `2 k` and
            // `2 k + 1`, which the even/odd store puts back in place; its
            // rounding is `from_acc`'s, ties (to even, both ways) included.
            let low = [0x8000_u32, 0x7fff, 0x8001, 0, 0xffff];
            let ties: Vec<f32> = (0..2 * n)
                .map(|i| f32::from_bits(0xbf80_0000 ^ (i as u32 % 3) << 31 | (i as u32 % 7) << 16 | low[i % 5]))
                .collect();
            let (mut back, mut rounded) = (vec![half::bf16::ZERO; 2 * n], vec![half::bf16::ZERO; 2 * n]);
            let even: Vec<f32> = ties.iter().step_by(2).copied().collect();
            let odd: Vec<f32> = ties.iter().skip(1).step_by(2).copied().collect();
            // SAFETY: `2 N` values each, `N` in `even` and `odd`.
            unsafe {
                let (a, b) = l.load_pair_unordered(many_bf16.as_ptr());
                assert_eq!(
                    (lanes(l, a), lanes(l, b)),
                    (many[0..].iter().step_by(2).copied().collect(), many[1..].iter().step_by(2).copied().collect())
                );
                l.store_bf16_pair_normal_even_odd(back.as_mut_ptr(), a, b);
                l.store_bf16_pair_normal_even_odd(rounded.as_mut_ptr(), l.load(even.as_ptr()), l.load(odd.as_ptr()));
            }
            assert_eq!(back, many_bf16);
            assert_eq!(rounded, ties.iter().map(|&v| <half::bf16 as crate::Element>::from_acc(v)).collect::<Vec<_>>());
            for (t, bits) in [(0usize, 0x3fc0_u16), (1, 0xc0a0)] {
                let v = vec![half::bf16::from_bits(bits); n];
                let h = vec![half::f16::from_f32(half::bf16::from_bits(bits).to_f32()); n];
                // SAFETY: `N` values each.
                let (vb16, vh) = unsafe { (l.load(v.as_ptr()), l.load(h.as_ptr())) };
                let want = vec![half::bf16::from_bits(bits).to_f32(); n];
                assert_eq!(lanes(l, vb16), want, "bf16 {t}");
                assert_eq!(lanes(l, vh), want, "f16 {t}");
            }
        }
    }

    /// `round_to` against `half`'s rounding, bit for bit (any NaN for a
    /// NaN): every f32 whose low 16 bits are one of a few patterns (ties to
    /// even both ways, just above and below a tie, 0 and all ones), which
    /// covers each exponent, subnormals, infinities and NaN, for bf16 and
    /// f16; f32 comes back unchanged. `round_bf16_pair` likewise.
    struct RoundTo;
    impl Kernel for RoundTo {
        type Output = ();
        #[inline(always)]
        fn run<L: Lanes>(self, l: L) {
            let bits = |v: f32| if v.is_nan() { u32::MAX } else { v.to_bits() };
            let low = [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234, 0x4000];
            let all: Vec<f32> =
                (0..=0xffffu32).flat_map(|high| low.map(|lo| f32::from_bits(high << 16 | lo))).collect();
            for v in all.chunks_exact(L::N) {
                // SAFETY: `N` values.
                let x = unsafe { l.load(v.as_ptr()) };
                let want_bf16: Vec<u32> = v.iter().map(|&v| bits(half::bf16::from_f32(v).to_f32())).collect();
                let want_f16: Vec<u32> = v.iter().map(|&v| bits(half::f16::from_f32(v).to_f32())).collect();
                let got = |r: L::V| lanes(l, r).into_iter().map(bits).collect::<Vec<_>>();
                assert_eq!(got(l.round_to::<half::bf16>(x)), want_bf16, "bf16 {v:?}");
                assert_eq!(got(l.round_to::<half::f16>(x)), want_f16, "f16 {v:?}");
                assert_eq!(got(l.round_to::<f32>(x)), v.iter().map(|&v| bits(v)).collect::<Vec<_>>());
            }
            // Pairs: the subnormals (high halves 0..0x80) sit in a few
            // pairs, which take the integer round; the rest, NaN and
            // infinities among them, the hardware conversion.
            for v in all.chunks_exact(2 * L::N) {
                // SAFETY: `2 N` values.
                let (a, b) = unsafe { (l.load(v.as_ptr()), l.load(v.as_ptr().add(L::N))) };
                let want: Vec<u32> = v.iter().map(|&v| bits(half::bf16::from_f32(v).to_f32())).collect();
                let (ra, rb) = l.round_bf16_pair(a, b);
                let got: Vec<u32> = lanes(l, ra).into_iter().chain(lanes(l, rb)).map(bits).collect();
                assert_eq!(got, want, "bf16 pair {v:?}");
            }
        }
    }

    #[test]
    fn round_to_rounds_as_half_at_every_width() {
        fn round<L: Width>(l: L) {
            run_with(l, RoundTo)
        }
        every_width!(round);
    }

    #[test]
    fn every_width_computes_as_scalar_f32() {
        fn ops<L: Width>(l: L) {
            run_with(l, Ops)
        }
        every_width!(ops);
    }
}
