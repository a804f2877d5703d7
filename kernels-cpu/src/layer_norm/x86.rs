//! layer_norm's forward in explicit SIMD, written once for AVX-512 and AVX2
//! ([`crate::wide`]): the shifted sums of the moments, then the normalised
//! and scaled row, which also prefetches the next row.
//!
//! The lane loops in `layer_norm.rs` left both passes to LLVM, and on an
//! AVX2 CPU (no AVX-512) layer_norm bf16 through torch took 1.3x
//! rms_norm's time and missed its 1.3x over `F.layer_norm`; perf put a
//! third of the time on the first read of each row, stalled on memory.
//! Here every step is full width, one `enter` runs a whole block of rows,
//! and the write pass asks for the next row's lines as it goes. criterion,
//! 4096x4096 forward, on that CPU: bf16 4.1-4.6 -> 3.4 ms, f16 8.3 -> 2.9 ms
//! (the lane loop's f16 widening was the cost there), f32 unchanged (bound
//! by memory). Rounding bf16 in registers instead of through the scratch
//! block was tried: 3.75 against 3.39 ms. With AVX-512's bf16 conversion it
//! is faster (see `write_bf16_pairs`), so bf16 rows round in registers there.
//!
//! The values are those of the lane loops' formulas, in their order for each
//! element (`x - k` exact, then the two fused multiply-adds of the affine
//! case, or `((x - k) - m1) * rstd` then the parameter); only the order of the
//! moments' sums differs (four vector accumulators of each, a part vector
//! last, then a tree over the lanes), within f32 accumulation error.
use super::{shift, Moments};
use crate::element::{Acc, Element};
use crate::narrow::BLOCK;
use crate::rows::row_and_next;
use crate::simd::{prefetch_part, sum_pairs};
use crate::wide::cast_mut;
use crate::wide::x86::{load_n as load, Kernel, Lanes};
use half::bf16;

/// The forward over whole rows of `cols`: `x` and `y` of one length, `w` and
/// `b` (when given) of `cols`. For `T` in f32, bf16, f16 only (the callers
/// check [`crate::wide::has_lanes`]).
pub(super) struct Forward<'a, T> {
    pub(super) x: &'a [T],
    pub(super) w: Option<&'a [T]>,
    pub(super) b: Option<&'a [T]>,
    pub(super) y: &'a mut [T],
    pub(super) cols: usize,
    pub(super) eps: f32,
}

impl<T: Element> Kernel for Forward<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Forward { x, w, b, y, cols, eps } = self;
        for (r, y) in y.chunks_exact_mut(cols).enumerate() {
            let (xr, ahead) = row_and_next(x, r, cols);
            let m = moments(l, xr, eps);
            write_row(l, xr, w, b, y, m, ahead);
        }
    }
}

/// The row's [`Moments`]: the shifted sums of `layer_norm::moments` in
/// vectors, and its exact second pass where those would lose accuracy.
#[inline(always)]
fn moments<L: Lanes, T: Element>(l: L, x: &[T], eps: f32) -> Moments<f32> {
    let n = x.len() as f32;
    let k = shift(x).to_f64() as f32;
    let (s1, s2) = shifted_sums(l, x, k);
    let (m1, m2) = (s1 / n, s2 / n);
    let var = if m1 * m1 <= 0.5 * m2 {
        m2 - m1 * m1
    } else {
        let (k, m1) = (T::Acc::from_f64(k.into()), T::Acc::from_f64(m1.into()));
        (sum_pairs(x, x, |a, _| (a - k - m1) * (a - k - m1)).to_f64() as f32) / n
    };
    Moments { k, m1, rstd: 1.0 / (var + eps).sqrt() }
}

/// `(sum(x - k), sum((x - k)^2))`: four vector accumulators of each over
/// groups of four vectors, then whole vectors, then a part vector (its other
/// lanes load as 0, and `0 - k` is masked off by a part add).
#[inline(always)]
fn shifted_sums<L: Lanes, T: 'static>(l: L, x: &[T], k: f32) -> (f32, f32) {
    let (p, len, n) = (x.as_ptr(), x.len(), L::N);
    let kv = l.splat(k);
    let (mut a1, mut a2) = ([l.splat(0.0); 4], [l.splat(0.0); 4]);
    let mut at = 0;
    // SAFETY (loads): `at + n j + n <= len` in the first loop; the second
    // reads whole vectors while they fit, then the `len - at < n` values
    // left; `T` is f32, bf16 or f16 (the callers check).
    unsafe {
        while at + 4 * n <= len {
            for j in 0..4 {
                let v = l.sub(l.load(p.add(at + n * j)), kv);
                a1[j] = l.add(a1[j], v);
                a2[j] = l.fmadd(v, v, a2[j]);
            }
            at += 4 * n;
        }
        let mut j = 0;
        while at + n <= len {
            let v = l.sub(l.load(p.add(at)), kv);
            a1[j] = l.add(a1[j], v);
            a2[j] = l.fmadd(v, v, a2[j]);
            at += n;
            j += 1;
        }
        if at < len {
            let part = len - at;
            let v = l.sub(l.load_part(p.add(at), part), kv);
            a1[j] = l.add_part(a1[j], v, part);
            a2[j] = l.add_part(a2[j], l.mul(v, v), part);
        }
    }
    (reduce4(l, a1), reduce4(l, a2))
}

/// The per-row constants of [`write_row`], as vectors.
#[derive(Clone, Copy)]
struct Consts<V> {
    k: V,
    m1: V,
    rstd: V,
    /// `-m1 rstd`, the affine case's first addend.
    nb: V,
}

/// The sum of the lanes of four vectors.
#[inline(always)]
fn reduce4<L: Lanes>(l: L, a: [L::V; 4]) -> f32 {
    l.reduce_add(l.add(l.add(a[0], a[1]), l.add(a[2], a[3])))
}

/// `y = xh * w + b` (each parameter when given) through `T::write_acc`:
/// straight into `y` for f32, else block by block into an f32 scratch that
/// is then narrowed.
#[inline(always)]
fn write_row<L: Lanes, T: Element>(
    l: L,
    x: &[T],
    w: Option<&[T]>,
    b: Option<&[T]>,
    y: &mut [T],
    m: Moments<f32>,
    ahead: &[T],
) {
    let c = Consts { k: l.splat(m.k), m1: l.splat(m.m1), rstd: l.splat(m.rstd), nb: l.splat(0.0 - m.m1 * m.rstd) };
    // bf16 rows round in registers where the width can; the block path
    // below writes what is left (all of it for other types).
    let (y, at0) = match cast_mut::<T, bf16>(y) {
        Some(yb) => {
            let done = write_bf16_pairs(l, c, (x, w, b), yb, ahead);
            (&mut cast_mut::<bf16, T>(yb).expect("layer_norm x86: T is bf16")[done..], done)
        }
        None => (y, 0),
    };
    let (x, w, b) = (&x[at0..], w.map(|w| &w[at0..]), b.map(|b| &b[at0..]));
    T::write_acc(
        y,
        #[inline(always)]
        |at, out| {
            prefetch_part::<T, false>(ahead, (at0 + at) / BLOCK, BLOCK);
            let out = cast_mut::<T::Acc, f32>(out).expect("layer_norm x86: T::Acc is f32 for f32, bf16, f16");
            let len = out.len();
            let x = x[at..][..len].as_ptr();
            let (w, b) = (w.map(|w| w[at..][..len].as_ptr()), b.map(|b| b[at..][..len].as_ptr()));
            let o = out.as_mut_ptr();
            let mut i = 0;
            // SAFETY: whole vectors while they fit in `out` (and in `x`, `w`,
            // `b`, which hold `len` values from here), then the `len - i < N`
            // values left; `T` is f32, bf16 or f16.
            unsafe {
                while i + L::N <= len {
                    l.store(o.add(i), value(l, c, (x, w, b), i, L::N));
                    i += L::N;
                }
                if i < len {
                    l.store_part(o.add(i), value(l, c, (x, w, b), i, len - i), len - i);
                }
            }
        },
    );
}

/// bf16 rows rounded in registers ([`Lanes::store_bf16_pair`]): `y`'s
/// first whole groups of `2 N` values, prefetching `ahead` as the block path
/// does; returns how many values it wrote (0 where the width has no bf16
/// conversion: AVX2). A group with an f32 subnormal is rounded in software,
/// as [`Element::from_acc`] does.
///
/// The block path (f32 values stored to a scratch block, then narrowed)
/// costs two stores and two loads more per `2 N` values: criterion,
/// 4096x4096 on the Xeon (Emerald Rapids), one thread, 4.66-5.10 ->
/// 4.00-4.09 ms; through torch with THP, 1.22-1.24x -> 1.18x a clone of `x`
/// (alternated runs).
#[inline(always)]
fn write_bf16_pairs<L: Lanes, T: 'static>(
    l: L,
    c: Consts<L::V>,
    (x, w, b): (&[T], Option<&[T]>, Option<&[T]>),
    y: &mut [bf16],
    ahead: &[T],
) -> usize {
    if !L::ROUNDS_BF16 {
        return 0;
    }
    let (n, len) = (2 * L::N, y.len());
    let whole = len / n * n;
    let (xp, wp, bp) = (x.as_ptr(), w.map(<[T]>::as_ptr), b.map(<[T]>::as_ptr));
    assert!(x.len() >= len && w.is_none_or(|w| w.len() >= len) && b.is_none_or(|b| b.len() >= len));
    let mut i = 0;
    while i < whole {
        if i % BLOCK == 0 {
            prefetch_part::<T, false>(ahead, i / BLOCK, BLOCK);
        }
        // SAFETY: `i + 2 N <= len`, and `x`, `w`, `b` hold at least `len`
        // values (asserted); `T` is f32, bf16 or f16 (the callers check);
        // `y[i..i + 2 N]` is writable.
        unsafe {
            let (lo, hi) = (value(l, c, (xp, wp, bp), i, L::N), value(l, c, (xp, wp, bp), i + L::N, L::N));
            if !l.store_bf16_pair(y.as_mut_ptr().add(i), lo, hi) {
                let mut t = [0f32; 64];
                l.store(t.as_mut_ptr(), lo);
                l.store(t.as_mut_ptr().add(L::N), hi);
                for (y, &t) in y[i..i + n].iter_mut().zip(&t) {
                    *y = bf16::from_acc(t);
                }
            }
        }
        i += n;
    }
    whole
}

/// One vector of output from the `count <= N` values at offset `i` of `x`,
/// `w`, `b` (a part vector when `count < N`: its other lanes are unused).
/// A function, not a closure: a closure left out of line runs without the
/// vector features (10x slower, measured).
///
/// # Safety
/// `p.add(i)..p.add(i + count)` is readable for each pointer given; `T` is
/// f32, bf16 or f16.
#[inline(always)]
unsafe fn value<L: Lanes, T: 'static>(
    l: L,
    c: Consts<L::V>,
    (x, w, b): (*const T, Option<*const T>, Option<*const T>),
    i: usize,
    count: usize,
) -> L::V {
    // SAFETY: the caller's.
    let d = l.sub(unsafe { load(l, x, i, count) }, c.k);
    // SAFETY: as above.
    unsafe {
        match (w, b) {
            (Some(w), Some(b)) => l.fmadd(l.fmadd(d, c.rstd, c.nb), load(l, w, i, count), load(l, b, i, count)),
            (Some(w), None) => l.mul(l.mul(l.sub(d, c.m1), c.rstd), load(l, w, i, count)),
            (None, Some(b)) => l.add(l.mul(l.sub(d, c.m1), c.rstd), load(l, b, i, count)),
            (None, None) => l.mul(l.sub(d, c.m1), c.rstd),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Forward;
    use crate::element::Element;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::bf16;

    /// bf16 rows give the f32 kernel's values on the widened inputs, each
    /// rounded by `from_acc`, bit for bit: through the pairs rounded in
    /// registers, the groups with a subnormal (rounded in software), and the
    /// tail's block. Rows far from zero take the exact second pass.
    #[test]
    fn bf16_rows_are_the_f32_rows_rounded_at_every_width() {
        fn check<L: Width>(l: L) {
            for cols in [1usize, 16, 31, 32, 33, 100, 128, 300] {
                let rows = 5;
                let n = rows * cols;
                let x: Vec<bf16> = (0..n)
                    .map(|i| {
                        let v = ((i * 37 % 101) as f32 - 50.0) / 13.0;
                        bf16::from_acc(if (i / cols) % 3 == 2 { 1000.0 + v / 64.0 } else { v })
                    })
                    .collect();
                // Tiny weights in row 1: outputs below f32's normal range.
                let w: Vec<bf16> = (0..cols).map(|j| bf16::from_acc(0.5 + (j % 7) as f32 / 8.0)).collect();
                let b: Vec<bf16> = (0..cols).map(|j| bf16::from_acc((j % 5) as f32 / 4.0 - 0.5)).collect();
                let tiny: Vec<bf16> = (0..cols).map(|j| bf16::from_bits(0x0080 + (j % 3) as u16)).collect();
                let wide = |v: &[bf16]| v.iter().map(|v| v.to_acc()).collect::<Vec<f32>>();
                for (w, b) in [(Some(&w[..]), Some(&b[..])), (Some(&tiny[..]), None), (None, None)] {
                    let mut y = vec![bf16::ZERO; n];
                    run_with(l, Forward { x: &x, w, b, y: &mut y, cols, eps: 1e-5 });
                    let (x32, w32, b32) = (wide(&x), w.map(wide), b.map(wide));
                    let mut y32 = vec![0f32; n];
                    let k = Forward { x: &x32, w: w32.as_deref(), b: b32.as_deref(), y: &mut y32, cols, eps: 1e-5 };
                    run_with(l, k);
                    let want: Vec<u16> = y32.iter().map(|&v| bf16::from_acc(v).to_bits()).collect();
                    let got: Vec<u16> = y.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "cols={cols} weight={} bias={}", w.is_some(), b.is_some());
                }
            }
        }
        every_width!(check);
    }
}
