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
//! [`Element::write_acc`], or for bf16 on AVX2 in registers ([`Pairs`]).
//! The tests compare with the lane loop bit for bit on rows whose sums are
//! exact, and with an f64 reference otherwise.
use super::{consts_from_sums, strided_row_and_next};
use crate::element::Element;
use crate::layout::Offsets;
use crate::rows::row_and_next;
use crate::simd::{prefetch_each, prefetch_row_write_ahead, prefetching, PREFETCH_PART};
use crate::wide::x86::even_odd::{from_even_odd, to_even_odd};
use crate::wide::x86::{load_n, store_n, Kernel, Lanes};
use crate::wide::{cast_mut, is};
use half::bf16;

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
        // bf16 on AVX2 (`Pairs`) loads its inputs in the even/odd order:
        // `dw` is kept so meanwhile, each whole group of `2 N`.
        let g = if is::<T, bf16>() && !L::ROUNDS_BF16 { 2 * L::N } else { 0 };
        if let Some(dw) = dw.as_deref_mut() {
            to_even_odd(dw, g);
        }
        for (r, dx) in dx.chunks_exact_mut(cols).enumerate() {
            let (x, next_x) = strided_row_and_next(x, ox, r + 1 < rows, cols);
            let (dy, next_dy) = row_and_next(dy, r, cols);
            let add = add.map(|a| &a[r * cols..][..cols]);
            let (sum_sq, gx) = sums(l, x, dy, w);
            let (rr, c) = consts_from_sums(sum_sq, gx, cols, eps);
            let (rv, cv) = (l.splat(rr), l.splat(c));
            let ptrs = Ptrs { x: x.as_ptr(), dy: dy.as_ptr(), add: add.map(<[T]>::as_ptr), w: w.map(<[T]>::as_ptr) };
            let dw = dw.as_deref_mut().map(<[f32]>::as_mut_ptr);
            // bf16 on AVX2: in registers (`Pairs`); else part by part,
            // prefetching the next row, as the lane loop.
            if let Some(dx) = cast_mut::<T, bf16>(dx).filter(|_| !L::ROUNDS_BF16) {
                // SAFETY: every pointer holds the row's `cols` values, as
                // `dx` does.
                unsafe { with_case(ptrs, dw, Pairs { l, r: rv, c: cv, dx, ahead: [next_x, next_dy] }) };
                continue;
            }
            prefetching(
                dx,
                &[next_x, next_dy],
                #[inline(always)]
                |k, dx| {
                    // On Intel's AVX-512 the part's `dx` lines are asked for ahead:
                    // on the Xeon, bf16 4096x4096, two threads, interleaved
                    // medians (session 62), 4.1-4.2 -> 3.6 ms into reused
                    // outputs (fused_add's 4.2 -> 3.7-3.8), 6.9 -> 6.4 into
                    // fresh huge pages.
                    if L::writes_ahead() {
                        prefetch_row_write_ahead(dx);
                    }
                    T::write_acc(
                        dx,
                        #[inline(always)]
                        |at, out| {
                            let out = cast_mut::<T::Acc, f32>(out).expect("rms_norm x86 rows: T::Acc is f32");
                            // SAFETY: `out` is `dx[k + at..]` widened, and
                            // every pointer holds the row's `cols` values.
                            unsafe { with_case(ptrs, dw, Block { l, r: rv, c: cv, at: k + at, out }) };
                        },
                    )
                },
            );
        }
        if let Some(dw) = dw {
            from_even_odd(dw, g);
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
/// weight): two accumulators of fused multiply-adds for each, fed pairs of
/// vectors in [`Lanes::load_pair_unordered`]'s order (the zero lanes of a
/// part vector add nothing), then a tree.
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
            let (x0, x1) = l.load_pair_unordered(px.add(at));
            let (g0, g1) = g_pair(l, pdy, pw, at);
            sq[0] = l.fmadd(x0, x0, sq[0]);
            sq[1] = l.fmadd(x1, x1, sq[1]);
            gx[0] = l.fmadd(g0, x0, gx[0]);
            gx[1] = l.fmadd(g1, x1, gx[1]);
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

/// `g = dy w` (or `dy`) of the `2 N` columns from `at`, in
/// [`Lanes::load_pair_unordered`]'s order.
///
/// # Safety
/// `dy` and a given `w` hold those columns; `T` is f32, bf16 or f16.
#[inline(always)]
unsafe fn g_pair<L: Lanes, T: 'static>(l: L, dy: *const T, w: Option<*const T>, at: usize) -> (L::V, L::V) {
    // SAFETY: the caller's.
    unsafe {
        let (d0, d1) = l.load_pair_unordered(dy.add(at));
        match w {
            Some(w) => {
                let (w0, w1) = l.load_pair_unordered(w.add(at));
                (l.mul(d0, w0), l.mul(d1, w1))
            }
            None => (d0, d1),
        }
    }
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

/// A pass over (part of) a row in one of its cases: `W` a weight (at `w`),
/// `A` an added gradient, `DW` the weight's gradient (at `dw`).
trait Case<T> {
    /// The pass in that case.
    ///
    /// # Safety
    /// Every pointer of the row's [`Ptrs`], `w` (where `W`) and `dw` (where
    /// `DW`) hold the columns the pass reaches; `p.add` is `Some` where `A`.
    unsafe fn run<const W: bool, const A: bool, const DW: bool>(self, p: Ptrs<T>, w: *const T, dw: *mut f32);
}

/// Runs `k` in the row's case (weight, `add`, `dw`), chosen once per call.
///
/// # Safety
/// As [`Case::run`], for the pointers of `p` and `dw`.
#[inline(always)]
unsafe fn with_case<T, K: Case<T>>(p: Ptrs<T>, dw: Option<*mut f32>, k: K) {
    // SAFETY (each arm): the caller's; the cases without a weight or `dw`
    // never read `w` (given `x`) or touch `dw` (null).
    unsafe {
        match (p.w, p.add, dw) {
            (Some(w), None, Some(dw)) => k.run::<true, false, true>(p, w, dw),
            (Some(w), None, None) => k.run::<true, false, false>(p, w, dw_none()),
            (Some(w), Some(_), Some(dw)) => k.run::<true, true, true>(p, w, dw),
            (Some(w), Some(_), None) => k.run::<true, true, false>(p, w, dw_none()),
            (None, None, _) => k.run::<false, false, false>(p, p.x, dw_none()),
            (None, Some(_), _) => k.run::<false, true, false>(p, p.x, dw_none()),
        }
    }
}

/// The `dw` pointer of the cases without one (never read or written).
#[inline(always)]
fn dw_none() -> *mut f32 {
    std::ptr::null_mut()
}

/// `out[i] = dx` of columns `at..at + out.len()` of the row (and `dw` added
/// to there), for [`Element::write_acc`] to round.
struct Block<'o, L: Lanes> {
    l: L,
    r: L::V,
    c: L::V,
    at: usize,
    out: &'o mut [f32],
}

impl<L: Lanes, T: 'static> Case<T> for Block<'_, L> {
    #[inline(always)]
    unsafe fn run<const W: bool, const A: bool, const DW: bool>(self, p: Ptrs<T>, w: *const T, dw: *mut f32) {
        let Block { l, r, c, at, out } = self;
        let (len, o) = (out.len(), out.as_mut_ptr());
        let mut i = 0;
        // SAFETY (both): whole vectors while they fit in `out`, then the
        // `len - i < N` left; the caller's bounds from `at`.
        while i + L::N <= len {
            unsafe { store_n(l, o, i, value::<L, T, W, A, DW>(l, p, w, dw, (r, c), at + i, L::N), L::N) };
            i += L::N;
        }
        if i < len {
            unsafe { store_n(l, o, i, value::<L, T, W, A, DW>(l, p, w, dw, (r, c), at + i, len - i), len - i) };
        }
    }
}

/// A bf16 row's `dx` rounded in registers, two vectors at a time, with
/// [`Lanes::store_bf16_pair_normal_even_odd`] and no NaN check (for AVX2,
/// whose width does not convert), its inputs loaded in that order and `dw`
/// kept in it by [`Rows`] ([`pair`]): every `dx` is float arithmetic on values
/// widened from bf16 and on the row's `r` and `c`, so any NaN is quiet
/// with its low 16 bits zero, which that rounding keeps as `from_acc` does
/// (`RowValues::ARITHMETIC` says why). The last `< 2 N` values go through a
/// small f32 block and `from_acc`. Prefetches the next row's part of
/// [`PREFETCH_PART`] values as the block path does.
///
/// Through the blocks instead, each value is stored, loaded and rounded
/// with LLVM's vectorised NaN fix-up. AVX2 (Zen 3), two threads, `[4096,
/// 4096]`, old and new alternated in one process: see BENCHMARKS.md,
/// session 55.
struct Pairs<'o, L: Lanes, T> {
    l: L,
    r: L::V,
    c: L::V,
    dx: &'o mut [bf16],
    ahead: [&'o [T]; 2],
}

impl<L: Lanes, T: 'static> Case<T> for Pairs<'_, L, T> {
    #[inline(always)]
    unsafe fn run<const W: bool, const A: bool, const DW: bool>(self, p: Ptrs<T>, w: *const T, dw: *mut f32) {
        let Pairs { l, r, c, dx, ahead } = self;
        let (n, len) = (2 * L::N, dx.len());
        let whole = len / n * n;
        let mut i = 0;
        // SAFETY: `i + 2 N <= whole <= len`, within the row (the caller's
        // bounds), as `dx` holds it.
        unsafe {
            while i < whole {
                if i.is_multiple_of(PREFETCH_PART) {
                    prefetch_each(&ahead, i / PREFETCH_PART, PREFETCH_PART);
                }
                let (a, b) = pair::<L, T, W, A, DW>(l, p, w, dw, (r, c), i);
                l.store_bf16_pair_normal_even_odd(dx.as_mut_ptr().add(i), a, b);
                i += n;
            }
        }
        if whole < len {
            if whole.is_multiple_of(PREFETCH_PART) {
                prefetch_each(&ahead, whole / PREFETCH_PART, PREFETCH_PART);
            }
            let mut t = [0f32; 64];
            // SAFETY: `len - whole < 2 N <= 64` values from `whole`, within
            // the row.
            unsafe { Block { l, r, c, at: whole, out: &mut t[..len - whole] }.run::<W, A, DW>(p, w, dw) };
            bf16::from_acc_slice(&t[..len - whole], &mut dx[whole..]);
        }
    }
}

/// One vector of `k <= N` columns from `j`: the lane loop's operations in
/// its order, `dx = (r dy) w - x c (+ add)` returned, `dw += (dy x) r`
/// stored.
///
/// # Safety
/// `k` values from `j` at every pointer of `p` that the case reads, at `w`
/// (where `W`) and `dw` (where `DW`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn value<L: Lanes, T: 'static, const W: bool, const A: bool, const DW: bool>(
    l: L,
    p: Ptrs<T>,
    w: *const T,
    dw: *mut f32,
    (r, c): (L::V, L::V),
    j: usize,
    k: usize,
) -> L::V {
    // SAFETY: the caller's.
    unsafe {
        let (xv, dyv) = (load_n(l, p.x, j, k), load_n(l, p.dy, j, k));
        let wv = if W { load_n(l, w, j, k) } else { xv };
        let av = if A { load_n(l, p.add.unwrap_or(p.x), j, k) } else { xv };
        let prev = if DW { load_n(l, dw.cast_const(), j, k) } else { xv };
        let (d, dwv) = step::<L, W, A, DW>(l, (r, c), [xv, dyv, wv, av, prev]);
        if DW {
            store_n(l, dw, j, dwv, k);
        }
        d
    }
}

/// [`value`] of the whole group of `2 N` bf16 columns from `j`, its inputs
/// loaded in [`Lanes::load_pair_unordered`]'s order (the even columns, then
/// the odd ones), as `dx` is returned, and `dw`'s group read and written in
/// the same order (as [`Rows`] keeps it: see [`to_even_odd`]).
///
/// # Safety
/// As [`value`] for `2 N` values from `j`; `T` is bf16.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pair<L: Lanes, T: 'static, const W: bool, const A: bool, const DW: bool>(
    l: L,
    p: Ptrs<T>,
    w: *const T,
    dw: *mut f32,
    rc: (L::V, L::V),
    j: usize,
) -> (L::V, L::V) {
    // SAFETY: the caller's.
    unsafe {
        let ((x0, x1), (d0, d1)) = (l.load_pair_unordered(p.x.add(j)), l.load_pair_unordered(p.dy.add(j)));
        let (w0, w1) = if W { l.load_pair_unordered(w.add(j)) } else { (x0, x1) };
        let (a0, a1) = if A { l.load_pair_unordered(p.add.unwrap_or(p.x).add(j)) } else { (x0, x1) };
        let (e0, e1) = if DW { (l.load(dw.add(j)), l.load(dw.add(j + L::N))) } else { (x0, x1) };
        let (v0, n0) = step::<L, W, A, DW>(l, rc, [x0, d0, w0, a0, e0]);
        let (v1, n1) = step::<L, W, A, DW>(l, rc, [x1, d1, w1, a1, e1]);
        if DW {
            l.store(dw.add(j), n0);
            l.store(dw.add(j + L::N), n1);
        }
        (v0, v1)
    }
}

/// The lane loop's operations on one vector of each input, `[x, dy, w,
/// add, dw]` (the ones a case does not read are unused): `dx = (r dy) w - x
/// c (+ add)`, and `dw + (dy x) r` (`dw` where not `DW`).
#[inline(always)]
fn step<L: Lanes, const W: bool, const A: bool, const DW: bool>(
    l: L,
    (r, c): (L::V, L::V),
    [xv, dyv, wv, av, prev]: [L::V; 5],
) -> (L::V, L::V) {
    let mut gv = l.mul(r, dyv);
    if W {
        gv = l.mul(gv, wv);
    }
    let mut d = l.sub(gv, l.mul(xv, c));
    if A {
        d = l.add(d, av);
    }
    let dwv = if DW { l.add(prev, l.mul(l.mul(dyv, xv), r)) } else { prev };
    (d, dwv)
}

#[cfg(test)]
mod tests {
    use super::Rows;
    use crate::element::Element;
    use crate::layout::RowLayout;
    use crate::simd::dispatch;
    use crate::testing::{bf16_bits_any_nan, same_or_nan, BF16_NANS};
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
        assert!(dw.iter().zip(&dw_ref).all(|(&a, &b)| same_or_nan(a, b)), "{}: dw", T::NAME);
    }

    /// bf16 NaN, quiet and signalling, with payloads and of both signs, as
    /// the lane loop treats them (bf16 rows on AVX2 round in registers with
    /// no NaN check, `Pairs`): one in `x` (its row all NaN), one in `dy`
    /// (the same), and some in `add` (those values only); a NaN counts as
    /// any NaN, the rest bit for bit. Row widths with and without a part
    /// group.
    fn nans<L: Width>(l: L) {
        for cols in [37usize, 300] {
            let rows = 4;
            let mut x = exact::<bf16>(rows * cols, 1);
            let (mut dy, mut add) = (exact::<bf16>(rows * cols, 5), exact::<bf16>(rows * cols, 11));
            x[cols + 9] = bf16::from_bits(0x7f81);
            dy[2 * cols + cols - 1] = bf16::from_bits(0xffbf);
            for (i, a) in add.iter_mut().enumerate().filter(|(i, _)| i % 7 == 2 && (i / cols) % 3 == 0) {
                *a = bf16::from_bits(BF16_NANS[i % BF16_NANS.len()]);
            }
            let w: Vec<bf16> = (0..cols).map(|j| bf16::from_f64(0.5 + (j % 7) as f64 / 8.0)).collect();
            for (with_w, with_add, with_dw) in CASES {
                let (wt, ad) = (with_w.then_some(&w[..]), with_add.then_some(&add[..]));
                let ((dx, dw), (dx_ref, dw_ref)) = both(l, (&x, cols), &dy, ad, wt, with_dw, cols);
                let what = format!("cols={cols} case={:?}", (with_w, with_add, with_dw));
                assert_eq!(bf16_bits_any_nan(&dx), bf16_bits_any_nan(&dx_ref), "dx {what}");
                assert!(dx[cols..3 * cols].iter().all(|v| v.is_nan()), "rows 1 and 2 are NaN: {what}");
                let added = dx.iter().zip(ad.unwrap_or(&[])).filter(|(_, a)| a.is_nan()).all(|(v, _)| v.is_nan());
                assert!(added && dx[..cols].iter().any(|v| !v.is_nan()), "row 0: {what}");
                assert!(dw.iter().zip(&dw_ref).all(|(&a, &b)| same_or_nan(a, b)), "dw {what}");
            }
        }
    }

    #[test]
    fn rows_match_the_lane_loop_at_every_width() {
        fn each<L: Width>(l: L) {
            matches_lane_loop::<L, f16>(l);
            matches_lane_loop::<L, bf16>(l);
            specials::<L, f16>(l);
            specials::<L, bf16>(l);
            nans::<L>(l);
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
