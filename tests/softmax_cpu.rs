//! Property tests: the CPU softmax (forward and backward) against the f64
//! reference, every dtype, odd widths, scales, zero and one row, sequential
//! and on rayon; plus the -inf / NaN rows and bad arguments.
mod common;

use common::{assert_close, sum_scale, to_elems, Tol};
use keel::cpu::{bf16, f16, Par};
use keel::ops::softmax::{backward_cpu, forward_cpu};
use keel_cpu::softmax::{backward_ref, forward_ref};
use proptest::prelude::*;

fn case() -> impl Strategy<Value = (usize, usize, f64, Vec<f64>, Vec<f64>)> {
    (0usize..=6, 1usize..=300, prop_oneof![Just(1.0), -2.0f64..2.0]).prop_flat_map(|(rows, cols, scale)| {
        let v = |n| prop::collection::vec(prop_oneof![-4.0f64..4.0, -60.0f64..60.0], n);
        (Just(rows), Just(cols), Just(scale), v(rows * cols), v(rows * cols))
    })
}

fn check<T: Tol>(rows: usize, cols: usize, scale: f64, x: &[f64], dy: &[f64]) {
    let (x, dy) = (to_elems::<T>(x), to_elems::<T>(dy));
    let want = forward_ref(&x, cols, scale);
    for par in [Par::Seq, Par::Rayon] {
        let mut y = vec![T::default(); rows * cols];
        forward_cpu(&x, &mut y, cols, scale, par).unwrap();
        // exp within 2 ulp of f32 per element, then a sum of cols terms.
        assert_close(&y, &want, 2.0 * sum_scale::<T>(cols), "softmax");
        // The backward from the kernel's own (rounded) output.
        let want_dx = backward_ref(&dy, &y, cols, scale);
        let mut dx = vec![T::default(); rows * cols];
        backward_cpu(&dy, &y, &mut dx, cols, scale, par).unwrap();
        let floor: Vec<f64> =
            y.iter().zip(&dy).map(|(y, g)| scale.abs() * y.to_f64() * (1.0 + g.to_f64().abs())).collect();
        for (i, (g, w)) in dx.iter().zip(&want_dx).enumerate() {
            let t = T::TOL;
            let bound = 2.0 * sum_scale::<T>(cols) * (t.atol + t.rtol * (w.abs() + floor[i]));
            assert!((g.to_f64() - w).abs() <= bound, "softmax grad [{}] at {i}: {} vs {w}", T::NAME, g.to_f64());
        }
    }
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn f32_matches_reference((rows, cols, scale, x, dy) in case()) { check::<f32>(rows, cols, scale, &x, &dy); }

    #[test]
    fn f64_matches_reference((rows, cols, scale, x, dy) in case()) { check::<f64>(rows, cols, scale, &x, &dy); }

    #[test]
    fn f16_matches_reference((rows, cols, scale, x, dy) in case()) { check::<f16>(rows, cols, scale, &x, &dy); }

    #[test]
    fn bf16_matches_reference((rows, cols, scale, x, dy) in case()) { check::<bf16>(rows, cols, scale, &x, &dy); }
}

#[test]
fn rows_sum_to_one_and_large_inputs_do_not_overflow() {
    let x: Vec<f32> = (0..1000).map(|i| 1000.0 + i as f32 * 0.5).collect();
    let mut y = vec![0f32; 1000];
    forward_cpu(&x, &mut y, 500, 1.0, Par::Seq).unwrap();
    for row in y.chunks(500) {
        let s: f64 = row.iter().map(|&v| v as f64).sum();
        assert!((s - 1.0).abs() < 1e-5, "row sum {s}");
        assert!(row.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn all_neg_inf_row_is_nan_and_nan_spreads_over_its_row_only() {
    let inf = f32::INFINITY;
    let x = [-inf, -inf, -inf, 1.0, f32::NAN, 2.0, 0.0, 0.0, -inf];
    let mut y = [0f32; 9];
    forward_cpu(&x, &mut y, 3, 1.0, Par::Seq).unwrap();
    assert!(y[..6].iter().all(|v| v.is_nan()), "{y:?}");
    assert_eq!(&y[6..], &[0.5, 0.5, 0.0]);
}

#[test]
fn bad_arguments_are_errors() {
    let err = |r: keel::Result<()>| r.unwrap_err().to_string();
    let mut y = [0f32; 4];
    assert_eq!(
        err(forward_cpu(&[0f32; 4], &mut y, 4, f64::NAN, Par::Seq)),
        "softmax: argument 'scale': must be finite, got NaN"
    );
    assert!(err(forward_cpu(&[0f32; 4], &mut y, 3, 1.0, Par::Seq)).contains("not a multiple of cols 3"));
    assert_eq!(
        err(backward_cpu(&[0f32; 3], &[0f32; 4], &mut y, 4, 1.0, Par::Seq)),
        "softmax_backward: argument 'grad_out' has length 3, expected 4"
    );
}
