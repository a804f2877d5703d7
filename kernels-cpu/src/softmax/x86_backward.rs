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
use crate::wide::x86::{run, run_with, Kernel, Lanes, V16};
use crate::wide::{cast_mut, has_lanes, is};
use half::bf16;

/// The backward of whole rows of `cols` (`y`, `dy`, `dx` of one length);
/// false (without running) where there is no explicit code: `T` not f32,
/// bf16 or f16, a CPU without AVX2 (with FMA and F16C), or bf16 on a CPU
/// without AVX-512.
///
/// bf16 keeps the lane loop on AVX2: it is at memory speed there already,
/// and this kernel measured 0-6% slower for it (criterion, 4096x4096, three
/// rounds, AMD AVX2 CPU). With AVX-512 the kernel is faster (criterion on
/// the Xeon of `docs/report/xeon-avx512`, four rounds alternated, ms,
/// lane loop -> kernel: 4096x4096 3.13-3.85 -> 2.94-3.23, 2048x8192
/// 3.04-3.82 -> 2.84-3.49, 32x4096 0.027-0.030 -> 0.026).
#[inline(always)]
pub(super) fn backward_rows<T: Element>(y: &[T], dy: &[T], dx: &mut [T], cols: usize, scale: f32) -> bool {
    if !has_lanes::<T>() {
        return false;
    }
    let k = Back { y, dy, dx, cols, scale };
    if is::<T, bf16>() {
        return V16::try_new().map(|l| run_with(l, k)).is_some();
    }
    run(k).is_some()
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
        for ((y, dy), dx) in y.chunks_exact(cols).zip(dy.chunks_exact(cols)).zip(dx.chunks_exact_mut(cols)) {
            let dot = l.splat(dot(l, y, dy));
            T::write_acc(
                dx,
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
                        while i + L::N <= len {
                            l.store(o.add(i), l.mul(l.mul(s, l.load(y.add(i))), l.sub(l.load(dy.add(i)), dot)));
                            i += L::N;
                        }
                        if i < len {
                            let n = len - i;
                            let v = l.mul(l.mul(s, l.load_part(y.add(i), n)), l.sub(l.load_part(dy.add(i), n), dot));
                            l.store_part(o.add(i), v, n);
                        }
                    }
                },
            );
        }
    }
}

/// `sum(y_i dy_i)` over one row: two accumulators of fused multiply-adds
/// (the zero lanes of a part vector add nothing), then a tree.
#[inline(always)]
fn dot<L: Lanes, T: 'static>(l: L, y: &[T], dy: &[T]) -> f32 {
    let (len, py, pdy, n) = (y.len().min(dy.len()), y.as_ptr(), dy.as_ptr(), L::N);
    let mut acc = [l.splat(0.0); 2];
    let mut at = 0;
    // SAFETY: `at + 2n <= len`, then `at + n <= len`, then the `len - at <
    // n` values left, of both slices; `T` is f32, bf16 or f16.
    unsafe {
        while at + 2 * n <= len {
            acc[0] = l.fmadd(l.load(py.add(at)), l.load(pdy.add(at)), acc[0]);
            acc[1] = l.fmadd(l.load(py.add(at + n)), l.load(pdy.add(at + n)), acc[1]);
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

    /// f64 takes the lane loop, and so does bf16 without AVX-512.
    #[test]
    fn f64_and_bf16_without_avx512_have_no_explicit_code() {
        assert!(!super::backward_rows::<f64>(&[1.0], &[1.0], &mut [0.0], 1, 1.0));
        let mut dx = [bf16::ZERO];
        let ran = super::backward_rows::<bf16>(&[bf16::ONE], &[bf16::from_f32(0.5)], &mut dx, 1, 1.0);
        assert_eq!(ran, crate::wide::x86::V16::try_new().is_some());
        if ran {
            assert_eq!(dx[0].to_f32(), 0.0); // 1 * (0.5 - 0.5)
        }
    }
}
