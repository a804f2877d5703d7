//! Softmax's backward in explicit SIMD, written once for AVX-512 and AVX2
//! ([`crate::wide`]): per row, `dot = sum(dy y)`, then `dx = (s y) (dy -
//! dot)`.
//!
//! The lane loop (`backward_rows_lanes`) converts f16 in software on an
//! AVX2 CPU: criterion, 4096x4096, f16 took 8.2-8.7 ms where bf16 took
//! 4.5-4.8 and f32, twice the bytes, 9.4-9.6. Here f16 loads go through
//! F16C: f16 4.5-5.2 ms, f32 8.0-8.9 (old and new alternated).
//!
//! The values are the lane loop's, given the same `dot`: the write pass
//! multiplies in its order. The sum's order differs (two vector
//! accumulators of fused multiply-adds, then a tree over the lanes), so
//! `dot` may differ in its last bits; where every product and partial sum is
//! exact the outputs are identical (the test checks that, and the order of
//! the sum against an f64 one elsewhere).
use crate::element::Element;
use crate::simd::prefetch_write_ahead;
use crate::wide::x86::write_row::{load_bf16_pair, store_bf16_pair_arithmetic};
use crate::wide::x86::{run, Kernel, Lanes};
use crate::wide::{cast_mut, has_lanes, is};
use half::bf16;

/// The backward of whole rows of `cols` (`y`, `dy`, `dx` of one length);
/// false (without running) where there is no explicit code: `T` not f32,
/// bf16 or f16, or a CPU without AVX2 (with FMA and F16C).
///
/// bf16 on AVX2 rounds its whole groups of `2 N` in registers ([`pairs`]),
/// in the even/odd order: against the lane loop, `[4096, 4096]` on a 2-core
/// Zen 3, two threads, alternated in one process, medians of 60 per-round
/// ratios, 0.91 into memory faulted in before and 0.94 into fresh huge
/// pages (session 57). Through the blocks, as f32 and f16 go, it had
/// measured 0-6% slower than the lane loop there (criterion, 4096x4096).
/// With AVX-512 the kernel is faster (criterion on the Xeon of
/// `docs/report/xeon-avx512`, four rounds alternated, ms, lane loop ->
/// kernel: 4096x4096 3.13-3.85 -> 2.94-3.23, 2048x8192 3.04-3.82 ->
/// 2.84-3.49, 32x4096 0.027-0.030 -> 0.026).
#[inline(always)]
pub(super) fn backward_rows<T: Element>(y: &[T], dy: &[T], dx: &mut [T], cols: usize, scale: f32) -> bool {
    if !has_lanes::<T>() {
        return false;
    }
    run(Back { y, dy, dx, cols, scale }).is_some()
}

/// See [`backward_rows`].
struct Back<'a, T> {
    y: &'a [T],
    dy: &'a [T],
    dx: &'a mut [T],
    cols: usize,
    scale: f32,
}

impl<T: Element> Kernel for Back<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Back { y, dy, dx, cols, scale } = self;
        let s = l.splat(scale);
        // bf16 rounds in registers on AVX2 (`pairs`) where `scale` is
        // finite; the conversion instruction's widths keep the blocks.
        let pairs_bf16 = !L::ROUNDS_BF16 && scale.is_finite();
        for ((y, dy), dx) in y.chunks_exact(cols).zip(dy.chunks_exact(cols)).zip(dx.chunks_exact_mut(cols)) {
            let dot = l.splat(dot(l, y, dy));
            let done = match cast_mut::<T, bf16>(dx).filter(|_| pairs_bf16) {
                Some(dx) => pairs(l, (s, dot), y, dy, dx),
                None => 0,
            };
            let (y, dy) = (&y[done..], &dy[done..]);
            T::write_acc(
                &mut dx[done..],
                #[inline(always)]
                |at, out| {
                    let out = cast_mut::<T::Acc, f32>(out).expect("softmax x86: T::Acc is f32 for f32, bf16, f16");
                    let len = out.len();
                    let (y, dy, o) = (y[at..][..len].as_ptr(), dy[at..][..len].as_ptr(), out.as_mut_ptr());
                    let mut i = 0;
                    // SAFETY: whole vectors while they fit in `out` (`y` and
                    // `dy` hold `len` values from here), then the `len - i <
                    // N` left; `T` is f32, bf16 or f16.
                    unsafe {
                        // An f32 row on AVX-512 is `dx` itself, a vector a
                        // line, each asked for ahead: on the Xeon,
                        // 4096x4096, two threads, interleaved medians
                        // (session 62), 7.3-7.5 -> 6.7-6.8 ms into reused
                        // outputs, 11.9 -> 11.4 into fresh huge pages. (bf16
                        // through the blocks measured 0-3% slower with it.)
                        let ahead_w = L::writes_ahead() && is::<T, f32>();
                        while i + L::N <= len {
                            if ahead_w {
                                prefetch_write_ahead(o.add(i));
                            }
                            l.store(o.add(i), grad(l, (s, dot), l.load(y.add(i)), l.load(dy.add(i))));
                            i += L::N;
                        }
                        if i < len {
                            let n = len - i;
                            let v = grad(l, (s, dot), l.load_part(y.add(i), n), l.load_part(dy.add(i), n));
                            l.store_part(o.add(i), v, n);
                        }
                    }
                },
            );
        }
    }
}

/// A bf16 row's `dx = (s y) (dy - dot)`, its whole groups of `2 N`
/// values rounded in registers with no NaN check
/// ([`store_bf16_pair_arithmetic`], in [`load_bf16_pair`]'s order); returns
/// how many values it wrote. Every value is float arithmetic on values
/// widened from bf16, on `dot` (a sum of such products) and on a finite
/// `s`, so any NaN among them is quiet with its low 16 bits zero, which
/// that rounding keeps as `from_acc` does (`RowValues::ARITHMETIC` says
/// why): the lane loop's bits. The caller's blocks write the rest.
#[inline(always)]
fn pairs<L: Lanes, T: 'static>(l: L, (s, dot): (L::V, L::V), y: &[T], dy: &[T], dx: &mut [bf16]) -> usize {
    let (n, len) = (2 * L::N, dx.len());
    let whole = len / n * n;
    let (y, dy) = (&y[..whole], &dy[..whole]);
    let mut i = 0;
    while i < whole {
        // SAFETY: `i + 2 N <= whole`, within `y` and `dy` (the slices
        // above), which are bf16 as `dx` is.
        let ((y0, y1), (d0, d1)) =
            unsafe { (load_bf16_pair(l, y.as_ptr().add(i)), load_bf16_pair(l, dy.as_ptr().add(i))) };
        store_bf16_pair_arithmetic(l, &mut dx[i..i + n], grad(l, (s, dot), y0, d0), grad(l, (s, dot), y1, d1));
        i += n;
    }
    whole
}

/// `(s y) (dy - dot)`, the lane loop's order. A function, not a closure, so
/// that it is always inlined into the code compiled for the width.
#[inline(always)]
fn grad<L: Lanes>(l: L, (s, dot): (L::V, L::V), y: L::V, dy: L::V) -> L::V {
    l.mul(l.mul(s, y), l.sub(dy, dot))
}

/// `sum(y_i dy_i)` over one row: two accumulators of fused multiply-adds
/// (bf16's pairs of vectors loaded in [`Lanes::load_pair_unordered`]'s
/// order; the zero lanes of a part vector add nothing), then a tree.
#[inline(always)]
fn dot<L: Lanes, T: 'static>(l: L, y: &[T], dy: &[T]) -> f32 {
    let (len, py, pdy, n) = (y.len().min(dy.len()), y.as_ptr(), dy.as_ptr(), L::N);
    let mut acc = [l.splat(0.0); 2];
    let mut at = 0;
    // SAFETY: `at + 2n <= len`, then `at + n <= len`, then the `len - at <
    // n` values left, of both slices; `T` is f32, bf16 or f16.
    unsafe {
        while at + 2 * n <= len {
            let ((y0, y1), (d0, d1)) = (l.load_pair_unordered(py.add(at)), l.load_pair_unordered(pdy.add(at)));
            acc[0] = l.fmadd(y0, d0, acc[0]);
            acc[1] = l.fmadd(y1, d1, acc[1]);
            at += 2 * n;
        }
        if at + n <= len {
            acc[0] = l.fmadd(l.load(py.add(at)), l.load(pdy.add(at)), acc[0]);
            at += n;
        }
        if at < len {
            acc[1] = l.fmadd(l.load_part(py.add(at), len - at), l.load_part(pdy.add(at), len - at), acc[1]);
        }
    }
    l.reduce_add(l.add(acc[0], acc[1]))
}

#[cfg(test)]
mod tests {
    use super::super::backward_rows_lanes;
    use super::Back;
    use crate::element::Element;
    use crate::simd::dispatch;
    use crate::wide::x86::{every_width, run_with, Width};
    use half::{bf16, f16};

    /// The kernel against the lane loop, bit for bit, on rows whose every
    /// product and partial sum is exact in f32 (multiples of 1/8 up to 2 in
    /// magnitude), so the two sums agree whatever their order: row widths
    /// with and without a part vector and past one narrowing block, three
    /// rows, two scales.
    fn check<T: Element<Acc = f32>, L: Width>(l: L) {
        for cols in [1, 5, 8, 16, 17, 33, 100, 129, 300, 4099] {
            let n = 3 * cols;
            let y: Vec<T> = (0..n).map(|i| T::from_f64(((i * 7 % 33) as f64 - 16.0) / 8.0)).collect();
            let dy: Vec<T> = (0..n).map(|i| T::from_f64(((i * 5 % 31) as f64 - 15.0) / 8.0)).collect();
            for scale in [1.0f32, -0.375] {
                let (mut got, mut want) = (vec![T::from_f64(9.0); n], vec![T::from_f64(9.0); n]);
                run_with(l, Back { y: &y, dy: &dy, dx: &mut got, cols, scale });
                dispatch(|| backward_rows_lanes(&y, &dy, &mut want, cols, scale));
                let bits = |v: &[T]| v.iter().map(|v| v.to_acc().to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{} cols={cols} scale={scale}", T::NAME);
            }
        }
    }

    /// Sums that round: within f32 accumulation error of an f64 dot, NaN in
    /// a row reaching every output of that row only.
    fn inexact<L: Width>(l: L) {
        let cols = 1000;
        let y: Vec<f32> = (0..2 * cols).map(|i| ((i as f32) * 0.37).sin() * 1e-3 + 1e-3).collect();
        let mut dy: Vec<f32> = (0..2 * cols).map(|i| ((i as f32) * 0.11).cos()).collect();
        dy[cols + 17] = f32::NAN;
        let mut dx = vec![0f32; 2 * cols];
        run_with(l, Back { y: &y, dy: &dy, dx: &mut dx, cols, scale: 1.0 });
        let dot: f64 = y[..cols].iter().zip(&dy[..cols]).map(|(y, g)| *y as f64 * *g as f64).sum();
        for i in 0..cols {
            let want = y[i] as f64 * (dy[i] as f64 - dot);
            assert!(
                (dx[i] as f64 - want).abs() <= 1e-6 * y[i] as f64 * (1.0 + dot.abs()),
                "i={i}: {} vs {want}",
                dx[i]
            );
        }
        assert!(dx[cols..].iter().all(|v| v.is_nan()));
    }

    fn at_width<L: Width>(l: L) {
        check::<f32, L>(l);
        check::<bf16, L>(l);
        check::<f16, L>(l);
        inexact(l);
    }

    #[test]
    fn backward_matches_the_lane_loop_at_every_width() {
        every_width!(at_width);
    }

    /// f64 takes the lane loop; bf16 the kernel wherever there is one.
    #[test]
    fn f64_takes_the_lane_loop_and_bf16_the_kernel() {
        assert!(!super::backward_rows::<f64>(&[1.0], &[1.0], &mut [0.0], 1, 1.0));
        let mut dx = [bf16::ZERO];
        let ran = super::backward_rows::<bf16>(&[bf16::ONE], &[bf16::from_f32(0.5)], &mut dx, 1, 1.0);
        assert_eq!(ran, crate::wide::x86::V8::try_new().is_some());
        if ran {
            assert_eq!(dx[0].to_f32(), 0.0); // 1 * (0.5 - 0.5)
        }
    }

    /// bf16 rows holding NaN (quiet and signalling, with payloads, one with
    /// all its low bits set) and infinities in `y` and `dy`, and scales that
    /// are not finite (which keep AVX2 on the blocks): the lane loop's
    /// values, a NaN for a NaN, at every width. Whole groups, a part, and
    /// rows past a block.
    #[test]
    fn bf16_rows_with_nan_are_the_lane_loops_at_every_width() {
        fn check<L: Width>(l: L) {
            let specials = [0x7fc0u16, 0xffc0, 0x7f81, 0xff81, 0x7fff, 0x7f80, 0xff80, 0x7fc1];
            for cols in [16usize, 33, 100, 300] {
                let n = 3 * cols;
                let mut y: Vec<bf16> = (0..n).map(|i| bf16::from_f64(((i * 7 % 33) as f64 - 16.0) / 8.0)).collect();
                let dy: Vec<bf16> = (0..n).map(|i| bf16::from_f64(((i * 5 % 31) as f64 - 15.0) / 8.0)).collect();
                // Row 1 holds the specials in `y`, row 2 in `dy`.
                let mut dy2 = dy.clone();
                for (j, k) in (0..cols).step_by(5).enumerate() {
                    y[cols + k] = bf16::from_bits(specials[j % specials.len()]);
                    dy2[2 * cols + k] = bf16::from_bits(specials[(j + 3) % specials.len()]);
                }
                // A NaN scale with all low bits set: the integer rounding
                // would carry it into the sign (-0.0).
                for scale in [1.0f32, -0.375, f32::INFINITY, f32::NAN, f32::from_bits(0x7fff_ffff)] {
                    let (mut got, mut want) = (vec![bf16::from_f64(9.0); n], vec![bf16::from_f64(9.0); n]);
                    run_with(l, Back { y: &y, dy: &dy2, dx: &mut got, cols, scale });
                    dispatch(|| backward_rows_lanes(&y, &dy2, &mut want, cols, scale));
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "cols={cols} scale={scale} {i}: {g} {:#x}, want {w} {:#x}",
                            g.to_bits(),
                            w.to_bits()
                        );
                    }
                    assert!(got[cols..].iter().all(|v| v.is_nan()), "cols={cols} scale={scale}: row 1 not all NaN");
                }
            }
        }
        every_width!(check);
    }
}
