//! fused_add_rms_norm's forwards, out of place and in place, in explicit
//! SIMD written once for AVX-512 and AVX2 ([`crate::wide`]).
//!
//! Each row: `s = x + r` rounded to `T` into the sum row (`sum`, or the
//! residual in place), its sum of squares read back from L1, then the norm
//! written as rms_norm's kernel writes it ([`write_normed`]). The sum pass
//! prefetches the next row's `x`, the norm pass its `r`.
//!
//! The lane loop ran f16 rows widened into f32 scratch rows first
//! (`widen.rs`), and bf16 and f32 rows through LLVM's vectorisation of the
//! generic loop. Measured, criterion 4096x4096 on the AVX-512 Xeon: see
//! `BENCHMARKS.md`, session 29.
//!
//! The values are the lane loop's, bit for bit: the sum in f32 rounded once
//! to `T`, the same sum of squares (the same explicit kernel), `1 /
//! sqrt(ss / n + eps)`, then `(s r) w` for each value (`T(s r) w` where
//! `round`: `Rounding::BeforeWeight`).
use crate::element::Element;
use crate::rms_norm::inv_rms;
use crate::rms_norm::x86::write_normed;
use crate::rows::Order;
use crate::sum_squares::x86::SumSq;
use crate::wide::is;
use crate::wide::x86::write_row::{load_bf16_pair, write_row, RowValues};
use crate::wide::x86::{load_n as load, Kernel, Lanes};
use half::bf16;

/// The forward over whole rows of `cols`: `x`, `r`, `y` and `s` of one
/// length, `w` of `cols` when given. For `T` in f32, bf16, f16 only (the
/// callers check [`crate::wide::has_lanes`]).
pub(super) struct Forward<'a, T> {
    pub(super) x: &'a [T],
    pub(super) r: &'a [T],
    pub(super) w: Option<&'a [T]>,
    pub(super) y: &'a mut [T],
    pub(super) s: &'a mut [T],
    pub(super) cols: usize,
    pub(super) eps: f32,
    pub(super) round: bool,
}

impl<T: Element> Kernel for Forward<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Forward { x, r, w, y, s, cols, eps, round } = self;
        let n = y.len();
        assert!(cols > 0 && n % cols == 0 && x.len() == n && r.len() == n && s.len() == n, "fused_add x86: rows");
        let rows = n / cols;
        for row in 0..rows {
            let span = row * cols..(row + 1) * cols;
            let (ahead_x, ahead_r): (&[T], &[T]) =
                if row + 1 < rows { (&x[span.end..][..cols], &r[span.end..][..cols]) } else { (&[], &[]) };
            let sr = &mut s[span.clone()];
            write_row(
                l,
                Add { x: x[span.clone()].as_ptr(), r: r[span.clone()].as_ptr(), len: cols },
                sr,
                &[ahead_x],
                Order::Ascending,
            );
            let rs = inv_rms(SumSq(&*sr).run(l), cols, eps);
            write_normed(l, sr, w, rs, &mut y[span], ahead_r, round);
        }
    }
}

/// [`Forward`] in place: `r` becomes the sum, `x` the output.
///
/// The sum: f32, and bf16 at a width that rounds bf16 in registers
/// (AVX512-BF16), take the lane loop's own in-place update of `r`
/// (`add_into`). f16, and bf16 elsewhere (AVX2), copy each row of `r` to a
/// scratch row and write the sum over it with the vector code, from inputs
/// that no output aliases, prefetching the next row of `r` as they go (the
/// norm pass prefetches its `x`). f16's update converts in software in the
/// lane loop (37 ms at 4096x4096, against 3 here). For bf16 on AVX2 the
/// lane loop's update was as fast as the copy without the prefetch; with
/// it, `[4096, 4096]` on a 2-core Zen 3, alternated in one process, medians
/// of 200 rounds (session 58): bf16 0.80-0.93 new/old, f16 0.82-0.86
/// against the copy without the prefetch. The AVX2 code on a Zen 4 (session
/// 70, medians of 41, two runs): the copy 0.85-0.92 of the update's time at
/// `[32 | 256 | 1024 | 4096, 4096]`. With AVX512-BF16 on the Zen 4 the
/// update is the faster: the copy took 1.08-1.10x its time at `[32, 4096]`
/// and `[256, 4096]` (in cache), 0.97-1.01x at `[1024, 4096]` and
/// `[4096, 4096]`; the update with the next row of `r` prefetched as it
/// goes (in parts of 256 values) was slower than either (1.03-1.11x the
/// plain update). Not measured on an Intel CPU. f32 stays: its copy cost 14%
/// (1.14), and the norm pass prefetching the next `r` as well gained under
/// 2%.
pub(super) struct ForwardInplace<'a, T> {
    pub(super) x: &'a mut [T],
    pub(super) r: &'a mut [T],
    pub(super) w: Option<&'a [T]>,
    pub(super) cols: usize,
    pub(super) eps: f32,
    pub(super) round: bool,
}

impl<T: Element> Kernel for ForwardInplace<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let ForwardInplace { mut x, mut r, w, cols, eps, round } = self;
        let n = x.len();
        assert!(cols > 0 && n % cols == 0 && r.len() == n, "fused_add x86 in place: rows");
        // The lane loop's update where it takes the sum (see the doc above).
        let in_place = is::<T, f32>() || (is::<T, bf16>() && L::ROUNDS_BF16);
        let mut copy = if in_place { Vec::new() } else { vec![T::default(); cols] };
        while !x.is_empty() {
            let (xr, x_rest) = std::mem::take(&mut x).split_at_mut(cols);
            let (rr, r_rest) = std::mem::take(&mut r).split_at_mut(cols);
            if copy.is_empty() {
                super::add_into(xr, rr);
            } else {
                copy.copy_from_slice(rr);
                let ahead_r: &[T] = if r_rest.is_empty() { &[] } else { &r_rest[..cols] };
                write_row(l, Add { x: xr.as_ptr(), r: copy.as_ptr(), len: cols }, rr, &[ahead_r], Order::Ascending);
            }
            let rs = inv_rms(SumSq(&*rr).run(l), cols, eps);
            let ahead = if x_rest.is_empty() { &[][..] } else { &x_rest[..cols] };
            write_normed(l, rr, w, rs, xr, ahead, round);
            (x, r) = (x_rest, r_rest);
        }
    }
}

/// `x + r`, each widened to f32.
#[derive(Clone, Copy)]
struct Add<T> {
    x: *const T,
    r: *const T,
    /// `x` and `r` hold this many values.
    len: usize,
}

impl<L: Lanes, T: Copy + 'static> RowValues<L> for Add<T> {
    /// An add of the widened inputs.
    const ARITHMETIC: bool = true;
    #[inline(always)]
    fn len(self) -> usize {
        self.len
    }
    #[inline(always)]
    unsafe fn value(self, l: L, i: usize, count: usize) -> L::V {
        // SAFETY: `i + count <= len` (the caller's), and `x`, `r` hold `len`
        // values; `T` is f32, bf16 or f16 (the callers check).
        unsafe { l.add(load(l, self.x, i, count), load(l, self.r, i, count)) }
    }
    #[inline(always)]
    unsafe fn pair(self, l: L, i: usize) -> (L::V, L::V) {
        // SAFETY: `i + 2 N <= len` and the inputs are bf16 (the caller's).
        unsafe {
            let ((x0, x1), (r0, r1)) = (load_bf16_pair(l, self.x.add(i)), load_bf16_pair(l, self.r.add(i)));
            (l.add(x0, r0), l.add(x1, r1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Forward, ForwardInplace};
    use crate::element::Element;
    use crate::sum_squares::x86::SumSq;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// Both kernels against the lane loop's formulas, bit for bit, at every
    /// width: widths with and without part vectors and bf16 pairs, with and
    /// without a weight, sums that round and one that overflows to inf, and
    /// NaN and infinities in `x` and in a weight (bf16 rows on AVX2 round in
    /// registers with no NaN check: `RowValues::ARITHMETIC`; a NaN counts as
    /// any NaN, as LLVM orders an operation's operands its own way in each
    /// type's code), each with `s r` rounded to `T` before the weight and
    /// without.
    fn check<T: Element<Acc = f32>, L: Width>(l: L) {
        for cols in [1usize, 16, 31, 32, 33, 100, 300, 1031] {
            let rows = 5;
            let n = rows * cols;
            let x: Vec<T> = (0..n).map(|i| T::from_f64(((i * 37 % 101) as f64 - 50.0) / 13.0)).collect();
            let mut r: Vec<T> = (0..n).map(|i| T::from_f64(((i * 53 % 97) as f64 - 48.0) / 7.0)).collect();
            r[cols.min(n - 1)] = T::from_f64(6.0e4);
            let mut x2 = x.clone();
            x2[cols.min(n - 1)] = T::from_f64(6.0e4);
            let w: Vec<T> = (0..cols).map(|j| T::from_f64(0.5 + (j % 7) as f64 / 8.0)).collect();
            let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -f64::NAN].map(T::from_f64);
            let mut x3 = x.clone();
            for (j, v) in x3.iter_mut().enumerate().filter(|(j, _)| j % 11 == 3) {
                *v = specials[j % 4];
            }
            let odd: Vec<T> = (0..cols).map(|j| if j % 6 == 5 { specials[j % 4] } else { w[j] }).collect();
            let cases = [(&x, Some(&w[..])), (&x2, Some(&w[..])), (&x, None), (&x3, Some(&odd[..]))];
            for ((x, w), round) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
                let (mut y, mut s) = (vec![T::default(); n], vec![T::default(); n]);
                run_with(l, Forward { x, r: &r, w, y: &mut y, s: &mut s, cols, eps: 1e-6, round });
                let (mut xi, mut ri) = (x.clone(), r.clone());
                run_with(l, ForwardInplace { x: &mut xi, r: &mut ri, w, cols, eps: 1e-6, round });
                let mut s_want: Vec<T> = x.iter().zip(&r).map(|(a, b)| T::from_acc(a.to_acc() + b.to_acc())).collect();
                let mut y_want = vec![T::default(); n];
                for (srow, yrow) in s_want.chunks_exact_mut(cols).zip(y_want.chunks_exact_mut(cols)) {
                    let rs = 1.0 / (run_with(l, SumSq(&*srow)) / cols as f32 + 1e-6).sqrt();
                    for (j, (y, s)) in yrow.iter_mut().zip(srow.iter()).enumerate() {
                        let v = s.to_acc() * rs;
                        let normed = if round { T::from_acc(v).to_acc() } else { v };
                        *y = T::from_acc(w.map_or(v, |w| normed * w[j].to_acc()));
                    }
                }
                let bits = |v: &[T]| {
                    v.iter()
                        .map(|v| v.to_f64())
                        .map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() })
                        .collect::<Vec<_>>()
                };
                let case = format!("{} cols={cols} weight={} round={round}", T::NAME, w.is_some());
                assert_eq!(bits(&s), bits(&s_want), "{case}: sum");
                assert_eq!(bits(&y), bits(&y_want), "{case}: out");
                assert_eq!(bits(&ri), bits(&s_want), "{case}: sum in place");
                assert_eq!(bits(&xi), bits(&y_want), "{case}: out in place");
            }
        }
    }

    #[test]
    fn kernels_match_the_lane_loop_at_every_width() {
        fn all<L: Width>(l: L) {
            check::<f32, L>(l);
            check::<bf16, L>(l);
            check::<f16, L>(l);
        }
        every_width!(all);
    }
}
