//! Property tests: the CPU rms_norm kernels against the f64 reference, for
//! every dtype, widths that are not multiples of the SIMD width, one row, zero
//! rows, and every kind of parallelism; the strided forward and backward (x's
//! rows placed by a `RowLayout`) against the contiguous ones on a gathered copy.
mod common;

use common::{
    assert_close, assert_close_floor, assert_close_rounded_within, grad_floor, in_pool, in_pool_if, sum_scale,
    to_elems, Tol,
};
use keel::cpu::Element;
use keel::cpu::{bf16, f16, Par, RowLayout};
use keel::ops::rms_norm::{backward_cpu, backward_strided_cpu, forward_cpu, forward_strided_cpu, Rounding};
use keel_cpu::rms_norm::{backward_ref, forward_ref, forward_ref_rounded};
use proptest::prelude::*;

fn case() -> impl Strategy<Value = (usize, usize, Vec<f64>, Vec<f64>, Vec<f64>, bool, f64)> {
    // cols: 1..=300 covers every remainder mod 8/16/32; rows: 0..=9.
    (0usize..=9, 1usize..=300, any::<bool>(), prop_oneof![Just(1e-6), Just(1e-5), Just(0.1)]).prop_flat_map(
        |(rows, cols, w, eps)| {
            let v = |n| prop::collection::vec(-4.0f64..4.0, n);
            (Just(rows), Just(cols), v(rows * cols), v(cols), v(rows * cols), Just(w), Just(eps))
        },
    )
}

fn pars() -> [Par<'static>; 2] {
    [Par::Seq, Par::Rayon]
}

fn check<T: Tol>(rows: usize, cols: usize, x: &[f64], w: &[f64], dy: &[f64], with_w: bool, eps: f64) {
    let (x, w, dy) = (to_elems::<T>(x), to_elems::<T>(w), to_elems::<T>(dy));
    let w = with_w.then_some(&w[..]);
    let want = forward_ref(&x, w, cols, eps);
    let (want_dx, want_dw) = backward_ref(&dy, &x, w, cols, eps);
    for par in pars() {
        let mut y = vec![T::default(); rows * cols];
        forward_cpu(&x, w, &mut y, cols, eps, par).unwrap();
        // f32 accumulation over `cols` terms: allow sqrt(cols) roundings of f32.
        let scale = sum_scale::<T>(cols);
        assert_close(&y, &want, scale, "forward");
        // Rounded before the weight, against the reference that rounds there
        // (a tie of `x r` may round the other way in f32).
        let layout = RowLayout::contiguous(rows, cols);
        let rounded = Rounding::BeforeWeight;
        forward_strided_cpu(&x, layout, w, &mut y, cols, eps, rounded, par).unwrap();
        let want = forward_ref_rounded(&x, w, cols, eps, rounded);
        assert_close_rounded_within(&y, &want, scale, "forward rounded before the weight");

        let mut dx = vec![T::default(); rows * cols];
        let mut dw = vec![T::default(); cols];
        backward_cpu(&dy, &x, w, &mut dx, w.map(|_| &mut dw[..]), cols, eps, par).unwrap();
        // The gradient subtracts terms of about `rstd max|dy w|`: bound each
        // row by those, not by the result.
        for r in 0..rows {
            let row = r * cols..(r + 1) * cols;
            let floor = grad_floor(&x[row.clone()], &dy[row.clone()], w, eps, false);
            assert_close_floor(&dx[row.clone()], &want_dx[row], 4.0 * scale, floor, "grad_input");
        }
        if let Some(want_dw) = &want_dw {
            let s = 4.0 * scale * (rows.max(1) as f64).sqrt();
            let mag: Vec<f64> = want_dw.iter().map(|v| v.abs() + rows as f64).collect();
            for (j, ((g, want), m)) in dw.iter().zip(want_dw).zip(&mag).enumerate() {
                let bound = s * (T::TOL.atol + T::TOL.rtol * m);
                assert!(
                    (g.to_f64() - want).abs() <= bound,
                    "grad_weight [{}] at {j}: {} vs {want}",
                    T::NAME,
                    g.to_f64()
                );
            }
        }
    }
}

/// Leading dims [a, b] of a strided x: b heads of `cols` padded by `pad` with
/// `spare` more per token (q of a fused qkv), or stored transposed ([b, a]),
/// or with a broadcast (stride 0) outer dim; the layout and its storage.
fn strided_case() -> impl Strategy<Value = (RowLayout, usize, Vec<f64>, Vec<f64>)> {
    (1usize..=6, 1usize..=4, 1usize..=150, 0usize..=3, 0usize..=2, 0usize..3).prop_flat_map(
        |(a, b, cols, pad, spare, kind)| {
            let h = cols + pad;
            let strides = match kind {
                0 => [(b + spare) * h, h],
                1 => [h, a * h],
                _ => [0, h],
            };
            let layout = RowLayout::new(&[a, b], &strides).unwrap();
            let v = |n| prop::collection::vec(-4.0f64..4.0, n);
            (Just(layout), Just(cols), v(layout.span(cols).unwrap()), v(cols))
        },
    )
}

fn check_strided<T: Tol + PartialEq + std::fmt::Debug>(layout: RowLayout, cols: usize, storage: &[f64], w: &[f64]) {
    let (storage, w) = (to_elems::<T>(storage), to_elems::<T>(w));
    let x: Vec<T> = (0..layout.rows()).flat_map(|r| storage[layout.offset(r)..][..cols].to_vec()).collect();
    let dy: Vec<T> = (0..x.len()).map(|i| T::from_f64(((i * 31 % 17) as f64 - 8.0) / 5.0)).collect();
    for weight in [Some(&w[..]), None] {
        let mut want = vec![T::default(); x.len()];
        forward_cpu(&x, weight, &mut want, cols, 1e-6, Par::Seq).unwrap();
        let (mut want_dx, mut want_dw) = (vec![T::default(); x.len()], vec![T::default(); cols]);
        let wdw = weight.map(|_| &mut want_dw[..]);
        backward_cpu(&dy, &x, weight, &mut want_dx, wdw, cols, 1e-6, Par::Seq).unwrap();
        for (name, par) in [("seq", Par::Seq), ("rayon", Par::Rayon)] {
            // rayon from inside its pool, where inputs this size are split.
            let pool = name == "rayon";
            let mut y = vec![T::default(); x.len()];
            let once = Rounding::Once;
            in_pool_if(pool, || forward_strided_cpu(&storage, layout, weight, &mut y, cols, 1e-6, once, par).unwrap());
            // The same arithmetic per row as on the contiguous copy.
            assert_eq!(y, want, "{layout:?} cols {cols} {name}");
            let (mut dx, mut dw) = (vec![T::default(); x.len()], vec![T::default(); cols]);
            in_pool_if(pool, || {
                let gdw = weight.map(|_| &mut dw[..]);
                backward_strided_cpu(&dy, &storage, layout, weight, &mut dx, gdw, cols, 1e-6, par).unwrap()
            });
            assert_eq!(dx, want_dx, "grad_input {layout:?} cols {cols} {name}");
            if weight.is_some() && name == "seq" {
                // The weight gradient sums per block: equal for the same blocks.
                assert_eq!(dw, want_dw, "grad_weight {layout:?} cols {cols}");
            }
        }
    }
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn f32_strided_forward_matches_contiguous((l, cols, x, w) in strided_case()) { check_strided::<f32>(l, cols, &x, &w); }

    #[test]
    fn bf16_strided_forward_matches_contiguous((l, cols, x, w) in strided_case()) { check_strided::<bf16>(l, cols, &x, &w); }

    #[test]
    fn f16_strided_forward_matches_contiguous((l, cols, x, w) in strided_case()) { check_strided::<f16>(l, cols, &x, &w); }
}

/// Strided rows over several parallel blocks (rayon) give the sequential result.
#[test]
fn strided_forward_over_many_blocks() {
    let (tokens, heads, cols) = (300, 4, 128);
    let layout = RowLayout::new(&[tokens, heads], &[3 * heads * cols, cols]).unwrap();
    let storage: Vec<f64> =
        (0..layout.span(cols).unwrap()).map(|i| ((i * 7919 % 2001) as f64 - 1000.0) / 400.0).collect();
    let w: Vec<f64> = (0..cols).map(|i| 1.0 + i as f64 / 100.0).collect();
    check_strided::<f32>(layout, cols, &storage, &w);
    check_strided::<bf16>(layout, cols, &storage, &w);
    check_strided::<f16>(layout, cols, &storage, &w);
}

#[test]
fn strided_forward_refuses_a_short_input() {
    let layout = RowLayout::new(&[2, 3], &[40, 10]).unwrap();
    let mut y = vec![0f32; 6 * 8];
    let once = Rounding::Once;
    let err = forward_strided_cpu(&[0f32; 67], layout, None, &mut y, 8, 1e-6, once, Par::Seq).unwrap_err().to_string();
    assert!(err.contains("argument 'input': holds 67 elements, but its layout"), "{err}");
    assert!(err.contains("reaches 68"), "{err}");
    assert!(forward_strided_cpu(&[0f32; 68], layout, None, &mut y, 8, 1e-6, once, Par::Seq).is_ok());
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn f32_matches_reference((rows, cols, x, w, dy, with_w, eps) in case()) {
        check::<f32>(rows, cols, &x, &w, &dy, with_w, eps);
    }

    #[test]
    fn f64_matches_reference((rows, cols, x, w, dy, with_w, eps) in case()) {
        check::<f64>(rows, cols, &x, &w, &dy, with_w, eps);
    }

    #[test]
    fn f16_matches_reference((rows, cols, x, w, dy, with_w, eps) in case()) {
        check::<f16>(rows, cols, &x, &w, &dy, with_w, eps);
    }

    #[test]
    fn bf16_matches_reference((rows, cols, x, w, dy, with_w, eps) in case()) {
        check::<bf16>(rows, cols, &x, &w, &dy, with_w, eps);
    }
}

#[test]
fn large_rows_are_split_across_threads_with_the_same_result() {
    // Large enough to be split over several blocks.
    let (rows, cols) = (600, 1031);
    let x: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 250.0).collect();
    let w: Vec<f32> = (0..cols).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
    let mut a = vec![0f32; rows * cols];
    let mut b = vec![0f32; rows * cols];
    forward_cpu(&x, Some(&w), &mut a, cols, 1e-6, Par::Seq).unwrap();
    in_pool(|| forward_cpu(&x, Some(&w), &mut b, cols, 1e-6, Par::Rayon).unwrap());
    assert_eq!(a, b, "row results must not depend on how rows are split");
    assert_close(&a, &forward_ref(&x, Some(&w), cols, 1e-6), 2.0, "forward");
}

#[test]
fn bad_lengths_and_eps_are_errors_naming_the_argument() {
    let x = vec![1f32; 12];
    let mut y = vec![0f32; 12];
    let err = |r: keel::Result<()>| r.unwrap_err().to_string();
    assert_eq!(
        err(forward_cpu(&x, Some(&[1.0; 5]), &mut y, 4, 1e-6, Par::Seq)),
        "rms_norm: argument 'weight' has length 5, expected 4"
    );
    assert_eq!(
        err(forward_cpu(&x, None, &mut y[..8], 4, 1e-6, Par::Seq)),
        "rms_norm: argument 'out' has length 8, expected 12"
    );
    assert!(err(forward_cpu(&x, None, &mut y, 5, 1e-6, Par::Seq)).contains("not a multiple of cols 5"));
    assert!(err(forward_cpu(&x, None, &mut y, 4, -1.0, Par::Seq)).contains("argument 'eps'"));
    assert!(err(forward_cpu(&x, None, &mut y, 0, 1e-6, Par::Seq)).contains("argument 'cols'"));
    let mut dx = vec![0f32; 12];
    let mut dw = vec![0f32; 4];
    assert!(err(backward_cpu(&x, &x, None, &mut dx, Some(&mut dw), 4, 1e-6, Par::Seq))
        .contains("argument 'grad_weight': given but weight is None"));
}

#[test]
fn zero_rows_give_zero_weight_gradient() {
    let mut dw = vec![f32::NAN; 3];
    backward_cpu::<f32>(&[], &[], Some(&[1.0; 3]), &mut [], Some(&mut dw), 3, 1e-6, Par::Rayon).unwrap();
    assert_eq!(dw, vec![0.0; 3]);
}

/// `Rounding::BeforeWeight` bit for bit: `T(y0 w)` in f32, `y0` the forward
/// without a weight (`T(x r)`, the same `r`), on every kernel path (row
/// widths with and without part vectors, contiguous and strided rows, each
/// parallelism). It must also differ from the rounding once for 16-bit
/// types, or the check could not tell the two apart.
fn check_before_weight<T: Element<Acc = f32> + PartialEq + std::fmt::Debug>() {
    for cols in [1usize, 7, 64, 100, 128, 1000, 2100] {
        let (a, b, pad) = (9usize, 3usize, 5usize);
        let h = cols + pad;
        for layout in [RowLayout::contiguous(a * b, cols), RowLayout::new(&[a, b], &[(b + 1) * h, h]).unwrap()] {
            let storage: Vec<T> = (0..layout.span(cols).unwrap())
                .map(|i| T::from_f64(((i * 7919 % 2001) as f64 - 1000.0) / 300.0))
                .collect();
            let w: Vec<T> = (0..cols).map(|j| T::from_f64(0.3 + (j % 11) as f64 * 0.37)).collect();
            let n = layout.rows() * cols;
            for par in [Par::Seq, Par::Rayon] {
                let (mut y0, mut y, mut once) = (vec![T::default(); n], vec![T::default(); n], vec![T::default(); n]);
                let rounded = Rounding::BeforeWeight;
                in_pool_if(matches!(par, Par::Rayon), || {
                    forward_strided_cpu(&storage, layout, None, &mut y0, cols, 1e-6, rounded, par).unwrap();
                    forward_strided_cpu(&storage, layout, Some(&w), &mut y, cols, 1e-6, rounded, par).unwrap();
                    forward_strided_cpu(&storage, layout, Some(&w), &mut once, cols, 1e-6, Rounding::Once, par)
                        .unwrap();
                });
                let want: Vec<T> =
                    y0.iter().enumerate().map(|(i, v)| T::from_acc(v.to_acc() * w[i % cols].to_acc())).collect();
                assert_eq!(y, want, "{} cols {cols} {layout:?}", T::NAME);
                if std::mem::size_of::<T>() == 2 && n > 100 {
                    assert_ne!(y, once, "{} cols {cols}: the two roundings agree everywhere", T::NAME);
                } else if std::mem::size_of::<T>() == 4 {
                    assert_eq!(y, once, "f32 cols {cols}: rounding to f32 first changes nothing");
                }
            }
        }
    }
}

#[test]
fn before_weight_rounds_the_normalised_value_f32() {
    check_before_weight::<f32>();
}

#[test]
fn before_weight_rounds_the_normalised_value_bf16() {
    check_before_weight::<bf16>();
}

#[test]
fn before_weight_rounds_the_normalised_value_f16() {
    check_before_weight::<f16>();
}
