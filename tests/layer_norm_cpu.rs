//! Property tests: the CPU layer_norm kernels against the f64 reference, for
//! every dtype, odd widths, zero and one row, with and without weight and
//! bias, sequential and on rayon.
mod common;

use common::{assert_close, assert_close_floor, grad_floor, in_pool, sum_scale, to_elems, Tol};
use keel::cpu::{bf16, f16, Par};
use keel::ops::layer_norm::{backward_cpu, forward_cpu};
use keel_cpu::layer_norm::{backward_ref, forward_ref};
use proptest::prelude::*;

type Case = (usize, usize, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, bool, bool, f64);

fn case() -> impl Strategy<Value = Case> {
    (0usize..=9, 1usize..=300, any::<bool>(), any::<bool>(), prop_oneof![Just(1e-5), Just(1e-3), Just(0.1)])
        .prop_flat_map(|(rows, cols, w, b, eps)| {
            let v = |n| prop::collection::vec(-4.0f64..4.0, n);
            (Just(rows), Just(cols), v(rows * cols), v(cols), v(cols), v(rows * cols), Just(w), Just(b), Just(eps))
        })
}

fn check<T: Tol>(c: &Case) {
    let (rows, cols, x, w, b, dy, with_w, with_b, eps) = c;
    let (rows, cols, eps) = (*rows, *cols, *eps);
    let (x, w, b, dy) = (to_elems::<T>(x), to_elems::<T>(w), to_elems::<T>(b), to_elems::<T>(dy));
    let (w, b) = (with_w.then_some(&w[..]), with_b.then_some(&b[..]));
    let want = forward_ref(&x, w, b, cols, eps);
    let (want_dx, want_dw, want_db) = backward_ref(&dy, &x, w, b, cols, eps);
    // Normalised values reach sqrt(cols); variance and sums add `cols` terms.
    let scale = sum_scale::<T>(cols) * 2.0;
    for par in [Par::Seq, Par::Rayon] {
        let mut y = vec![T::default(); rows * cols];
        forward_cpu(&x, w, b, &mut y, cols, eps, par).unwrap();
        assert_close_floor(&y, &want, scale, 1.0, "forward");

        let mut dx = vec![T::default(); rows * cols];
        let (mut dw, mut db) = (vec![T::default(); cols], vec![T::default(); cols]);
        backward_cpu(&dy, &x, w, b, &mut dx, w.map(|_| &mut dw[..]), b.map(|_| &mut db[..]), cols, eps, par).unwrap();
        // dx subtracts terms of the size of rstd * |dy * w|: bound each row by those.
        for r in 0..rows {
            let row = r * cols..(r + 1) * cols;
            let floor = grad_floor(&x[row.clone()], &dy[row.clone()], w, eps, true);
            assert_close_floor(&dx[row.clone()], &want_dx[row], 4.0 * scale, floor, "grad_input");
        }
        let s = 4.0 * scale * (rows.max(1) as f64).sqrt();
        if let Some(want_dw) = &want_dw {
            assert_close_floor(&dw, want_dw, s, 4.0 * rows as f64, "grad_weight");
        }
        if let Some(want_db) = &want_db {
            assert_close_floor(&db, want_db, s, 4.0 * rows as f64, "grad_bias");
        }
    }
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn f32_matches_reference(c in case()) { check::<f32>(&c); }

    #[test]
    fn f64_matches_reference(c in case()) { check::<f64>(&c); }

    #[test]
    fn f16_matches_reference(c in case()) { check::<f16>(&c); }

    #[test]
    fn bf16_matches_reference(c in case()) { check::<bf16>(&c); }
}

#[test]
fn large_input_split_over_blocks_gives_the_same_rows() {
    let (rows, cols) = (600, 1031);
    let x: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 250.0 + 3.0).collect();
    let w: Vec<f32> = (0..cols).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
    let (mut a, mut b) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
    forward_cpu(&x, Some(&w), Some(&w), &mut a, cols, 1e-5, Par::Seq).unwrap();
    in_pool(|| forward_cpu(&x, Some(&w), Some(&w), &mut b, cols, 1e-5, Par::Rayon).unwrap());
    assert_eq!(a, b);
    assert_close(&a, &forward_ref(&x, Some(&w), Some(&w), cols, 1e-5), 4.0, "forward");
}

#[test]
fn bad_lengths_are_errors_naming_the_argument() {
    let x = vec![1f32; 12];
    let mut y = vec![0f32; 12];
    let err = |r: keel::Result<()>| r.unwrap_err().to_string();
    assert_eq!(
        err(forward_cpu(&x, None, Some(&[0.0; 3]), &mut y, 4, 1e-5, Par::Seq)),
        "layer_norm: argument 'bias' has length 3, expected 4"
    );
    assert!(err(forward_cpu(&x, None, None, &mut y, 4, f64::NAN, Par::Seq)).contains("argument 'eps'"));
    let mut dx = vec![0f32; 12];
    let mut db = vec![0f32; 4];
    assert!(err(backward_cpu(&x, &x, None, None, &mut dx, None, Some(&mut db), 4, 1e-5, Par::Seq))
        .contains("layer_norm_backward: argument 'grad_bias': given but its parameter is None"));
}

#[test]
fn constant_rows_give_the_bias() {
    // var = 0: y = b exactly (x - mean is exactly 0), as in torch.
    let x = vec![3.5f32; 8];
    let b: Vec<f32> = (0..4).map(|i| i as f32).collect();
    let mut y = vec![f32::NAN; 8];
    forward_cpu(&x, None, Some(&b), &mut y, 4, 1e-5, Par::Seq).unwrap();
    assert_eq!(y, [b.clone(), b].concat());
}

#[test]
fn rows_far_from_zero_or_with_outliers_keep_full_accuracy() {
    // Rows whose mean dwarfs their spread, and rows whose first elements are
    // outliers: the cases where one-pass moments would lose digits.
    let cols = 1031;
    let noise = |i: usize| ((i * 7919 % 2001) as f64 - 1000.0) / 1000.0;
    let mut rows: Vec<Vec<f32>> = vec![
        (0..cols).map(|i| (1000.0 + noise(i)) as f32).collect(),
        (0..cols).map(|i| (-3e4 + 0.01 * noise(i)) as f32).collect(),
    ];
    rows.push((0..cols).map(|i| if i < 16 { 1e4 } else { noise(i) as f32 }).collect());
    // The converse: a head centred on 0 (no shift) before a row near 1000,
    // whose unshifted sums must take the exact second pass.
    rows.push((0..cols).map(|i| if i < 16 { noise(i) as f32 } else { (1000.0 + noise(i)) as f32 }).collect());
    for x in rows {
        let mut y = vec![0f32; cols];
        forward_cpu(&x, None, None, &mut y, cols, 1e-5, Par::Seq).unwrap();
        assert_close(&y, &forward_ref(&x, None, None, cols, 1e-5), 4.0, "forward");
    }
    // A long row whose first 16 elements sit far from the rest: the shift
    // (their mean) is off by about sqrt(n / 16) standard deviations, and one
    // pass of shifted sums would leave about 12 bits of the variance; only
    // the exact second pass keeps it.
    let long = 1 << 16;
    let x: Vec<f32> = (0..long).map(|i| if i < 16 { 1e4 } else { noise(i) as f32 }).collect();
    let mut y = vec![0f32; long];
    forward_cpu(&x, None, None, &mut y, long, 1e-5, Par::Seq).unwrap();
    assert_close(&y, &forward_ref(&x, None, None, long, 1e-5), 4.0, "forward, long row");
    // The backward of the same rows in every dtype: bf16 and f16 take their
    // moments and gradient sums from one shifted pass, which must fall back to
    // the exact path where the shift is poor (the outlier row).
    backward_of_hard_rows::<f32>();
    backward_of_hard_rows::<f16>();
    backward_of_hard_rows::<bf16>();
}

fn backward_of_hard_rows<T: Tol>() {
    let cols = 1031;
    let noise = |i: usize, seed: usize| ((i * 7919 + seed) % 2001) as f64 / 1000.0 - 1.0;
    let rows: [Vec<f64>; 4] = [
        (0..cols).map(|i| 100.0 + 4.0 * noise(i, 0)).collect(),
        (0..cols).map(|i| if i < 16 { 1e4 } else { noise(i, 0) }).collect(),
        (0..cols).map(|i| noise(i, 0)).collect(),
        (0..cols).map(|i| if i < 16 { noise(i, 0) } else { 100.0 + 4.0 * noise(i, 0) }).collect(),
    ];
    let w: Vec<T> = to_elems(&(0..cols).map(|i| 1.0 + 0.5 * noise(i, 3)).collect::<Vec<_>>());
    for x in rows {
        let (x, dy) = (to_elems::<T>(&x), to_elems::<T>(&(0..cols).map(|i| noise(i, 7)).collect::<Vec<_>>()));
        let (want_dx, ..) = backward_ref(&dy, &x, Some(&w), None, cols, 1e-5);
        let mut dx = vec![T::default(); cols];
        backward_cpu(&dy, &x, Some(&w), None, &mut dx, None, None, cols, 1e-5, Par::Seq).unwrap();
        // As in `check`: dx subtracts terms of the size of rstd * |dy * w|.
        let xs: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let mean = xs.iter().sum::<f64>() / cols as f64;
        let var = xs.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
        let floor = 4.0 * 1.5 / (var + 1e-5).sqrt();
        assert_close_floor(&dx, &want_dx, 8.0 * sum_scale::<T>(cols), floor, "grad_input of a hard row");
    }
}

/// A row whose variance overflows f32 (values near 1e20: their squares pass
/// f32's 3.4e38) has no f32 normalisation. Its outputs and its `dx` and `dw`
/// are NaN, not the zeros of `1 / sqrt(inf)`;
/// the rows around it are untouched. Every path: the explicit x86 kernels
/// and the lane loop (widths), single rows and the grouped backward (rows),
/// f32 and bf16 (whose one-pass gradient sums have their own `rstd`).
#[test]
fn rows_whose_variance_overflows_are_nan() {
    rows_whose_variance_overflows_are_nan_in::<f32>();
    rows_whose_variance_overflows_are_nan_in::<bf16>();
}

fn rows_whose_variance_overflows_are_nan_in<T: Tol>() {
    for (rows, cols) in [(1, 4), (3, 37), (9, 300), (2, 4096)] {
        let bad = rows / 2;
        let noise = |i: usize| ((i * 7919 % 2001) as f64 - 1000.0) / 1000.0;
        let xs: Vec<f64> =
            (0..rows * cols).map(|i| if i / cols == bad { 1e20 * (1.5 + noise(i)) } else { noise(i) }).collect();
        let (x, dy) = (to_elems::<T>(&xs), to_elems::<T>(&(0..rows * cols).map(|i| noise(i + 5)).collect::<Vec<_>>()));
        let w: Vec<T> = to_elems(&(0..cols).map(|i| 1.0 + 0.5 * noise(i + 3)).collect::<Vec<_>>());
        let case = format!("{} {rows}x{cols}", std::any::type_name::<T>());
        let nan = |v: &[T]| v.iter().all(|v| v.to_f64().is_nan());
        for par in [Par::Seq, Par::Rayon] {
            let mut y = vec![T::default(); rows * cols];
            forward_cpu(&x, Some(&w), None, &mut y, cols, 1e-5, par).unwrap();
            let (mut dx, mut dw, mut db) =
                (vec![T::default(); rows * cols], vec![T::default(); cols], vec![T::default(); cols]);
            backward_cpu(&dy, &x, Some(&w), Some(&w), &mut dx, Some(&mut dw), Some(&mut db), cols, 1e-5, par).unwrap();
            for r in 0..rows {
                let row = r * cols..(r + 1) * cols;
                if r == bad {
                    assert!(nan(&y[row.clone()]), "{case}: forward of the overflowing row");
                    assert!(nan(&dx[row]), "{case}: grad_input of the overflowing row");
                } else {
                    let want = forward_ref(&x[row.clone()], Some(&w), None, cols, 1e-5);
                    assert_close_floor(&y[row], &want, 2.0 * sum_scale::<T>(cols), 1.0, &format!("{case}: forward"));
                }
            }
            assert!(nan(&dw), "{case}: grad_weight takes the NaN row's dy * xh");
            let want_db = (0..cols).map(|j| (0..rows).map(|r| dy[r * cols + j].to_f64()).sum()).collect::<Vec<f64>>();
            assert_close_floor(
                &db,
                &want_db,
                4.0 * sum_scale::<T>(rows),
                4.0 * rows as f64,
                &format!("{case}: grad_bias"),
            );
        }
    }
}
