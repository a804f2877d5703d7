//! layer_norm's backward in the training case (a weight, and the gradients
//! of the weight and the bias) for f32 and bf16, in explicit SIMD written
//! once for AVX-512 and AVX2 ([`crate::wide`]), two rows at a time.
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
//! Here each vector of `w`, `dw` and `db` is loaded and stored once per two
//! rows (see [`GROUP`] for why not four), and each column's loads come before
//! its stores (see [`step`]). Each value
//! is the lane loop's, bit for bit: the rows' moments and gradient means come
//! from the same function ([`super::row_consts`]), and every element takes
//! the same operations in the same order (`dw` and `db` still add the rows
//! one after the other); the tests compare both at every width.
//!
//! bf16 had the same two costs (perf on the Xeon, 4096x4096: the `dw` and
//! `db` stores, and the moments pass waiting on memory for every row) and
//! runs the same walk: `dx` goes to an f32 block per row and part, rounded
//! into the row with [`Element::from_acc_slice`] (AVX512-BF16's conversion
//! where the CPU has it), which rounds as the lane loop's `from_acc`; on
//! AVX2, `dx` is rounded in registers instead ([`bf16_pairs`]).
//!
//! f16 runs the same walk (its loads and its rounding of `dx` are F16C's),
//! and its rows' one-pass sums run here in vectors ([`moment_grad_sums`]),
//! in the lane loop's order: the lane loop's sums over f16 convert each value
//! in software. Measured, criterion 4096x4096 on the AVX-512 Xeon: see
//! `BENCHMARKS.md`, session 29.
use super::x86::minus;
use super::{lane_sums, row_consts};
use crate::element::Element;
use crate::simd::{intel, prefetch_part_l2, prefetch_write_ahead, reduce_lanes, LANES};
use crate::wide::x86::{load_n as load, store_n as store, walk_columns, Kernel, Lanes};
use crate::wide::{cast_mut, is};
use half::{bf16, f16};

/// Rows whose columns are walked together.
///
/// Four rows, and a prefetch of the next four as the columns went, were
/// measured faster than the row loop on an AVX-512 Xeon (session 22). On a
/// Zen 4, whose L1 has 8 ways (the Xeon's 12), rows of 4096 f32 are 16 KiB
/// apart, so the four rows' `x`, `dy` and `dx` fall in one L1 set at every
/// column: 12 lines for 8 ways. Two rows, without the software prefetch
/// (which brought lines into the same sets), measured 1.1-1.8x faster there
/// (f32, 32 to 4096 rows; BENCHMARKS.md, session 40).
///
/// Without a prefetch, each group waits on memory: its moments pass reads
/// `x`, and its gradient sums `dy`, each from memory, one row after the
/// other, and memory is idle while the columns are walked in cache. On
/// AVX-512 the next group's `x` and `dy` are fetched into L2 (`prefetcht1`,
/// [`prefetch_part_l2`]) during the walk, a part's share at a time, in
/// their own order rather than the walk's columns: the L1 sets stay this
/// group's. Measured on a 2-core AVX-512 Xeon, f32 4096x4096: 14.1 -> 10.9
/// ms a call (BENCHMARKS.md, session 61). Only Intel's AVX-512 cores take
/// it: on the Zen 4 VM (session 69, the prefetch switched at run time,
/// interleaved, medians of 31-101) the walk without it took 0.89-0.95 of
/// the time for f32 4096x4096 into reused outputs, 0.88 for 8192x2048,
/// 0.95-0.97 for bf16, 0.95-1.00 into fresh huge pages; only f32 512x4096
/// gained from it (1.02-1.03). AMD's AVX2-only cores fill L1 on this hint,
/// into this walk's sets, and were not measured with it.
const GROUP: usize = 2;

/// The shortest rows, in bytes, whose next group is prefetched (see
/// [`GROUP`]): rows of 1 KiB (f32 256 wide) were 7-24% slower with it,
/// rows of 4 KiB between 20% slower and 18% faster, rows of 8 and 16 KiB
/// 10-29% faster (f32 and bf16; BENCHMARKS.md, session 61).
const AHEAD_ROW_BYTES: usize = 8192;

/// Columns walked at a time: for bf16 and f16, those of each `dx` block
/// rounded at once (f32 walks its rows in parts of the same size).
const PART: usize = 256;

/// The backward over whole rows of `cols`: `x`, `dy` and `dx` of one length,
/// `w`, `dw` and `db` of `cols`; `dw` and `db` are added to. `cols > 0`; `T`
/// is f32, bf16 or f16.
pub(super) struct Backward<'a, T> {
    pub(super) x: &'a [T],
    pub(super) dy: &'a [T],
    pub(super) w: &'a [T],
    pub(super) dx: &'a mut [T],
    pub(super) dw: &'a mut [f32],
    pub(super) db: &'a mut [f32],
    pub(super) cols: usize,
    pub(super) eps: f32,
}

impl<T: Element<Acc = f32>> Kernel for Backward<'_, T> {
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
            let at = r * cols;
            // SAFETY (both): rows `r..r + g` lie inside `x`, `dy` and `dx`,
            // each `cols` long; `w`, `dw` and `db` hold `cols` (asserted).
            if g == GROUP {
                unsafe { group::<L, T, GROUP>(l, (x, dy, w), (dx, dw, db), at, cols, eps) };
            } else {
                unsafe { group::<L, T, 1>(l, (x, dy, w), (dx, dw, db), at, cols, eps) };
            }
            r += g;
        }
    }
}

/// The inputs of a group's column walk: each row's `x` and `dy`, then `w`.
type Ins<T, const G: usize> = ([*const T; G], [*const T; G], *const T);

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
unsafe fn group<L: Lanes, T: Element<Acc = f32>, const G: usize>(
    l: L,
    (x, dy, w): (&[T], &[T], &[T]),
    (dx, dw, db): (&mut [T], &mut [f32], &mut [f32]),
    at: usize,
    cols: usize,
    eps: f32,
) {
    // Plain loops, not `array::from_fn`: its closure was left out of line,
    // and so ran the moments' passes without the vector features (perf: a
    // third of the time, in SSE2).
    let zero = l.splat(0.0);
    let mut c = [Row { k: zero, m1: zero, rstd: zero, mg: zero, mgx: zero }; G];
    let (mut xs, mut dys) = ([x.as_ptr(); G], [dy.as_ptr(); G]);
    let narrow = !is::<T, f32>();
    let mut shifted = false;
    for r in 0..G {
        let span = at + r * cols..at + (r + 1) * cols;
        let (xr, dyr) = (&x[span.clone()], &dy[span.clone()]);
        // f16's one-pass sums in vectors (the lane loop's convert each value
        // in software); f32 and bf16 keep the lane loop's.
        let sums = |k| if is::<T, f16>() { vector_sums(l, xr, dyr, w, k) } else { lane_sums(xr, dyr, Some(w), k) };
        let (m, (mg, mgx)) = row_consts(xr, dyr, Some(w), eps, narrow, sums);
        c[r] = Row { k: l.splat(m.k), m1: l.splat(m.m1), rstd: l.splat(m.rstd), mg: l.splat(mg), mgx: l.splat(mgx) };
        shifted |= m.k != 0.0;
        xs[r] = x[span.clone()].as_ptr();
        dys[r] = dy[span].as_ptr();
    }
    let ins = (xs, dys, w.as_ptr());
    // SAFETY (both): the caller's bounds.
    if shifted {
        unsafe { walk::<L, T, G, true>(l, &c, ins, (x, dy), (dx, dw, db), at, cols) };
    } else {
        unsafe { walk::<L, T, G, false>(l, &c, ins, (x, dy), (dx, dw, db), at, cols) };
    }
}

/// [`group`]'s walk over the columns, given its rows' constants: `dx`
/// written, `dw` and `db` added to. Without `x - k` where not `SHIFTED`
/// (every row's `k` is 0: see `layer_norm::shift`; `x - 0` is `x`).
///
/// # Safety
/// As [`group`]'s, with `ins` the group's rows of `x` and `dy`, and `w`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn walk<L: Lanes, T: Element<Acc = f32>, const G: usize, const SHIFTED: bool>(
    l: L,
    c: &[Row<L::V>; G],
    ins: Ins<T, G>,
    (x, dy): (&[T], &[T]),
    (dx, dw, db): (&mut [T], &mut [f32], &mut [f32]),
    at: usize,
    cols: usize,
) {
    let (dw, db) = (dw.as_mut_ptr(), db.as_mut_ptr());
    if let Some(dx) = cast_mut::<T, bf16>(&mut *dx).filter(|_| !L::ROUNDS_BF16) {
        // SAFETY: the caller's bounds, for the rows' `dx` too.
        unsafe { bf16_pairs::<L, T, G, SHIFTED>(l, c, ins, dx, (dw, db), at, cols) };
        return;
    }
    // `step` writes f32's `dx` into the rows; bf16's into f32 blocks of one
    // part, which are then rounded into the rows.
    let f32_rows = cast_mut::<T, f32>(&mut *dx).map(|dx| row_ptrs::<f32, G>(dx, at, cols));
    let mut buf = [[0f32; PART]; G];
    // Intel's AVX-512: the next group's rows (`G cols` values from `at + G
    // cols`, as far as they reach) fetched into L2 a part at a time while
    // this group's columns are walked (see `GROUP`).
    let next = at + G * cols;
    let ahead = [x.get(next..).unwrap_or(&[]), dy.get(next..).unwrap_or(&[])];
    let ahead_on = L::N == 16 && cols * size_of::<T>() >= AHEAD_ROW_BYTES && intel();
    let mut p = 0;
    while p < cols {
        let len = PART.min(cols - p);
        if ahead_on {
            for a in ahead {
                prefetch_part_l2(a, p / PART, G * PART);
            }
        }
        let outs = match f32_rows {
            Some(rows) => (rows, 0),
            None => (block_ptrs(&mut buf), p),
        };
        walk_columns::<L>(
            len,
            // SAFETY: `count` columns from `p + i` lie inside every row's
            // `cols` (the caller's bounds), and from `i` inside the blocks.
            #[inline(always)]
            |i, count| unsafe { step::<L, T, G, SHIFTED>(l, c, ins, outs, (dw, db), p + i, count) },
        );
        if f32_rows.is_none() {
            for (r, b) in buf.iter().enumerate() {
                T::from_acc_slice(&b[..len], &mut dx[at + r * cols + p..][..len]);
            }
        }
        p += len;
    }
}

/// The column walk of [`group`] for bf16 on AVX2, whose width does not
/// convert: each row's `dx` rounded in registers, two vectors at a time,
/// with [`Lanes::store_bf16_pair_normal`] and no NaN check. Every `dx` is
/// float arithmetic on values widened from bf16 and on the row's
/// constants, so any NaN is quiet with its low 16 bits zero, which that
/// rounding keeps as `from_acc` does (`RowValues::ARITHMETIC` in
/// `wide/x86/write_row.rs` says why). The last `< 2 N` columns go through
/// small f32 blocks and `from_acc`. Through the part blocks instead, each
/// value is stored, loaded and rounded with LLVM's vectorised NaN fix-up:
/// see BENCHMARKS.md, session 55, for the figures.
///
/// # Safety
/// As [`group`]'s: `G` rows of `cols` from `at` in `dx` and behind `ins`'s
/// row pointers; `w`, `dw` and `db` hold `cols`.
#[inline(always)]
unsafe fn bf16_pairs<L: Lanes, T: 'static, const G: usize, const SHIFTED: bool>(
    l: L,
    c: &[Row<L::V>; G],
    ins: Ins<T, G>,
    dx: &mut [bf16],
    (dw, db): (*mut f32, *mut f32),
    at: usize,
    cols: usize,
) {
    let rows = row_ptrs::<bf16, G>(dx, at, cols);
    let n = 2 * L::N;
    let whole = cols / n * n;
    let mut j = 0;
    // SAFETY: columns `j..j + 2 N` lie inside every row (`j + 2 N <=
    // whole <= cols`), and the caller's bounds hold for `dw`, `db`.
    unsafe {
        while j < whole {
            let lo = values::<L, T, G, SHIFTED>(l, c, ins, (dw, db), j, L::N);
            let hi = values::<L, T, G, SHIFTED>(l, c, ins, (dw, db), j + L::N, L::N);
            for r in 0..G {
                l.store_bf16_pair_normal(rows[r].add(j), lo[r], hi[r]);
            }
            j += n;
        }
    }
    if whole < cols {
        let mut t = [[0f32; 64]; G];
        let blocks = block_ptrs(&mut t);
        walk_columns::<L>(
            cols - whole,
            // SAFETY: `count` columns from `whole + i` lie inside every
            // row, and from `i` inside the blocks (`cols - whole < 2 N <=
            // 64`).
            #[inline(always)]
            |i, count| unsafe { step::<L, T, G, SHIFTED>(l, c, ins, (blocks, whole), (dw, db), whole + i, count) },
        );
        for (r, t) in t.iter().enumerate() {
            bf16::from_acc_slice(&t[..cols - whole], &mut dx[at + r * cols + whole..][..cols - whole]);
        }
    }
}

/// Pointers to the `G` rows of `cols` values from `at` in `dx`. A plain
/// loop, as in [`group`]. Panics where `dx` does not hold them.
#[inline(always)]
fn row_ptrs<U, const G: usize>(dx: &mut [U], at: usize, cols: usize) -> [*mut U; G] {
    let mut rows = [dx.as_mut_ptr(); G];
    for (r, d) in rows.iter_mut().enumerate() {
        *d = dx[at + r * cols..][..cols].as_mut_ptr();
    }
    rows
}

/// Pointers to the first value of each of `G` blocks.
#[inline(always)]
fn block_ptrs<const G: usize, const M: usize>(blocks: &mut [[f32; M]; G]) -> [*mut f32; G] {
    let mut ptrs = [blocks[0].as_mut_ptr(); G];
    for (b, block) in ptrs.iter_mut().zip(blocks.iter_mut()) {
        *b = block.as_mut_ptr();
    }
    ptrs
}

/// [`moment_grad_sums`] for the shift `k`: without the subtraction where
/// `k` is 0 (as `layer_norm::shifted_grad_sums` for the lane loop).
#[inline(always)]
fn vector_sums<L: Lanes, T: Element<Acc = f32>>(l: L, x: &[T], dy: &[T], w: &[T], k: f32) -> [f32; 4] {
    if k == 0.0 {
        moment_grad_sums::<L, T, false>(l, x, dy, w, k)
    } else {
        moment_grad_sums::<L, T, true>(l, x, dy, w, k)
    }
}

/// `layer_norm::moment_grad_sums` with `g = dy w`, bit for bit, in vectors:
/// `[sum(x - k), sum((x - k)^2), sum(g), sum(g (x - k))]`, with `x - k`
/// only where `SHIFTED` (`x - 0` is `x`). Its `LANES` accumulators of each
/// sum are `LANES / N` vectors here (lane `i` of a chunk of `LANES` values
/// is lane `i % N` of vector `i / N`), each product and sum rounded on its
/// own as there; then its serial tail and its pairwise reduction of the
/// lanes.
// Indexed loops: `j` picks the same vector of the four accumulators.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn moment_grad_sums<L: Lanes, T: Element<Acc = f32>, const SHIFTED: bool>(
    l: L,
    x: &[T],
    dy: &[T],
    w: &[T],
    k: f32,
) -> [f32; 4] {
    const MAX: usize = 4;
    let nv = LANES / L::N;
    assert!(nv <= MAX && nv * L::N == LANES && dy.len() == x.len() && w.len() == x.len());
    let (kv, zero) = (l.splat(k), l.splat(0.0));
    let mut acc = [[zero; MAX]; 4];
    let chunks = x.len() / LANES;
    for c in 0..chunks {
        for j in 0..nv {
            let at = c * LANES + j * L::N;
            // SAFETY: `at + N <= chunks * LANES <= len` for all three slices.
            let (xv, dv, wv) =
                unsafe { (l.load(x.as_ptr().add(at)), l.load(dy.as_ptr().add(at)), l.load(w.as_ptr().add(at))) };
            let v = minus::<L, SHIFTED>(l, xv, kv);
            let g = l.mul(dv, wv);
            acc[0][j] = l.add(acc[0][j], v);
            acc[1][j] = l.add(acc[1][j], l.mul(v, v));
            acc[2][j] = l.add(acc[2][j], g);
            acc[3][j] = l.add(acc[3][j], l.mul(g, v));
        }
    }
    let mut t = [0f32; 4];
    let at = chunks * LANES;
    for ((x, d), w) in x[at..].iter().zip(&dy[at..]).zip(&w[at..]) {
        let (v, gi) = (x.to_acc() - k, d.to_acc() * w.to_acc());
        t = [t[0] + v, t[1] + v * v, t[2] + gi, t[3] + gi * v];
    }
    let mut out = [0f32; 4];
    for q in 0..4 {
        let mut lanes = [0f32; LANES];
        for j in 0..nv {
            // SAFETY: `lanes` holds `nv N = LANES` values.
            unsafe { l.store(lanes.as_mut_ptr().add(j * L::N), acc[q][j]) };
        }
        out[q] = reduce_lanes(lanes) + t[q];
    }
    out
}

/// One vector of columns `i..i + count` (`count <= N`) of every row: `dx =
/// rstd ((dy w - mg) - xh mgx)` with `xh = ((x - k) - m1) rstd`, then `dw +=
/// dy xh` and `db += dy` row after row, as the lane loop computes them. Row
/// `r`'s `dx` goes to `dxs[r]` at `i - o`.
///
/// Every row's loads come before the first store: the rows of `x`, `dy` and
/// `dx` are often a multiple of 4 KiB apart (rows of 1024 f32), so a load of
/// row `r + 1` after the store of row `r`'s `dx` shares the store's address
/// bits below 4 KiB and waited for it (Zen 4, 32x4096 f32: 0.70-0.79 ns per
/// value with the stores in the loop, 0.55-0.68 after it, four rows).
///
/// # Safety
/// `count` values from `i` are readable at every input pointer and writable
/// at `dw` and `db`, and from `i - o` writable at every `dxs` pointer.
#[inline(always)]
unsafe fn step<L: Lanes, T: 'static, const G: usize, const SHIFTED: bool>(
    l: L,
    c: &[Row<L::V>; G],
    ins: Ins<T, G>,
    (dxs, o): ([*mut f32; G], usize),
    dwb: (*mut f32, *mut f32),
    i: usize,
    count: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        let dxv = values::<L, T, G, SHIFTED>(l, c, ins, dwb, i, count);
        // f32 rows on Intel's AVX-512 ask for their `dx` lines ahead (one a row per
        // vector): on the Xeon, 4096x4096, two threads, interleaved
        // medians (session 62), 1.5-4% faster into reused outputs, 2% into
        // fresh 4 KiB pages, unchanged into fresh huge pages. (bf16's
        // pairs measured unchanged with it.)
        if L::writes_ahead() && is::<T, f32>() {
            for p in dxs {
                prefetch_write_ahead(p.add(i - o));
            }
        }
        for (r, v) in dxv.into_iter().enumerate() {
            store(l, dxs[r], i - o, v, count);
        }
    }
}

/// [`step`]'s values: every row's `dx` of columns `i..i + count`, returned,
/// with `dw` and `db` stored; every row's loads come before those stores.
///
/// # Safety
/// `count` values from `i` are readable at every input pointer and writable
/// at `dw` and `db`.
#[inline(always)]
unsafe fn values<L: Lanes, T: 'static, const G: usize, const SHIFTED: bool>(
    l: L,
    c: &[Row<L::V>; G],
    (xs, dys, w): Ins<T, G>,
    (dw, db): (*mut f32, *mut f32),
    i: usize,
    count: usize,
) -> [L::V; G] {
    // SAFETY: the caller's.
    unsafe {
        let wv = load(l, w, i, count);
        let (mut dwv, mut dbv) = (load(l, dw, i, count), load(l, db, i, count));
        let mut dxv = [wv; G];
        for r in 0..G {
            let (xv, dyv) = (load(l, xs[r], i, count), load(l, dys[r], i, count));
            let c = c[r];
            let xh = l.mul(l.sub(minus::<L, SHIFTED>(l, xv, c.k), c.m1), c.rstd);
            dxv[r] = l.mul(c.rstd, l.sub(l.sub(l.mul(dyv, wv), c.mg), l.mul(xh, c.mgx)));
            dwv = l.add(dwv, l.mul(dyv, xh));
            dbv = l.add(dbv, dyv);
        }
        store(l, dw, i, dwv, count);
        store(l, db, i, dbv, count);
        dxv
    }
}

#[cfg(test)]
mod tests {
    use super::Backward;
    use crate::element::Element;
    use crate::testing::{bf16_bits_any_nan, same_or_nan};
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// The grouped pass against the lane loop's rows (`backward_row`), bit
    /// for bit, in `T`: `dx`, and `dw`, `db` added to nonzero partials, for 1
    /// to 9 rows (whole groups, single rows after them) and widths around the
    /// vector and part sizes. Among the rows: ones whose mean is far from
    /// their spread (f32: the moments' exact second pass), and ones whose
    /// first 16 values (the shift) are far from the rest (bf16: the one-pass
    /// sums refused, and the separate passes taken). Widths of 2100 and 4500
    /// have rows long enough for the next group's prefetch (`AHEAD_ROW_BYTES`:
    /// f32 from 2048, bf16 and f16 from 4096).
    fn check<T: Element<Acc = f32>, L: Width>(l: L) {
        for cols in [1usize, 7, 16, 17, 100, 255, 256, 257, 600, 2100, 4500] {
            for rows in 1..=9 {
                let n = rows * cols;
                let x: Vec<T> = (0..n)
                    .map(|i| {
                        let v = ((i * 37 % 101) as f32 - 50.0) / 13.0;
                        T::from_acc(match (i / cols) % 4 {
                            2 => 1000.0 + v / 64.0,
                            3 if i % cols < 16 => 50.0 + v,
                            _ => v,
                        })
                    })
                    .collect();
                let dy: Vec<T> = (0..n).map(|i| T::from_acc(((i * 53 % 97) as f32 - 48.0) / 17.0)).collect();
                let w: Vec<T> = (0..cols).map(|j| T::from_acc(0.5 + (j % 7) as f32 / 8.0)).collect();
                let start: Vec<f32> = (0..cols).map(|j| j as f32 / 3.0 - 1.0).collect();
                let (mut dx, mut dw, mut db) = (vec![T::default(); n], start.clone(), start.clone());
                let eps = 1e-5f32;
                let k = Backward { x: &x, dy: &dy, w: &w, dx: &mut dx, dw: &mut dw, db: &mut db, cols, eps };
                run_with(l, k);
                let (mut dx_ref, mut dw_ref, mut db_ref) = (vec![T::default(); n], start.clone(), start);
                for ((x, dy), dx) in x.chunks(cols).zip(dy.chunks(cols)).zip(dx_ref.chunks_mut(cols)) {
                    let dwb = (Some(&mut dw_ref[..]), Some(&mut db_ref[..]));
                    super::super::backward_row(x, dy, Some(&w[..]), dx, dwb.0, dwb.1, eps, None);
                }
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let widened = |v: &[T]| v.iter().map(|v| v.to_acc()).collect::<Vec<_>>();
                let t = T::NAME;
                assert_eq!(bits(&widened(&dx)), bits(&widened(&dx_ref)), "{t} dx rows={rows} cols={cols}");
                assert_eq!(bits(&dw), bits(&dw_ref), "{t} dw rows={rows} cols={cols}");
                assert_eq!(bits(&db), bits(&db_ref), "{t} db rows={rows} cols={cols}");
            }
        }
    }

    /// bf16 NaN as the lane loop treats them (bf16 rows on AVX2 round in
    /// registers with no NaN check, `bf16_pairs`): a signalling NaN with a
    /// payload in `x` of row 1, a negative one in `dy` of row 2 (each row
    /// all NaN), and in a second call a quiet one with all payload bits in
    /// `w` (every row NaN); a NaN counts as any NaN, the rest bit for bit.
    /// 5 rows (two groups and a single row), with and without a part group.
    fn nans<L: Width>(l: L) {
        for cols in [37usize, 300] {
            let n = 5 * cols;
            let mut x: Vec<bf16> = (0..n).map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 13.0)).collect();
            let mut dy: Vec<bf16> = (0..n).map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 17.0)).collect();
            x[cols + 5] = bf16::from_bits(0x7f81);
            dy[3 * cols - 1] = bf16::from_bits(0xffbf);
            let w: Vec<bf16> = (0..cols).map(|j| bf16::from_f32(0.5 + (j % 7) as f32 / 8.0)).collect();
            let mut w_nan = w.clone();
            w_nan[cols / 2] = bf16::from_bits(0x7fff);
            for w in [w, w_nan] {
                let (mut dx, mut dw, mut db) = (vec![bf16::ZERO; n], vec![0.25f32; cols], vec![0.5f32; cols]);
                let k = Backward { x: &x, dy: &dy, w: &w, dx: &mut dx, dw: &mut dw, db: &mut db, cols, eps: 1e-5 };
                run_with(l, k);
                let (mut dx_ref, mut dw_ref, mut db_ref) =
                    (vec![bf16::ZERO; n], vec![0.25f32; cols], vec![0.5f32; cols]);
                for ((x, dy), dx) in x.chunks(cols).zip(dy.chunks(cols)).zip(dx_ref.chunks_mut(cols)) {
                    super::super::backward_row(
                        x,
                        dy,
                        Some(&w[..]),
                        dx,
                        Some(&mut dw_ref[..]),
                        Some(&mut db_ref[..]),
                        1e-5,
                        None,
                    );
                }
                let what = format!("cols={cols} w NaN: {}", w.iter().any(|v| v.is_nan()));
                assert_eq!(bf16_bits_any_nan(&dx), bf16_bits_any_nan(&dx_ref), "dx {what}");
                assert!(dx[cols..3 * cols].iter().all(|v| v.is_nan()), "rows 1 and 2 are NaN: {what}");
                assert!(
                    dw.iter().zip(&dw_ref).chain(db.iter().zip(&db_ref)).all(|(&a, &b)| same_or_nan(a, b)),
                    "dw, db {what}"
                );
            }
        }
    }

    #[test]
    fn grouped_rows_match_the_lane_loop_at_every_width() {
        fn both<L: Width>(l: L) {
            check::<f32, L>(l);
            check::<bf16, L>(l);
            check::<f16, L>(l);
            nans::<L>(l);
        }
        every_width!(both);
    }
}
