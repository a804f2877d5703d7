//! rms_norm's forward in explicit SIMD, written once for AVX-512 and AVX2
//! ([`crate::wide`]): a whole block of rows (contiguous or placed by a
//! [`RowLayout`]) in one call at the CPU's width.
//!
//! The lane loop (`forward_row`) runs one row at a time: for each, the sum
//! of squares was a call into the explicit kernel (out of line, with a
//! `vzeroupper` and the constants broadcast again after it), and bf16 rows
//! were narrowed through a scratch block. On short rows that is most of the
//! cost: QK-norm over heads of 128 read from a fused qkv (4096 tokens x 32
//! heads) ran at 0.74x a clone through torch with THP. Here the sum of
//! squares inlines ([`SumSq`]'s body at this width) and bf16 rows round in
//! registers ([`write_row`]). Short rows take the next row's sum of squares
//! before writing their own ([`sum_early`]: under 4 KiB on Intel's cores,
//! 16-bit rows of up to 128 values on AMD's).
//!
//! The values are the lane loop's, bit for bit: the same sum of squares
//! (the same explicit kernel), `1 / sqrt(ss / n + eps)` in f32, then `(x r)
//! w` for each value.
use crate::element::Element;
use crate::layout::Offsets;
use crate::rows::Order;
use crate::sum_squares::x86::SumSq;
use crate::wide::x86::write_row::{load_bf16_pair, load_bf16_pair_opt, load_n_opt, write_row, RowValues};
use crate::wide::x86::{load_n as load, Kernel, Lanes};

/// The forward over the rows `at` places in `x` (each `cols` long), into
/// `y` (whole rows), with `w` of `cols` when given, storing in `order`;
/// where `round`, `x r` is rounded to `T` before the weight multiplies it
/// (`Rounding::BeforeWeight`).
/// For `T` in f32, bf16, f16 only (the callers check
/// [`crate::wide::has_lanes`]).
pub(super) struct Forward<'a, T> {
    pub(super) x: &'a [T],
    pub(super) at: Offsets,
    pub(super) w: Option<&'a [T]>,
    pub(super) y: &'a mut [T],
    pub(super) cols: usize,
    pub(super) eps: f32,
    pub(super) round: bool,
    pub(super) order: Order,
}

impl<T: Element> Kernel for Forward<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Forward { x, mut at, w, y, cols, eps, round, order } = self;
        let rows = y.len() / cols;
        if let Some(w) = w {
            assert_eq!(w.len(), cols, "rms_norm x86: the weight is not one row long");
        }
        if rows == 0 {
            return;
        }
        let row_bytes = cols * std::mem::size_of::<T>();
        let k = rows_ahead(row_bytes);
        // Short rows take their sum of squares one row early ([`sum_early`]):
        // the row prefetched is then one further on, `lead + k` from the row written.
        let early = sum_early::<T>(row_bytes);
        let lead = usize::from(early);
        let last = rows - 1;
        match order {
            Order::Ascending => {
                let mut ah = at.skip(k + lead);
                let mut cur = scaled_row(l, x, &at, cols, eps);
                for (r, y) in y.chunks_exact_mut(cols).enumerate() {
                    // The tests check the row prefetched (a wrong one would
                    // only cost time, and may lie inside `x`).
                    #[cfg(test)]
                    assert_eq!(ah.row(), r + lead + k, "rms_norm x86: the row ahead");
                    let ahead = if r + lead + k < rows { &x[ah.get()..][..cols] } else { &[] };
                    ah.advance();
                    let mut next = cur;
                    if early && r < last {
                        at.advance();
                        next = scaled_row(l, x, &at, cols, eps);
                    }
                    norm_row(l, cur, ahead, w, y, round, order);
                    if !early && r < last {
                        at.advance();
                        next = scaled_row(l, x, &at, cols, eps);
                    }
                    cur = next;
                }
            }
            Order::Descending => {
                let mut ah = at.skip(rows.saturating_sub(k + lead + 1));
                let mut at = at.skip(last);
                let mut cur = scaled_row(l, x, &at, cols, eps);
                for (r, y) in y.chunks_exact_mut(cols).enumerate().rev() {
                    #[cfg(test)]
                    assert!(r < k + lead || ah.row() == r - k - lead, "rms_norm x86: the row ahead");
                    let ahead = if r >= k + lead { &x[ah.get()..][..cols] } else { &[] };
                    if r > k + lead {
                        ah.retreat();
                    }
                    let mut next = cur;
                    if early && r > 0 {
                        at.retreat();
                        next = scaled_row(l, x, &at, cols, eps);
                    }
                    norm_row(l, cur, ahead, w, y, round, order);
                    if !early && r > 0 {
                        at.retreat();
                        next = scaled_row(l, x, &at, cols, eps);
                    }
                    cur = next;
                }
            }
        }
    }
}

/// Whether rows of `row_bytes` bytes of `T` take their sum of squares (and
/// `1 / rms`) one row early: row `r + 1`'s before row `r` is written, so
/// that its horizontal sum, divide and square root (a chain of dependent
/// steps) run while row `r` is written, not between row `r`'s stores and
/// row `r + 1`'s. The values are the same either way; only the time
/// differs, and it differs by vendor. On Intel's cores, rows under
/// [`SUM_EARLY_BELOW`] bytes; on others, 16-bit rows of at most
/// [`SUM_EARLY_AMD_MAX`] bytes, and f32 rows never.
#[inline(always)]
fn sum_early<T>(row_bytes: usize) -> bool {
    if crate::simd::intel() {
        row_bytes < SUM_EARLY_BELOW
    } else {
        std::mem::size_of::<T>() == 2 && row_bytes <= SUM_EARLY_AMD_MAX
    }
}

/// The rows [`sum_early`] takes early on AMD's cores (and any other
/// vendor's but Intel's): 16-bit rows of up to 128 values (QK-norm's heads
/// of 128 among them).
///
/// Measured on the 2-core Zen 4 VM (session 70), `[4096 * 4096 / cols,
/// cols]`, two threads, outputs used before, early or not switched at run
/// time and interleaved in one process (medians of 41 rounds; two to five
/// runs a row; time taking the sum early over time without): bf16 rows of
/// 64 0.91, of 128 0.93-0.97; of 192 1.05-1.08, of 256 1.03-1.07, of 384
/// and 512 1.03-1.12, of 768 to 2000 1.06-1.14 (the AVX2 code on the same
/// CPU: rows of 256 to 2000 1.07-1.18). f32 rows of 64 1.16-1.27, of 128 to
/// 512 0.94-1.15 (memory-bound, and noisy), of 768 to 1023 1.04-1.11. Into
/// fresh huge pages, within 3% either way. The extra row of prefetch
/// distance that the early sum brings is not what costs: without it, bf16
/// rows of 256 to 2000 moved by -4% to +4%. Built both ways and run in
/// separate processes alternated eight times (two builds that differ only
/// in this rule for f32; a third, the code before, differed from both by up
/// to 20% on f32 rows where it takes the same path, so only the two are
/// compared): f32 never early took 0.90, 0.95, 0.96 and 0.92 of the time of
/// f32 under 4 KiB early, on rows of 64, 256, 512 and 1000.
const SUM_EARLY_AMD_MAX: usize = 256;

/// The rows [`sum_early`] takes early on Intel's cores: those shorter than
/// this many bytes. Longer rows keep one row at a time, which measured
/// faster for them (below).
///
/// On the Xeon, two threads, bf16 rows read in place into outputs used
/// before, both ways interleaved in one process (medians of 31 rounds, two
/// runs; session 65): with AVX2, heads of 128 from a fused qkv (QK-norm)
/// 2.90-3.10 -> 2.55-2.58 ms, contiguous rows of 128 2.75-3.16 ->
/// 2.22-2.62, of 512 and 1024 4-5% faster; with AVX-512, 2-9% faster on
/// rows of 128 (qkv 2.01-2.21 -> 1.97-2.04), rows of 512 between 2% slower
/// and 7% faster. Into fresh huge pages, no change beyond the noise (AVX-512
/// qkv 4.89-4.98 ms both ways). f32 rows, bound by memory, moved 0-2%.
/// Rows of 2048 bf16 (4 KiB) were 7-12% slower with AVX2 taken early;
/// of 4096, 0-5% slower.
const SUM_EARLY_BELOW: usize = 4096;

/// The row at `at` in `x` (`cols` long) and its `1 / rms`, the first half
/// of [`norm_row`]'s work.
#[inline(always)]
fn scaled_row<'a, L: Lanes, T: Element>(l: L, x: &'a [T], at: &Offsets, cols: usize, eps: f32) -> (&'a [T], f32) {
    let xr = &x[at.get()..][..cols];
    (xr, super::inv_rms(SumSq(xr).run(l), cols, eps))
}

/// How far ahead of the row it works on the kernel prefetches: the row
/// at least [`AHEAD_BYTES`] further on (the next row where a row is that
/// long).
fn rows_ahead(row_bytes: usize) -> usize {
    AHEAD_BYTES.div_ceil(row_bytes.max(1)).max(1)
}

/// How many bytes of input ahead [`Forward`] prefetches. The next row was
/// too close for short rows: QK-norm, heads of 128 from a fused qkv
/// (4096 tokens x 32 heads, each token's q 8 KiB between 16 KiB of k and
/// v), spends about 30 ns on a row, less than a miss to memory. Through
/// torch, 2 threads, the same build with the distance switched in one
/// process (medians, ms): bf16 with THP (rows written descending) 4.55 ->
/// 3.84 (8 rows ahead 3.90, 64 rows 3.96), a clone of q 3.68; without THP
/// 8.36 -> 7.73 (clone 8.18); f32 with THP 7.14 -> 6.86-7.00; contiguous
/// rows of 128 gained 2-5% (bf16 3.72 -> 3.59 with THP).
const AHEAD_BYTES: usize = 4096;

/// One row of [`Forward`]: `x` normalised by its `1 / rms` `rs` (from
/// [`scaled_row`]), rounded to `T` where `round`, times `w`, into `y` in
/// `order`, prefetching `ahead` (a row to come, or empty).
#[inline(always)]
fn norm_row<L: Lanes, T: Element>(
    l: L,
    (x, rs): (&[T], f32),
    ahead: &[T],
    w: Option<&[T]>,
    y: &mut [T],
    round: bool,
    order: Order,
) {
    write_scaled(l, x, w, rs, y, ahead, round, order);
}

/// One row's input, the weight and `1 / rms`; `ROUND`: whether `x r` is
/// rounded to `T` before the weight.
#[derive(Clone, Copy)]
pub(crate) struct Row<T, V, const ROUND: bool> {
    x: *const T,
    w: Option<*const T>,
    r: V,
    /// `x` and `w` hold this many values.
    len: usize,
}

/// Writes the normalised row `x` (`1 / rms` = `rs`), rounded to `T` where
/// `round`, times `w` into `y`, as [`Forward`] does, prefetching `ahead`:
/// fused_add_rms_norm's kernel runs it on the sum row it has just written.
#[inline(always)]
pub(crate) fn write_normed<L: Lanes, T: Element>(
    l: L,
    x: &[T],
    w: Option<&[T]>,
    rs: f32,
    y: &mut [T],
    ahead: &[T],
    round: bool,
) {
    if let Some(w) = w {
        assert_eq!(w.len(), x.len(), "rms_norm x86: the weight is not one row long");
    }
    write_scaled(l, x, w, rs, y, ahead, round, Order::Ascending);
}

/// `x rs` (rounded to `T` where `round`) times `w` into `y` in `order`,
/// prefetching `ahead`: [`write_row`] of a [`Row`] whose rounding is a
/// constant, so that the row loop of each is compiled on its own (a flag
/// read in the loop cost the default 2-8%: the bf16 in-place
/// fused_add_rms_norm and QK-norm's heads, criterion on the Xeon).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn write_scaled<L: Lanes, T: Element>(
    l: L,
    x: &[T],
    w: Option<&[T]>,
    rs: f32,
    y: &mut [T],
    ahead: &[T],
    round: bool,
    order: Order,
) {
    let (x, w, r, len) = (x.as_ptr(), w.map(<[T]>::as_ptr), l.splat(rs), x.len());
    if round {
        write_row(l, Row::<T, L::V, true> { x, w, r, len }, y, &[ahead], order);
    } else {
        write_row(l, Row::<T, L::V, false> { x, w, r, len }, y, &[ahead], order);
    }
}

impl<L: Lanes, T: Copy + 'static, const ROUND: bool> RowValues<L> for Row<T, L::V, ROUND> {
    /// Multiplies of the widened inputs and the row's `rstd`.
    const ARITHMETIC: bool = true;
    #[inline(always)]
    fn len(self) -> usize {
        self.len
    }
    /// `(x r) w`, or `x r`, as the lane loop multiplies.
    #[inline(always)]
    unsafe fn value(self, l: L, i: usize, count: usize) -> L::V {
        // SAFETY: `i + count <= len` (the caller's), and `x`, `w` hold `len`
        // values; `T` is f32, bf16 or f16 (the callers check).
        unsafe { self.of(l, load(l, self.x, i, count), load_n_opt(l, self.w, i, count)) }
    }
    #[inline(always)]
    unsafe fn pair(self, l: L, i: usize) -> (L::V, L::V) {
        // SAFETY: `i + 2 N <= len` and the inputs are bf16 (the caller's).
        unsafe {
            let ((x0, x1), (w0, w1)) = (load_bf16_pair(l, self.x.add(i)), load_bf16_pair_opt(l, self.w, i));
            if let (true, Some(w0), Some(w1)) = (ROUND, w0, w1) {
                // The two vectors rounded together (`T` is bf16 here).
                let (v0, v1) = l.round_bf16_pair(l.mul(x0, self.r), l.mul(x1, self.r));
                return (l.mul(v0, w0), l.mul(v1, w1));
            }
            (self.of(l, x0, w0), self.of(l, x1, w1))
        }
    }
}

impl<T: 'static, V: Copy, const ROUND: bool> Row<T, V, ROUND> {
    /// `(x r) w`, or `x r`, of the widened `x` and `w`; `T(x r) w` where
    /// `ROUND`.
    #[inline(always)]
    fn of<L: Lanes<V = V>>(self, l: L, x: V, w: Option<V>) -> V {
        let v = l.mul(x, self.r);
        match w {
            Some(w) if ROUND => l.mul(l.round_to::<T>(v), w),
            Some(w) => l.mul(v, w),
            None => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Forward;
    use crate::element::Element;
    use crate::layout::RowLayout;
    use crate::rows::ORDERS;
    use crate::sum_squares::x86::SumSq;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// The kernel against the lane loop's formulas, bit for bit, at every
    /// width: row widths with and without part vectors and bf16
    /// pairs, contiguous and strided rows (gaps between them, and a second
    /// leading dim), with and without a weight, and tiny weights whose
    /// outputs are f32 subnormals (rounded in software for bf16), and NaN
    /// and infinities in row 1 and in a third weight (bf16 rows on AVX2
    /// round in registers with no NaN check: `RowValues::ARITHMETIC`; a NaN
    /// counts as any NaN, as LLVM orders a multiply's operands its own way
    /// in each type's code), each with `x r` rounded to `T` before the
    /// weight and without. `x` ends with the last row, and the kernel
    /// asserts (in tests) the row it prefetches.
    fn check<T: Element<Acc = f32>, L: Width>(l: L) {
        // `sum_early` takes rows of up to 128 16-bit values early on
        // every vendor, and rows of 4 KiB or more (1100 f32; 2100 any
        // type) on none, so both paths run here on either.
        for cols in [1usize, 16, 31, 32, 33, 100, 128, 300, 1100, 2100] {
            // 60 and 65 rows: more than the rows prefetched ahead at most
            // widths (65 = 64 + 1 for rows of 64 bytes).
            for (sizes, gap) in [([6usize, 1], 0usize), ([3, 2], 5), ([20, 3], 5), ([65, 1], 0)] {
                let (rows, stride) = (sizes[0] * sizes[1], cols + gap);
                let layout = RowLayout::new(&sizes, &[sizes[1] * stride, stride]).expect("two dims");
                let mut x: Vec<T> = (0..(rows - 1) * stride + cols)
                    .map(|i| T::from_f64(((i * 37 % 101) as f64 - 50.0) / 13.0))
                    .collect();
                let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -f64::NAN].map(T::from_f64);
                for (j, v) in x[layout.offset(1)..][..cols].iter_mut().enumerate().filter(|(j, _)| j % 9 == 4) {
                    *v = specials[j % 4];
                }
                let w: Vec<T> = (0..cols).map(|j| T::from_f64(0.5 + (j % 7) as f64 / 8.0)).collect();
                let tiny: Vec<T> = (0..cols).map(|j| T::from_f64(1e-38 * (1 + j % 3) as f64)).collect();
                let odd: Vec<T> = (0..cols).map(|j| if j % 6 == 5 { specials[j % 4] } else { w[j] }).collect();
                let weights = [Some(&w[..]), Some(&tiny[..]), Some(&odd[..]), None];
                let cases = weights.into_iter().flat_map(|w| ORDERS.map(|o| (w, o)));
                for ((w, order), round) in cases.flat_map(|c| [(c, false), (c, true)]) {
                    let mut y = vec![T::default(); rows * cols];
                    let k = Forward { x: &x, at: layout.offsets_from(0), w, y: &mut y, cols, eps: 1e-6, round, order };
                    run_with(l, k);
                    // The lane loop's formulas in scalar code, with the sum
                    // of squares of this width (the lane loop takes the
                    // CPU's best).
                    let mut want = vec![T::default(); rows * cols];
                    for (r, want) in want.chunks_exact_mut(cols).enumerate() {
                        let row = &x[layout.offset(r)..][..cols];
                        let rs = 1.0 / (run_with(l, SumSq(row)) / cols as f32 + 1e-6).sqrt();
                        for (j, want) in want.iter_mut().enumerate() {
                            let v = row[j].to_acc() * rs;
                            let normed = if round { T::from_acc(v).to_acc() } else { v };
                            *want = T::from_acc(w.map_or(v, |w| normed * w[j].to_acc()));
                        }
                    }
                    let bits = |v: &[T]| {
                        v.iter()
                            .map(|v| v.to_f64())
                            .map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() })
                            .collect::<Vec<_>>()
                    };
                    if cols > 4 {
                        assert!(y[cols..2 * cols].iter().all(|v| v.to_f64().is_nan()), "row 1 is NaN");
                    }
                    assert_eq!(
                        bits(&y),
                        bits(&want),
                        "{} cols={cols} sizes={sizes:?} w={} {order:?} round={round}",
                        T::NAME,
                        w.is_some()
                    );
                }
            }
        }
    }

    fn at_width<L: Width>(l: L) {
        check::<f32, L>(l);
        check::<bf16, L>(l);
        check::<f16, L>(l);
    }

    #[test]
    fn forward_is_the_lane_loops_at_every_width() {
        every_width!(at_width);
    }
}
