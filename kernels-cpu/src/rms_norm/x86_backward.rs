//! rms_norm's f32 backward in the training case (a weight and its
//! gradient; with or without fused_add_rms_norm's `grad_add`, added into
//! `dx`), in explicit SIMD written once for AVX-512 and AVX2
//! ([`crate::wide`]), two rows at a time, as layer_norm's
//! (`layer_norm/x86_backward.rs`, which explains the why, and why two rows
//! rather than four): the block's partial `dw` is loaded and stored once per
//! two rows instead of once per row, and each column's loads come before its
//! stores. Measured against four rows with the next four prefetched (Zen 4,
//! f32, 2 threads, best of 40-400 calls, four alternations): 32x4096
//! 0.32-0.35 ns per value against 0.58-0.62, 4096x4096 0.44-0.46 against
//! 0.57-0.66. With `grad_add`, four rows had measured no faster than the row
//! loop (session 22, AVX-512 Xeon, 4096x4096 f32: 24.4-27.7 ms against
//! 24.5-26.7); two rows are faster on Zen 4 (criterion, 4096x4096:
//! 12.3-14.5 ms against the row loop's 15.4-16.6; BENCHMARKS.md, session 40).
//! bf16 is not grouped: the same walk with bf16 loads and `dx` rounded per
//! part (as layer_norm's bf16, where it paid) measured no faster than the
//! row loop, with or without `grad_add` (criterion, 4096x4096, alternated:
//! rms_norm 5.1-7.8 ms against 6.0-7.0, fused_add_rms_norm 7.5-9.7 against
//! 7.2-7.8); bf16 and f16 now take the explicit row kernel of `x86_rows.rs`.
//!
//! Each value is the lane loop's, bit for bit: the rows' `r` and `c` come
//! from the same function ([`super::grad_consts`]), and every element takes
//! the same operations in the same order (`dx = (r dy) w - x c`, then `dw +=
//! (dy x) r` row after row); the tests compare both at every width, on
//! contiguous and strided rows, with and without `grad_add`.
use super::{grad_consts, strided_row_and_next};
use crate::layout::Offsets;
use crate::simd::prefetch_write_ahead;
use crate::wide::x86::{load_n as load, store_n as store, walk_columns, Kernel, Lanes};

/// Rows whose columns are walked together (layer_norm's `GROUP` says why
/// two).
const GROUP: usize = 2;

/// The backward over the rows of `dx` (`cols` each): row `k` of `x` at the
/// `k`-th offset of `ox` (which is stepped past them), of `dy`, `add` and
/// `dx` contiguous; `w` and `dw` of `cols`, `dw` added to. `cols > 0`.
pub(super) struct Backward<'a> {
    pub(super) x: &'a [f32],
    pub(super) ox: &'a mut Offsets,
    pub(super) dy: &'a [f32],
    /// fused_add_rms_norm's `grad_add`, added to `dx`.
    pub(super) add: Option<&'a [f32]>,
    pub(super) w: &'a [f32],
    pub(super) dx: &'a mut [f32],
    pub(super) dw: &'a mut [f32],
    pub(super) cols: usize,
    pub(super) eps: f32,
}

impl Kernel for Backward<'_> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Backward { x, ox, dy, add, w, dx, dw, cols, eps } = self;
        assert!(cols > 0 && dy.len() == dx.len() && dx.len() % cols == 0, "rms_norm x86 backward: rows of dy, dx");
        assert!(add.is_none_or(|a| a.len() == dx.len()), "rms_norm x86 backward: rows of add");
        assert!(w.len() == cols && dw.len() == cols, "rms_norm x86 backward: w, dw");
        let rows = dx.len() / cols;
        let mut r = 0;
        while r < rows {
            let g = if rows - r >= GROUP { GROUP } else { 1 };
            let mut xs: [&[f32]; GROUP] = [&[]; GROUP];
            for x_row in xs.iter_mut().take(g) {
                *x_row = strided_row_and_next(x, ox, false, cols).0;
            }
            let span = r * cols..(r + g) * cols;
            let rows_at = (&dy[span.clone()], add.map(|a| &a[span.clone()]), &mut dx[span]);
            // SAFETY (both): `xs[..g]` are rows of `cols`, as are the `g`
            // rows of `dy`, `add` and `dx` given; `w` and `dw` hold `cols`.
            if g == GROUP {
                unsafe { group::<L, GROUP>(l, xs, rows_at, (w, dw), cols, eps) };
            } else {
                unsafe { group::<L, 1>(l, xs, rows_at, (w, dw), cols, eps) };
            }
            r += g;
        }
    }
}

/// `G` rows: each row's `r = 1 / rms` and `c = r^3 sum(g x) / n`, then one
/// walk over the columns writing their `dx` and adding to `dw`.
///
/// # Safety
/// `xs[..G]` hold `cols` values each, `dy`, `add` and `dx` `G` rows of
/// `cols`, `w` and `dw` `cols`.
#[inline(always)]
unsafe fn group<L: Lanes, const G: usize>(
    l: L,
    xs: [&[f32]; GROUP],
    (dy, add, dx): (&[f32], Option<&[f32]>, &mut [f32]),
    (w, dw): (&[f32], &mut [f32]),
    cols: usize,
    eps: f32,
) {
    // Plain loops, not `array::from_fn` (see layer_norm's).
    let zero = l.splat(0.0);
    let mut c = [(zero, zero); G];
    let (mut xp, mut dyp, mut dxp) = ([dy.as_ptr(); G], [dy.as_ptr(); G], [dx.as_mut_ptr(); G]);
    let mut addp = [dy.as_ptr(); G];
    for k in 0..G {
        let span = k * cols..(k + 1) * cols;
        let (r, ck) = grad_consts(xs[k], &dy[span.clone()], Some(w), eps);
        c[k] = (l.splat(r), l.splat(ck));
        xp[k] = xs[k].as_ptr();
        dyp[k] = dy[span.clone()].as_ptr();
        if let Some(a) = add {
            addp[k] = a[span.clone()].as_ptr();
        }
        dxp[k] = dx[span].as_mut_ptr();
    }
    let (w, dw) = (w.as_ptr(), dw.as_mut_ptr());
    let ins = (xp, dyp, addp, w);
    // SAFETY (both): `walk_columns` gives `count` columns from `i`, inside
    // the `cols` of every row (the caller's bounds).
    if add.is_some() {
        walk_columns::<L>(
            cols,
            #[inline(always)]
            |i, count| unsafe { step::<L, G, true>(l, &c, ins, (dxp, dw), i, count) },
        );
    } else {
        walk_columns::<L>(
            cols,
            #[inline(always)]
            |i, count| unsafe { step::<L, G, false>(l, &c, ins, (dxp, dw), i, count) },
        );
    }
}

/// One vector of columns `i..i + count` (`count <= N`) of every row: `dx =
/// (r dy) w - x c`, plus `add` where `ADD`, then `dw += (dy x) r` row after
/// row. Every row's loads come before the first store (layer_norm's `step`
/// says why).
///
/// # Safety
/// `count` values from `i` are readable at every pointer (`adds` only read
/// where `ADD`), and writable at the `dx` rows and `dw`.
#[allow(clippy::type_complexity)]
#[inline(always)]
unsafe fn step<L: Lanes, const G: usize, const ADD: bool>(
    l: L,
    c: &[(L::V, L::V); G],
    (xs, dys, adds, w): ([*const f32; G], [*const f32; G], [*const f32; G], *const f32),
    (dxs, dw): ([*mut f32; G], *mut f32),
    i: usize,
    count: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        let wv = load(l, w, i, count);
        let mut dwv = load(l, dw, i, count);
        let mut dxv = [wv; G];
        for k in 0..G {
            let (xv, dyv) = (load(l, xs[k], i, count), load(l, dys[k], i, count));
            let (r, ck) = c[k];
            dxv[k] = l.sub(l.mul(l.mul(r, dyv), wv), l.mul(xv, ck));
            if ADD {
                dxv[k] = l.add(dxv[k], load(l, adds[k], i, count));
            }
            dwv = l.add(dwv, l.mul(l.mul(dyv, xv), r));
        }
        // On Intel's AVX-512 each row asks for its `dx` line ahead (a vector is a
        // line): on the Xeon, 4096x4096, two threads, interleaved medians
        // (session 62), 11.3 -> 8.1 ms into reused outputs (fused_add's
        // 10.0 -> 8.3), 15.7 -> 13.9 into fresh huge pages, 23.0 -> 19.7
        // into fresh 4 KiB pages.
        if L::writes_ahead() {
            for p in dxs {
                prefetch_write_ahead(p.add(i));
            }
        }
        for (k, v) in dxv.into_iter().enumerate() {
            store(l, dxs[k], i, v, count);
        }
        store(l, dw, i, dwv, count);
    }
}

#[cfg(test)]
mod tests {
    use super::Backward;
    use crate::layout::RowLayout;
    use crate::wide::x86::{every_width, run_with, Width};

    /// The grouped pass against the lane loop's rows (`backward_row`), bit
    /// for bit: `dx`, and `dw` added to nonzero partials, for 1 to 9 rows
    /// and widths around the vector size, on contiguous rows and on rows 3
    /// columns apart (a strided view), with and without `add`.
    fn at_width<L: Width>(l: L) {
        for cols in [1usize, 7, 16, 17, 100, 255, 256, 257, 600] {
            for rows in 1..=9 {
                for (gap, with_add) in [(0usize, false), (3, false), (0, true), (3, true)] {
                    let stride = cols + gap;
                    let x: Vec<f32> = (0..rows * stride).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
                    let n = rows * cols;
                    let dy: Vec<f32> = (0..n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 17.0).collect();
                    let add: Vec<f32> = (0..n).map(|i| ((i * 29 % 89) as f32 - 44.0) / 7.0).collect();
                    let add = with_add.then_some(&add[..]);
                    let w: Vec<f32> = (0..cols).map(|j| 0.5 + (j % 7) as f32 / 8.0).collect();
                    let start: Vec<f32> = (0..cols).map(|j| j as f32 / 3.0 - 1.0).collect();
                    let layout = RowLayout::new(&[rows], &[stride]).expect("a layout of rows");
                    let (mut dx, mut dw) = (vec![0f32; n], start.clone());
                    let mut ox = layout.offsets_from(0);
                    let (dx_out, dw_out) = (&mut dx, &mut dw);
                    let k =
                        Backward { x: &x, ox: &mut ox, dy: &dy, add, w: &w, dx: dx_out, dw: dw_out, cols, eps: 1e-6 };
                    run_with(l, k);
                    let (mut dx_ref, mut dw_ref) = (vec![0f32; n], start);
                    for (r, (dy, dx)) in dy.chunks(cols).zip(dx_ref.chunks_mut(cols)).enumerate() {
                        let x = &x[r * stride..][..cols];
                        let add = add.map(|a| &a[r * cols..][..cols]);
                        super::super::backward_row(x, dy, add, Some(&w[..]), dx, Some(&mut dw_ref[..]), 1e-6, &[]);
                    }
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    let case = format!("rows={rows} cols={cols} gap={gap} add={with_add}");
                    assert_eq!(bits(&dx), bits(&dx_ref), "dx {case}");
                    assert_eq!(bits(&dw), bits(&dw_ref), "dw {case}");
                }
            }
        }
    }

    #[test]
    fn grouped_rows_match_the_lane_loop_at_every_width() {
        every_width!(at_width);
    }
}
