//! layer_norm's f32 backward in the training case (a weight, and the
//! gradients of the weight and the bias), in explicit SIMD written once for
//! AVX-512 and AVX2 ([`crate::wide`]), four rows at a time.
//!
//! Row by row, the lane loop's write pass loaded five vectors (`x`, `dy`,
//! `w`, and the block's partial `dw` and `db`) and stored three for each
//! vector of `dx`; with a 4096-wide row those are 96 KiB, past L1, so `dw`
//! and `db` went to L2 and back once per row. LLVM also checked the seven
//! slices for overlap before every part of 256 values. perf, on an AVX-512
//! Xeon: three quarters of the kernel's time in that pass, most of it on the
//! `db` store. torch's own backward (which keeps the forward's mean and rstd)
//! was 1.6x faster on rows in cache and 1.15x on 4096x4096 in memory.
//!
//! Here each vector of `w`, `dw` and `db` is loaded and stored once per four
//! rows, and the next four rows are prefetched as the pass goes. Each value
//! is the lane loop's, bit for bit: the rows' moments and gradient means come
//! from the same functions ([`super::grad_means`]), and every element takes
//! the same operations in the same order (`dw` and `db` still add the rows
//! one after the other); the tests compare both at every width.
use super::{grad_means, Moments};
use crate::simd::prefetch_part;
use crate::wide::x86::{load_n as load, store_n as store, walk_columns, Kernel, Lanes};

/// Rows whose columns are walked together.
const GROUP: usize = 4;

/// Columns between two prefetch calls (each asks for this many columns of
/// every row of the next group, in `x` and in `dy`).
const PART: usize = 256;

/// The backward over whole rows of `cols`: `x`, `dy` and `dx` of one length,
/// `w`, `dw` and `db` of `cols`; `dw` and `db` are added to. `cols > 0`.
pub(super) struct Backward<'a> {
    pub(super) x: &'a [f32],
    pub(super) dy: &'a [f32],
    pub(super) w: &'a [f32],
    pub(super) dx: &'a mut [f32],
    pub(super) dw: &'a mut [f32],
    pub(super) db: &'a mut [f32],
    pub(super) cols: usize,
    pub(super) eps: f32,
}

impl Kernel for Backward<'_> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Backward { x, dy, w, dx, dw, db, cols, eps } = self;
        assert!(
            cols > 0 && x.len() == dx.len() && dy.len() == dx.len() && dx.len() % cols == 0,
            "layer_norm x86 backward: rows of x, dy, dx"
        );
        assert!(w.len() == cols && dw.len() == cols && db.len() == cols, "layer_norm x86 backward: w, dw, db");
        let rows = dx.len() / cols;
        let mut r = 0;
        while r < rows {
            let g = if rows - r >= GROUP { GROUP } else { 1 };
            let next = (r + g) * cols..(r + g + GROUP).min(rows) * cols;
            let ahead = [&x[next.clone()], &dy[next]];
            let at = r * cols;
            // SAFETY (both): rows `r..r + g` lie inside `x`, `dy` and `dx`,
            // each `cols` long; `w`, `dw` and `db` hold `cols` (asserted).
            if g == GROUP {
                unsafe { group::<L, GROUP>(l, (x, dy, w), (dx, dw, db), at, cols, eps, ahead) };
            } else {
                unsafe { group::<L, 1>(l, (x, dy, w), (dx, dw, db), at, cols, eps, ahead) };
            }
            r += g;
        }
    }
}

/// The per-row constants of [`step`], as vectors.
#[derive(Clone, Copy)]
struct Row<V> {
    k: V,
    m1: V,
    rstd: V,
    /// `mean(g)`, `g = dy w`.
    mg: V,
    /// `mean(g xh)`.
    mgx: V,
}

/// Rows `at / cols .. + G`: each row's moments and gradient means, then one
/// walk over the columns writing their `dx` and adding to `dw` and `db`.
///
/// # Safety
/// `G` rows of `cols` from element `at` lie inside `x`, `dy` and `dx`; `w`,
/// `dw` and `db` hold `cols` values.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group<L: Lanes, const G: usize>(
    l: L,
    (x, dy, w): (&[f32], &[f32], &[f32]),
    (dx, dw, db): (&mut [f32], &mut [f32], &mut [f32]),
    at: usize,
    cols: usize,
    eps: f32,
    ahead: [&[f32]; 2],
) {
    // Plain loops, not `array::from_fn`: its closure was left out of line,
    // and so ran the moments' passes without the vector features (perf: a
    // third of the time, in SSE2).
    let zero = l.splat(0.0);
    let mut c = [Row { k: zero, m1: zero, rstd: zero, mg: zero, mgx: zero }; G];
    let (mut xs, mut dys, mut dxs) = ([x.as_ptr(); G], [dy.as_ptr(); G], [dx.as_mut_ptr(); G]);
    for r in 0..G {
        let span = at + r * cols..at + (r + 1) * cols;
        let (m, (mg, mgx)): (Moments<f32>, _) = grad_means(&x[span.clone()], &dy[span.clone()], Some(w), eps);
        c[r] = Row { k: l.splat(m.k), m1: l.splat(m.m1), rstd: l.splat(m.rstd), mg: l.splat(mg), mgx: l.splat(mgx) };
        xs[r] = x[span.clone()].as_ptr();
        dys[r] = dy[span.clone()].as_ptr();
        dxs[r] = dx[span].as_mut_ptr();
    }
    let (w, dw, db) = (w.as_ptr(), dw.as_mut_ptr(), db.as_mut_ptr());
    walk_columns::<L>(
        cols,
        PART,
        #[inline(always)]
        |k| {
            for a in ahead {
                prefetch_part::<f32, false>(a, k, GROUP * PART);
            }
        },
        // SAFETY: `walk_columns` gives `count` columns from `i`, inside the
        // `cols` of every row (the caller's bounds).
        #[inline(always)]
        |i, count| unsafe { step::<L, G>(l, &c, (xs, dys, w), (dxs, dw, db), i, count) },
    );
}

/// One vector of columns `i..i + count` (`count <= N`) of every row: `dx =
/// rstd ((dy w - mg) - xh mgx)` with `xh = ((x - k) - m1) rstd`, then `dw +=
/// dy xh` and `db += dy` row after row, as the lane loop computes them.
///
/// # Safety
/// `count` values from `i` are readable at every pointer, and writable at
/// the `dx` rows, `dw` and `db`.
#[allow(clippy::type_complexity)]
#[inline(always)]
unsafe fn step<L: Lanes, const G: usize>(
    l: L,
    c: &[Row<L::V>; G],
    (xs, dys, w): ([*const f32; G], [*const f32; G], *const f32),
    (dxs, dw, db): ([*mut f32; G], *mut f32, *mut f32),
    i: usize,
    count: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        let wv = load(l, w, i, count);
        let (mut dwv, mut dbv) = (load(l, dw, i, count), load(l, db, i, count));
        for r in 0..G {
            let (xv, dyv) = (load(l, xs[r], i, count), load(l, dys[r], i, count));
            let c = c[r];
            let xh = l.mul(l.sub(l.sub(xv, c.k), c.m1), c.rstd);
            let v = l.mul(c.rstd, l.sub(l.sub(l.mul(dyv, wv), c.mg), l.mul(xh, c.mgx)));
            store(l, dxs[r], i, v, count);
            dwv = l.add(dwv, l.mul(dyv, xh));
            dbv = l.add(dbv, dyv);
        }
        store(l, dw, i, dwv, count);
        store(l, db, i, dbv, count);
    }
}

#[cfg(test)]
mod tests {
    use super::Backward;
    use crate::wide::x86::{every_width, run_with, Width};

    /// The grouped pass against the lane loop's rows (`backward_row`), bit
    /// for bit: `dx`, and `dw`, `db` added to nonzero partials, for 1 to 9
    /// rows (whole groups, single rows after them) and widths around the
    /// vector and part sizes, with rows whose mean is far from their spread
    /// (the moments' exact second pass) among them.
    fn at_width<L: Width>(l: L) {
        for cols in [1usize, 7, 16, 17, 100, 255, 256, 257, 600] {
            for rows in 1..=9 {
                let n = rows * cols;
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        let v = ((i * 37 % 101) as f32 - 50.0) / 13.0;
                        if (i / cols) % 3 == 2 {
                            1000.0 + v / 64.0
                        } else {
                            v
                        }
                    })
                    .collect();
                let dy: Vec<f32> = (0..n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 17.0).collect();
                let w: Vec<f32> = (0..cols).map(|j| 0.5 + (j % 7) as f32 / 8.0).collect();
                let start: Vec<f32> = (0..cols).map(|j| j as f32 / 3.0 - 1.0).collect();
                let (mut dx, mut dw, mut db) = (vec![0f32; n], start.clone(), start.clone());
                let eps = 1e-5f32;
                let k = Backward { x: &x, dy: &dy, w: &w, dx: &mut dx, dw: &mut dw, db: &mut db, cols, eps };
                run_with(l, k);
                let (mut dx_ref, mut dw_ref, mut db_ref) = (vec![0f32; n], start.clone(), start);
                for ((x, dy), dx) in x.chunks(cols).zip(dy.chunks(cols)).zip(dx_ref.chunks_mut(cols)) {
                    let dwb = (Some(&mut dw_ref[..]), Some(&mut db_ref[..]));
                    super::super::backward_row(x, dy, Some(&w[..]), dx, dwb.0, dwb.1, eps, None);
                }
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&dx), bits(&dx_ref), "dx rows={rows} cols={cols}");
                assert_eq!(bits(&dw), bits(&dw_ref), "dw rows={rows} cols={cols}");
                assert_eq!(bits(&db), bits(&db_ref), "db rows={rows} cols={cols}");
            }
        }
    }

    #[test]
    fn grouped_rows_match_the_lane_loop_at_every_width() {
        every_width!(at_width);
    }
}
