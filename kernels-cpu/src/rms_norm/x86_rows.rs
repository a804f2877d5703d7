//! rms_norm's backward row by row in explicit SIMD, written once for
//! AVX-512 and AVX2 ([`crate::wide`]), for f16 and bf16 rows read as they
//! lie: every case of [`super::backward_row`] (with or without a weight,
//! its gradient, and fused_add_rms_norm's `grad_add`).
//!
//! For f16 it replaces the widening of each row into f32 scratch rows
//! ([`crate::widen`]) before the lane loop, which kept up to four f32 rows
//! (x, dy, grad_add, the weight) beside the f32 `dw` partial: at 4096
//! columns more than L1 holds. Here the loads widen as they go (F16C for
//! f16), so a row's working set is its 16-bit rows and `dw`. For bf16 it
//! replaces the lane loop. criterion on an AVX-512 Xeon (4096x4096, old
//! and new alternated, three rounds): f16 rms_norm 6.44-6.59 -> 3.78-3.96
//! ms and fused_add_rms_norm 9.57-9.90 -> 4.42-4.94; bf16 4.18-4.39 ->
//! 3.59-3.96 and 5.07-5.28 -> 4.25-4.88 (held to AVX2 on the same CPU,
//! bf16: 5.64-5.91 -> 4.97-5.00 and 6.67-6.95 -> 5.60-5.74, so both widths
//! take it). f32 keeps the grouped kernel in
//! the training case (`x86_backward.rs`) and the lane loop otherwise: there
//! this kernel measured slower (fused_add_rms_norm f32 4096x4096 11.6-12.4
//! -> 15.8-16.0 ms).
//!
//! Per row: `sum(x^2)` and `sum(g x)` (`g = dy w`, or `dy`) in one pass
//! with fused multiply-adds in two accumulators each, so `r = 1 / rms` and
//! `c = r^3 sum(g x) / n` may differ from the lane loop's in their last
//! bits; then every element takes the lane loop's operations in its order
//! (`dx = (r dy) w - x c (+ add)`, `dw += (dy x) r`), rounded to `T` by
//! [`Element::write_acc`]. The tests compare with the lane loop bit for bit
//! on rows whose sums are exact, and with an f64 reference otherwise.
use super::{consts_from_sums, strided_row_and_next};
use crate::element::Element;
use crate::layout::Offsets;
use crate::rows::row_and_next;
use crate::simd::prefetching;
use crate::wide::cast_mut;
use crate::wide::x86::{load_n, store_n, Kernel, Lanes};

/// The backward of the rows of `dx` (`cols` each): row `k` of `x` at the
/// `k`-th offset of `ox` (which is stepped past them); `dy`, `add` and `dx`
/// contiguous; `w` and `dw` of `cols`, `dw` added to (given only with `w`).
/// `T` is f32, bf16 or f16 (callers pass f16 and bf16).
pub(super) struct Rows<'a, T> {
    pub(super) x: &'a [T],
    pub(super) ox: &'a mut Offsets,
    pub(super) dy: &'a [T],
    pub(super) add: Option<&'a [T]>,
    pub(super) w: Option<&'a [T]>,
    pub(super) dx: &'a mut [T],
    pub(super) dw: Option<&'a mut [f32]>,
    pub(super) cols: usize,
    pub(super) eps: f32,
}

impl<T: Element> Kernel for Rows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Rows { x, ox, dy, add, w, dx, mut dw, cols, eps } = self;
        assert!(cols > 0 && dy.len() == dx.len() && dx.len() % cols == 0, "rms_norm x86 rows: dy, dx");
        assert!(add.is_none_or(|a| a.len() == dx.len()), "rms_norm x86 rows: add");
        assert!(w.is_none_or(|w| w.len() == cols), "rms_norm x86 rows: w");
        assert!(dw.as_ref().is_none_or(|d| d.len() == cols && w.is_some()), "rms_norm x86 rows: dw");
        let rows = dx.len() / cols;
        for (r, dx) in dx.chunks_exact_mut(cols).enumerate() {
            let (x, next_x) = strided_row_and_next(x, ox, r + 1 < rows, cols);
            let (dy, next_dy) = row_and_next(dy, r, cols);
            let add = add.map(|a| &a[r * cols..][..cols]);
            let (sum_sq, gx) = sums(l, x, dy, w);
            let (rr, c) = consts_from_sums(sum_sq, gx, cols, eps);
            let (rv, cv) = (l.splat(rr), l.splat(c));
            let ptrs = Ptrs { x: x.as_ptr(), dy: dy.as_ptr(), add: add.map(<[T]>::as_ptr), w: w.map(<[T]>::as_ptr) };
            let dw = dw.as_deref_mut().map(<[f32]>::as_mut_ptr);
            // Part by part, prefetching the next row, as the lane loop.
            prefetching(
                dx,
                &[next_x, next_dy],
                #[inline(always)]
                |k, dx| {
                    T::write_acc(
                        dx,
                        #[inline(always)]
                        |at, out| {
                            let out = cast_mut::<T::Acc, f32>(out).expect("rms_norm x86 rows: T::Acc is f32");
                            // SAFETY: `out` is `dx[k + at..]` widened, and
                            // every pointer holds the row's `cols` values.
                            unsafe { part(l, ptrs, dw, rv, cv, k + at, out) };
                        },
                    )
                },
            );
        }
    }
}

/// One row's inputs.
struct Ptrs<T> {
    x: *const T,
    dy: *const T,
    add: Option<*const T>,
    w: Option<*const T>,
}

// Not derived: the derive would ask `T: Copy`.
impl<T> Clone for Ptrs<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Ptrs<T> {}

/// `(sum(x^2), sum(g x))` over one row, `g = dy w` (or `dy` without a
/// weight): two accumulators of fused multiply-adds for each (the zero lanes
/// of a part vector add nothing), then a tree.
#[inline(always)]
fn sums<L: Lanes, T: 'static>(l: L, x: &[T], dy: &[T], w: Option<&[T]>) -> (f32, f32) {
    let (len, n) = (x.len(), L::N);
    assert!(dy.len() == len && w.is_none_or(|w| w.len() == len), "rms_norm x86 sums: lengths");
    let (px, pdy, pw) = (x.as_ptr(), dy.as_ptr(), w.map(<[T]>::as_ptr));
    let zero = l.splat(0.0);
    let (mut sq, mut gx) = ([zero; 2], [zero; 2]);
    let mut at = 0;
    // SAFETY: `at + 2n <= len`, then `at + n <= len`, then the `len - at <
    // n` values left, of `x`, `dy` and `w` (`len` each); `T` is f32, bf16
    // or f16.
    unsafe {
        while at + 2 * n <= len {
            let (x0, x1) = (l.load(px.add(at)), l.load(px.add(at + n)));
            sq[0] = l.fmadd(x0, x0, sq[0]);
            sq[1] = l.fmadd(x1, x1, sq[1]);
            gx[0] = l.fmadd(g(l, pdy, pw, at, n), x0, gx[0]);
            gx[1] = l.fmadd(g(l, pdy, pw, at + n, n), x1, gx[1]);
            at += 2 * n;
        }
        if at + n <= len {
            let x0 = l.load(px.add(at));
            sq[0] = l.fmadd(x0, x0, sq[0]);
            gx[0] = l.fmadd(g(l, pdy, pw, at, n), x0, gx[0]);
            at += n;
        }
        if at < len {
            let x1 = load_n(l, px, at, len - at);
            sq[1] = l.fmadd(x1, x1, sq[1]);
            gx[1] = l.fmadd(g(l, pdy, pw, at, len - at), x1, gx[1]);
        }
    }
    (l.reduce_add(l.add(sq[0], sq[1])), l.reduce_add(l.add(gx[0], gx[1])))
}

/// `g = dy w` (or `dy`) of the `k <= N` columns from `at`.
///
/// # Safety
/// `dy` and a given `w` hold those columns; `T` is f32, bf16 or f16.
#[inline(always)]
unsafe fn g<L: Lanes, T: 'static>(l: L, dy: *const T, w: Option<*const T>, at: usize, k: usize) -> L::V {
    // SAFETY: the caller's.
    unsafe {
        let d = load_n(l, dy, at, k);
        match w {
            Some(w) => l.mul(d, load_n(l, w, at, k)),
            None => d,
        }
    }
}

/// `out[i] = dx` of columns `at..at + out.len()` of the row, and `dw` added
/// to there; the weight, `add` and `dw` cases chosen once per part.
///
/// # Safety
/// Every pointer of `p`, and `dw`, hold the columns `at..at + out.len()`.
#[inline(always)]
unsafe fn part<L: Lanes, T: 'static>(
    l: L,
    p: Ptrs<T>,
    dw: Option<*mut f32>,
    r: L::V,
    c: L::V,
    at: usize,
    out: &mut [f32],
) {
    // SAFETY (each arm): the caller's.
    unsafe {
        match (p.w, p.add, dw) {
            (Some(w), None, Some(dw)) => cols::<L, T, true, false, true>(l, p, w, dw, r, c, at, out),
            (Some(w), None, None) => cols::<L, T, true, false, false>(l, p, w, dw_none(), r, c, at, out),
            (Some(w), Some(_), Some(dw)) => cols::<L, T, true, true, true>(l, p, w, dw, r, c, at, out),
            (Some(w), Some(_), None) => cols::<L, T, true, true, false>(l, p, w, dw_none(), r, c, at, out),
            (None, None, _) => cols::<L, T, false, false, false>(l, p, p.x, dw_none(), r, c, at, out),
            (None, Some(_), _) => cols::<L, T, false, true, false>(l, p, p.x, dw_none(), r, c, at, out),
        }
    }
}

/// The `dw` pointer of the cases without one (never read or written).
#[inline(always)]
fn dw_none() -> *mut f32 {
    std::ptr::null_mut()
}

/// [`part`] for one case: `W` a weight (at `w`), `A` an added gradient,
/// `DW` the weight's gradient (at `dw`).
///
/// # Safety
/// As [`part`]; `w` (where `W`) and `dw` (where `DW`) hold the columns too,
/// and `p.add` is `Some` where `A`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn cols<L: Lanes, T: 'static, const W: bool, const A: bool, const DW: bool>(
    l: L,
    p: Ptrs<T>,
    w: *const T,
    dw: *mut f32,
    r: L::V,
    c: L::V,
    at: usize,
    out: &mut [f32],
) {
    let (len, o) = (out.len(), out.as_mut_ptr());
    let mut i = 0;
    // SAFETY (both): whole vectors while they fit in `out`, then the `len -
    // i < N` left; the caller's bounds from `at`.
    while i + L::N <= len {
        unsafe { step::<L, T, W, A, DW>(l, p, w, dw, (r, c), at + i, o.add(i), L::N) };
        i += L::N;
    }
    if i < len {
        unsafe { step::<L, T, W, A, DW>(l, p, w, dw, (r, c), at + i, o.add(i), len - i) };
    }
}

/// One vector of `k <= N` columns from `j`, written to `o` (and added to
/// `dw`): the lane loop's operations in its order, `dx = (r dy) w - x c (+
/// add)`, `dw += (dy x) r`.
///
/// # Safety
/// `k` values from `j` at every pointer of `p` that the case reads, at `w`
/// (where `W`) and `dw` (where `DW`); `k` writable at `o`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn step<L: Lanes, T: 'static, const W: bool, const A: bool, const DW: bool>(
    l: L,
    p: Ptrs<T>,
    w: *const T,
    dw: *mut f32,
    (r, c): (L::V, L::V),
    j: usize,
    o: *mut f32,
    k: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        let (xv, dyv) = (load_n(l, p.x, j, k), load_n(l, p.dy, j, k));
        let mut gv = l.mul(r, dyv);
        if W {
            gv = l.mul(gv, load_n(l, w, j, k));
        }
        let mut d = l.sub(gv, l.mul(xv, c));
        if A {
            d = l.add(d, load_n(l, p.add.unwrap_or(p.x), j, k));
        }
        store_n(l, o, 0, d, k);
        if DW {
            let prev = load_n(l, dw.cast_const(), j, k);
            store_n(l, dw, j, l.add(prev, l.mul(l.mul(dyv, xv), r)), k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rows;
    use crate::element::Element;
    use crate::layout::RowLayout;
    use crate::simd::dispatch;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// Multiples of 1/8 in [-2, 2]: with `w` in [0.5, 1.25], every product
    /// and partial sum of a row of up to ~600 of them is exact in f32, so
    /// the sums agree whatever their order.
    fn exact<T: Element>(n: usize, seed: usize) -> Vec<T> {
        (0..n).map(|i| T::from_f64((((i + seed) * 37 % 33) as f64 - 16.0) / 8.0)).collect()
    }

    /// (weight, add, dw): every combination the ops make (dw only with a
    /// weight).
    const CASES: [(bool, bool, bool); 6] = [
        (true, false, true),
        (true, false, false),
        (true, true, true),
        (true, true, false),
        (false, false, false),
        (false, true, false),
    ];

    /// `dx` and `dw` from the kernel and from the lane loop's rows
    /// (`backward_row`), for `rows` rows of `x` `stride` apart.
    #[allow(clippy::type_complexity)]
    fn both<L: Width, T: Element<Acc = f32>>(
        l: L,
        (x, stride): (&[T], usize),
        dy: &[T],
        add: Option<&[T]>,
        w: Option<&[T]>,
        with_dw: bool,
        cols: usize,
    ) -> ((Vec<T>, Vec<f32>), (Vec<T>, Vec<f32>)) {
        let (n, rows) = (dy.len(), dy.len() / cols);
        let start: Vec<f32> = (0..cols).map(|j| j as f32 / 4.0 - 1.0).collect();
        let layout = RowLayout::new(&[rows], &[stride]).expect("a layout of rows");
        let (mut dx, mut dw) = (vec![T::from_f64(9.0); n], start.clone());
        let mut ox = layout.offsets_from(0);
        let dwk = with_dw.then_some(&mut dw[..]);
        run_with(l, Rows { x, ox: &mut ox, dy, add, w, dx: &mut dx, dw: dwk, cols, eps: 1e-6 });
        let (mut dx_ref, mut dw_ref) = (vec![T::from_f64(9.0); n], start);
        for (r, (dy, dxr)) in dy.chunks(cols).zip(dx_ref.chunks_mut(cols)).enumerate() {
            let x = &x[r * stride..][..cols];
            let a = add.map(|a| &a[r * cols..][..cols]);
            let d = with_dw.then_some(&mut dw_ref[..]);
            dispatch(|| super::super::backward_row(x, dy, a, w, dxr, d, 1e-6f32, &[]));
        }
        ((dx, dw), (dx_ref, dw_ref))
    }

    fn bits<T: Element<Acc = f32>>(v: &[T]) -> Vec<u32> {
        v.iter().map(|v| v.to_acc().to_bits()).collect()
    }

    fn fbits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// The kernel against the lane loop, bit for bit, in every case: widths
    /// around the vector, narrowing block and part sizes, 1-5 rows,
    /// contiguous and 3 columns apart.
    fn matches_lane_loop<L: Width, T: Element<Acc = f32>>(l: L) {
        for cols in [1usize, 7, 8, 16, 17, 100, 255, 256, 257, 600] {
            for rows in [1usize, 2, 5] {
                for gap in [0usize, 3] {
                    let stride = cols + gap;
                    let x = exact::<T>(rows * stride, 1);
                    let (dy, add) = (exact::<T>(rows * cols, 5), exact::<T>(rows * cols, 11));
                    let w: Vec<T> = (0..cols).map(|j| T::from_f64(0.5 + (j % 7) as f64 / 8.0)).collect();
                    for (with_w, with_add, with_dw) in CASES {
                        let (wt, ad) = (with_w.then_some(&w[..]), with_add.then_some(&add[..]));
                        let ((dx, dw), (dx_ref, dw_ref)) = both(l, (&x, stride), &dy, ad, wt, with_dw, cols);
                        let what = format!(
                            "{} cols={cols} rows={rows} gap={gap} case={:?}",
                            T::NAME,
                            (with_w, with_add, with_dw)
                        );
                        assert_eq!(bits(&dx), bits(&dx_ref), "dx {what}");
                        assert_eq!(fbits(&dw), fbits(&dw_ref), "dw {what}");
                    }
                }
            }
        }
    }

    /// Special values as the lane loop treats them: an infinite `x` makes
    /// its row NaN (`r` is 0 and `c` NaN) and leaves the other rows alone;
    /// an f16 subnormal `x` is widened exactly (its row bit for bit).
    fn specials<L: Width, T: Element<Acc = f32>>(l: L) {
        let (rows, cols) = (3, 300);
        let mut x = exact::<T>(rows * cols, 1);
        x[5] = T::from_f64(f64::INFINITY);
        x[cols + 7] = T::from_f64(2f64.powi(-24)); // f16's least subnormal; bf16 normal
        let (dy, w) = (exact::<T>(rows * cols, 5), exact::<T>(cols, 3));
        let ((dx, dw), (dx_ref, dw_ref)) = both(l, (&x, cols), &dy, None, Some(&w), true, cols);
        assert!(dx[..cols].iter().all(|v| v.to_acc().is_nan()), "{}: the row with inf", T::NAME);
        assert!(dx_ref[..cols].iter().all(|v| v.to_acc().is_nan()));
        assert_eq!(bits(&dx[cols..]), bits(&dx_ref[cols..]), "{}: the other rows", T::NAME);
        let nan_same = |a: &f32, b: &f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        assert!(dw.iter().zip(&dw_ref).all(|(a, b)| nan_same(a, b)), "{}: dw", T::NAME);
    }

    #[test]
    fn rows_match_the_lane_loop_at_every_width() {
        fn each<L: Width>(l: L) {
            matches_lane_loop::<L, f16>(l);
            matches_lane_loop::<L, bf16>(l);
            specials::<L, f16>(l);
            specials::<L, bf16>(l);
        }
        every_width!(each);
    }

    /// Sums that round (4099 columns of non-dyadic values): within `T`'s
    /// rounding of an f64 reference from the same inputs; a NaN in a row
    /// reaches that row's outputs only.
    fn inexact<L: Width, T: Element<Acc = f32>>(l: L, rtol: f64) {
        let (rows, cols) = (3, 4099);
        let n = rows * cols;
        let x: Vec<T> = (0..n).map(|i| T::from_f64(((i as f64) * 0.37).sin() * 3.0)).collect();
        let mut dy: Vec<T> = (0..n).map(|i| T::from_f64(((i as f64) * 0.11).cos())).collect();
        dy[2 * cols + 17] = T::from_f64(f64::NAN);
        let w: Vec<T> = (0..cols).map(|j| T::from_f64(0.5 + (j % 13) as f64 / 10.0)).collect();
        let layout = RowLayout::contiguous(rows, cols);
        let mut ox = layout.offsets_from(0);
        let mut dx = vec![T::from_f64(0.0); n];
        run_with(
            l,
            Rows { x: &x, ox: &mut ox, dy: &dy, add: None, w: Some(&w), dx: &mut dx, dw: None, cols, eps: 1e-6 },
        );
        let (want, _) = super::super::backward_ref(&dy[..2 * cols], &x[..2 * cols], Some(&w), cols, 1e-6);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (got, want)) in dx[..2 * cols].iter().zip(&want).enumerate() {
            let err = (got.to_f64() - want).abs();
            assert!(err <= rtol * want.abs() + 1e-5 * scale, "{} i={i}: {} vs {want}", T::NAME, got.to_f64());
        }
        assert!(dx[2 * cols..].iter().all(|v| v.to_acc().is_nan()));
    }

    /// Tolerances: one rounding of the dtype (f16 2^-11, bf16 2^-8) and a
    /// little more for the f32 sums.
    #[test]
    fn inexact_rows_are_within_rounding_at_every_width() {
        fn each<L: Width>(l: L) {
            inexact::<L, f16>(l, 1e-3);
            inexact::<L, bf16>(l, 8e-3);
        }
        every_width!(each);
    }
}
