//! Property tests: the CPU fused cross-entropy (loss, each row's log-sum-exp,
//! and the gradient, recomputing the lse and given it) against the f64
//! reference for every reduction, with ignored rows, label smoothing and class
//! weights, every dtype, sequential and on rayon; plus torch's edge cases and
//! bad targets.
mod common;

use common::{assert_close_floor, assert_relative, sum_scale, to_elems, Tol, OFFSETS};
use keel::cpu::{bf16, f16, Acc, Element, Par};
use keel::ops::cross_entropy::{backward_cpu, forward_cpu, Options, Reduction};
use keel_cpu::cross_entropy::{backward_ref, forward_ref};
use proptest::prelude::*;

const IGNORE: i64 = -100;

/// Rows, columns, logits, targets, label smoothing, the loss gradient, and
/// class weights (none, or 0 or in [0.25, 4)).
#[allow(clippy::type_complexity)]
fn case() -> impl Strategy<Value = (usize, usize, Vec<f64>, Vec<i64>, f64, f64, Option<Vec<f64>>)> {
    (0usize..=7, 1usize..=300, prop_oneof![Just(0.0), 0.0f64..=1.0]).prop_flat_map(|(rows, cols, ls)| {
        let x = prop::collection::vec(prop_oneof![-5.0f64..5.0, -40.0f64..40.0], rows * cols);
        let t = prop::collection::vec(prop_oneof![3 => 0..cols as i64, 1 => Just(IGNORE)], rows);
        let w = prop::option::of(prop::collection::vec(prop_oneof![1 => Just(0.0), 4 => 0.25f64..4.0], cols));
        (Just(rows), Just(cols), x, t, Just(ls), -2.0f64..2.0, w)
    })
}

#[allow(clippy::too_many_arguments)]
fn check<T: Tol>(rows: usize, cols: usize, x: &[f64], target: &[i64], ls: f64, g: f64, w: Option<Vec<f64>>) {
    let x = to_elems::<T>(x);
    let w = w.map(|w| to_elems::<T>(&w));
    let w = w.as_deref();
    // Terms of size |x| (times the largest weight) enter each loss: compare
    // relative to the row's scale. "mean" with weights divides by their sum
    // over the targets, 0 (see below) or at least 0.25.
    let wmax = w.map_or(1.0, |w| w.iter().fold(1.0f64, |m, v| m.max(v.to_f64())));
    let floor = x.iter().fold(1.0f64, |m, v| m.max(v.to_f64().abs())) * wmax;
    let over: f64 = target.iter().filter(|&&t| t != IGNORE).map(|&t| w.map_or(1.0, |w| w[t as usize].to_f64())).sum();
    let mean_gain = if w.is_some() { 4.0 } else { 1.0 };
    for reduction in [Reduction::None, Reduction::Mean, Reduction::Sum] {
        let opts = Options { ignore_index: IGNORE, label_smoothing: ls, reduction };
        let n = reduction.out_len(rows);
        let grad = to_elems::<T>(&(0..n).map(|i| g + i as f64 * 0.25).collect::<Vec<_>>());
        let want = forward_ref(&x, target, w, cols, opts);
        let want_dx = backward_ref(&grad, &x, target, w, cols, opts);
        let gain = if reduction == Reduction::Mean { mean_gain } else { 1.0 };
        for par in [Par::Seq, Par::Rayon] {
            let (mut out, mut lse) = (vec![T::default(); n], vec![T::Acc::ONE; rows]);
            forward_cpu(&x, target, w, &mut out, Some(&mut lse), cols, opts, par).unwrap();
            for (i, (l, xr)) in lse.iter().zip(x.chunks(cols)).enumerate() {
                let want = if target[i] == IGNORE { 0.0 } else { lse_ref(xr) };
                // Rounded once to `T::Acc` from an f64 sum of Acc terms.
                let bound = if T::NAME == "f64" { 1e-12 } else { 1e-6 } * (1.0 + want.abs());
                assert!((l.to_f64() - want).abs() <= bound, "lse [{}] row {i}: {} vs {want}", T::NAME, l.to_f64());
            }
            if reduction == Reduction::Mean && over == 0.0 {
                // No rows, or only rows whose target weighs 0: 0/0 or x/0, as torch.
                assert!(!out[0].to_f64().is_finite(), "mean over no weight is not finite: {}", out[0].to_f64());
                continue;
            }
            let scale = 2.0 * sum_scale::<T>(cols * rows.max(1));
            assert_close_floor(
                &out,
                &want,
                scale,
                floor * gain * if reduction == Reduction::None { 1.0 } else { rows as f64 },
                &format!("{reduction:?} loss"),
            );
            for (how, lse) in [("", None), (" given the lse", Some(lse.as_slice()))] {
                let mut dx = vec![T::default(); rows * cols];
                backward_cpu(&grad, &x, target, w, lse, &mut dx, cols, opts, par).unwrap();
                assert_close_floor(
                    &dx,
                    &want_dx,
                    2.0 * sum_scale::<T>(cols),
                    (g.abs() + 1.0) * wmax * gain,
                    &format!("{reduction:?} grad{how}"),
                );
            }
        }
    }
}

/// A row's log-sum-exp in f64.
fn lse_ref<T: Element>(x: &[T]) -> f64 {
    let m = x.iter().map(|v| v.to_f64()).fold(f64::NEG_INFINITY, f64::max);
    m + x.iter().map(|v| (v.to_f64() - m).exp()).sum::<f64>().ln()
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn f32_matches_reference((rows, cols, x, t, ls, g, w) in case()) { check::<f32>(rows, cols, &x, &t, ls, g, w); }

    #[test]
    fn f64_matches_reference((rows, cols, x, t, ls, g, w) in case()) { check::<f64>(rows, cols, &x, &t, ls, g, w); }

    #[test]
    fn f16_matches_reference((rows, cols, x, t, ls, g, w) in case()) { check::<f16>(rows, cols, &x, &t, ls, g, w); }

    #[test]
    fn bf16_matches_reference((rows, cols, x, t, ls, g, w) in case()) { check::<bf16>(rows, cols, &x, &t, ls, g, w); }
}

#[test]
fn known_value_and_ignored_rows() {
    // Uniform logits over 4 classes: loss ln 4 per row; the ignored row adds nothing.
    let x = [0f32; 12];
    let t = [1, IGNORE, 3];
    let mut out = [0f32];
    let opts = Options { ignore_index: IGNORE, label_smoothing: 0.0, reduction: Reduction::Mean };
    let mut lse = [f32::NAN; 3];
    forward_cpu(&x, &t, None, &mut out, Some(&mut lse), 4, opts, Par::Seq).unwrap();
    assert!((out[0] as f64 - 4f64.ln()).abs() < 1e-6, "{}", out[0]);
    assert_eq!(lse, [4f32.ln(), 0.0, 4f32.ln()], "the lse of each row, 0 where ignored");
    let mut dx = [1f32; 12];
    backward_cpu(&[1.0f32], &x, &t, None, None, &mut dx, 4, opts, Par::Seq).unwrap();
    assert_eq!(&dx[4..8], &[0.0; 4], "ignored row has no gradient");
    assert!((dx[1] + 0.375).abs() < 1e-7 && (dx[0] - 0.125).abs() < 1e-7, "{dx:?}");
}

#[test]
fn bad_targets_and_options_are_errors() {
    let err = |r: keel::Result<()>| r.unwrap_err().to_string();
    let opts = Options { ignore_index: IGNORE, label_smoothing: 0.0, reduction: Reduction::Sum };
    let mut out = [0f32];
    assert_eq!(
        err(forward_cpu(&[0f32; 8], &[0, 4], None, &mut out, None, 4, opts, Par::Seq)),
        "cross_entropy: argument 'target': holds 4 at row 1, out of range for 4 classes (and not ignore_index = -100)"
    );
    assert!(
        err(forward_cpu(&[0f32; 8], &[-1, 0], None, &mut out, None, 4, opts, Par::Seq)).contains("holds -1 at row 0")
    );
    let bad_ls = Options { label_smoothing: 1.5, ..opts };
    assert!(err(forward_cpu(&[0f32; 8], &[0, 0], None, &mut out, None, 4, bad_ls, Par::Seq))
        .contains("'label_smoothing': must be in [0, 1]"));
    assert!(err(forward_cpu(&[0f32; 8], &[0], None, &mut out, None, 4, opts, Par::Seq))
        .contains("'target' has length 1, expected 2"));
    assert!(err(forward_cpu(&[0f32; 8], &[0, 0], None, &mut out, Some(&mut [0f32; 3]), 4, opts, Par::Seq))
        .contains("'lse' has length 3, expected 2"));
    let mut dx = [0f32; 8];
    assert!(err(backward_cpu(&[1.0f32], &[0f32; 8], &[0, 9], None, None, &mut dx, 4, opts, Par::Seq))
        .contains("cross_entropy_backward: argument 'target'"));
    assert!(err(backward_cpu(&[1.0f32], &[0f32; 8], &[0, 0], None, Some(&[0f32]), &mut dx, 4, opts, Par::Seq))
        .contains("cross_entropy_backward: argument 'lse' has length 1, expected 2"));
    assert_eq!(
        keel_cpu::cross_entropy::Reduction::parse("cross_entropy", "avg").unwrap_err().to_string(),
        "cross_entropy: argument 'reduction': must be \"mean\", \"sum\" or \"none\", got \"avg\""
    );
}

/// The forward's lse is rounded, and `exp(x - lse)` would carry that as a
/// relative error of every probability (`2^-24 |lse|` in f32). f32 and f64
/// rows whose `|lse|` is 64 or more recompute their max and sum instead:
/// their gradient given the lse is the one without it, bit for bit. bf16 and
/// f16 divide by the sum of `exp(x - lse)`, where the rounding cancels. Every
/// row is within the dtype's rounding of the f64 reference, and with two
/// logits tied at 1e20 (the lse rounds to the max, losing `ln 2`), each has
/// probability 0.5, not 1. The same with class weights (whose smoothed
/// backward divides by the sum of `exp(x - lse)` where the lse is not
/// trusted).
#[test]
fn rows_with_large_logits_keep_their_accuracy() {
    large_logits::<f32>(&[1e3, 1e6, 1e20]);
    large_logits::<f64>(&[1e3, 1e6, 1e20]);
    large_logits::<bf16>(&[1e3, 1e6, 1e20]);
    large_logits::<f16>(&[1e2, 1e3, 1e4]);
}

fn large_logits<T: Tol>(offsets: &[f64]) {
    let cols = 301;
    let opts = Options { ignore_index: IGNORE, label_smoothing: 0.1, reduction: Reduction::None };
    for &off in offsets {
        // Row 0: spread logits shifted by `off`; row 1: two tied at `off`
        // (1 apart for f16, whose ulp at 1e4 is 8), the rest at 0; row 2
        // small logits, whose lse (about ln 301) the backward keeps.
        let noise = |i: usize| ((i * 7919 % 2001) as f64 - 1000.0) / 250.0;
        let mut x: Vec<f64> = (0..cols).map(|i| off + noise(i)).collect();
        x.extend((0..cols).map(|i| if i == 7 || i == 250 { off } else { 0.0 }));
        x.extend((0..cols).map(noise));
        let (x, t) = (to_elems::<T>(&x), [3, 5, 9]);
        let grad = to_elems::<T>(&[1.0, 1.0, 1.0]);
        let weights = to_elems::<T>(&(0..cols).map(|i| 0.5 + (i % 7) as f64 * 0.25).collect::<Vec<_>>());
        for w in [None, Some(&weights[..])] {
            let mut out = vec![T::default(); 3];
            let mut lse = vec![T::Acc::ZERO; 3];
            forward_cpu(&x, &t, w, &mut out, Some(&mut lse), cols, opts, Par::Seq).unwrap();
            let (mut given, mut plain) = (vec![T::default(); 3 * cols], vec![T::default(); 3 * cols]);
            backward_cpu(&grad, &x, &t, w, Some(&lse), &mut given, cols, opts, Par::Seq).unwrap();
            backward_cpu(&grad, &x, &t, w, None, &mut plain, cols, opts, Par::Seq).unwrap();
            let bits = |v: &[T]| v.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>();
            let case = format!("[{}] offset {off} weighted {}", T::NAME, w.is_some());
            if matches!(T::NAME, "f32" | "f64") && w.is_none() {
                assert_eq!(
                    bits(&given[..2 * cols]),
                    bits(&plain[..2 * cols]),
                    "{case}: large rows recompute their lse"
                );
            }
            let want = backward_ref(&grad, &x, &t, w, cols, opts);
            let floor = if w.is_some() { 2.0 } else { 1.0 };
            for (dx, how) in [(&given, "given the lse"), (&plain, "")] {
                assert_close_floor(dx, &want, 2.0 * sum_scale::<T>(cols), floor, &format!("{case}: grad {how}"));
            }
            let tied = (given[cols + 7].to_f64(), given[cols + 250].to_f64());
            let near = |a: f64, b: f64| (a - b).abs() < 0.01 * floor;
            assert!(near(tied.0, want[cols + 7]) && near(tied.1, want[cols + 250]), "{case}: {tied:?}");
        }
    }
}

#[test]
fn known_values_with_class_weights() {
    // Uniform logits over 4 classes (every lse - x_c = ln 4), weights 1..4,
    // label smoothing 0.2: row loss (0.8 w[t] + 0.2 / 4 * 10) ln 4; "mean"
    // divides by w[1] + w[3] = 6, the ignored row counting for nothing.
    let (x, t, w) = ([0f32; 12], [1, IGNORE, 3], [1f32, 2.0, 3.0, 4.0]);
    let ln4 = 4f64.ln();
    let opts = Options { ignore_index: IGNORE, label_smoothing: 0.2, reduction: Reduction::None };
    let mut rows = [0f32; 3];
    forward_cpu(&x, &t, Some(&w), &mut rows, None, 4, opts, Par::Seq).unwrap();
    for (got, want) in rows.iter().zip([2.1 * ln4, 0.0, 3.7 * ln4]) {
        assert!((*got as f64 - want).abs() < 1e-6, "{rows:?}");
    }
    let mean = Options { reduction: Reduction::Mean, ..opts };
    let mut out = [0f32];
    forward_cpu(&x, &t, Some(&w), &mut out, None, 4, mean, Par::Seq).unwrap();
    assert!((out[0] as f64 - 5.8 * ln4 / 6.0).abs() < 1e-6, "{out:?}");
    // dx = g (A / 4 - a), A = 0.8 w[t] + 0.5, a = 0.05 w + 0.8 w[t] at t; g = 1 / 6.
    let mut dx = [1f32; 12];
    backward_cpu(&[1.0f32], &x, &t, Some(&w), None, &mut dx, 4, mean, Par::Seq).unwrap();
    let want = [0.475, -1.175, 0.375, 0.325, 0.0, 0.0, 0.0, 0.0, 0.875, 0.825, 0.775, -2.475];
    for (got, want) in dx.iter().zip(want) {
        assert!((*got as f64 - want / 6.0).abs() < 1e-6, "{dx:?}");
    }
    // No smoothing: each row's loss and gradient scaled by its target's weight.
    let plain = Options { label_smoothing: 0.0, ..opts };
    forward_cpu(&x, &t, Some(&w), &mut rows, None, 4, plain, Par::Seq).unwrap();
    assert!((rows[0] as f64 - 2.0 * ln4).abs() < 1e-6 && (rows[2] as f64 - 4.0 * ln4).abs() < 1e-6, "{rows:?}");
    let err = forward_cpu(&x, &t, Some(&w[..3]), &mut rows, None, 4, opts, Par::Seq).unwrap_err().to_string();
    assert_eq!(err, "cross_entropy: argument 'weight' has length 3, expected 4");
    let err = backward_cpu(&[1.0f32; 3], &x, &t, Some(&w[..3]), None, &mut dx, 4, opts, Par::Seq).unwrap_err();
    assert!(err.to_string().contains("cross_entropy_backward: argument 'weight' has length 3"), "{err}");
}

/// "mean" over no weight is NaN, as torch's, with label smoothing too (where the
/// smoothed term's sum is above 0: inf before): every row ignored, or every
/// target's weight 0. The rows not ignored take a NaN gradient, the ignored 0.
#[test]
fn mean_over_no_weight_is_nan_as_torch() {
    let (x, w) = ([0.5f32, -1.0, 2.0, 0.0, 1.0, 3.0], [1f32, 2.0, 0.0]);
    for (t, weight) in [([IGNORE, IGNORE], None), ([IGNORE, IGNORE], Some(&w[..])), ([2, IGNORE], Some(&w[..]))] {
        for ls in [0.0, 0.1] {
            let opts = Options { ignore_index: IGNORE, label_smoothing: ls, reduction: Reduction::Mean };
            let mut out = [0f32];
            forward_cpu(&x, &t, weight, &mut out, None, 3, opts, Par::Seq).unwrap();
            assert!(out[0].is_nan(), "{t:?} {ls}: {out:?}");
            assert!(forward_ref(&x, &t, weight, 3, opts)[0].is_nan());
            let mut dx = [1f32; 6];
            backward_cpu(&[1.0f32], &x, &t, weight, None, &mut dx, 3, opts, Par::Seq).unwrap();
            let want = backward_ref(&[1.0f32], &x, &t, weight, 3, opts);
            for (i, (got, want)) in dx.iter().zip(&want).enumerate() {
                let ignored = t[i / 3] == IGNORE;
                assert!(
                    if ignored { *got == 0.0 && *want == 0.0 } else { got.is_nan() && want.is_nan() },
                    "{t:?} {ls}: {dx:?}"
                );
            }
        }
    }
}

/// The loss of f32 and f64 rows far from 0 keeps the precision of the loss,
/// not of the offset: with label smoothing, `sum_c w_c (lse - x_c)` is summed
/// from `x - max` (`W lse - sum(w x)` cancelled the offset: 1.8e-6 relative
/// at 1000 in f32, where torch has 1.6e-7). Relative to each row's loss.
#[test]
fn shifted_logits_keep_the_losss_precision() {
    shifted_rows::<f32>(2e-7);
    shifted_rows::<f64>(1e-12); // the reference's lse rounds at 1e4: 2e-13 of the loss
}

fn shifted_rows<T: Tol>(bound: f64) {
    let (rows, cols) = (4, 2003);
    let opts = Options { ignore_index: IGNORE, label_smoothing: 0.1, reduction: Reduction::None };
    for off in OFFSETS {
        let (x, weights) = common::shifted_rows::<T>(rows, cols, off);
        let t = [3, 500, 1000, 2002];
        for w in [None, Some(&weights[..])] {
            let mut out = vec![T::default(); rows];
            forward_cpu(&x, &t, w, &mut out, None, cols, opts, Par::Seq).unwrap();
            let want = forward_ref(&x, &t, w, cols, opts);
            assert_relative(&out, &want, bound, &format!("offset {off} weighted {}", w.is_some()));
        }
    }
}

/// A row of `-inf` only: its lse is `-inf`, as `torch.logsumexp`'s (not the
/// NaN of `max + ln(sum(exp(x - max)))`), and its loss NaN, as torch's; the
/// row beside it keeps its values. Class indices with and without label
/// smoothing and class weights, and probabilities, f32 and bf16.
#[test]
fn a_row_of_neg_inf_has_lse_neg_inf() {
    use keel::ops::cross_entropy::forward_probs_cpu;
    fn rows<T: Element>() -> Vec<T> {
        let mut x = vec![T::from_f64(f64::NEG_INFINITY); 10];
        x[5..].iter_mut().enumerate().for_each(|(i, v)| *v = T::from_f64(i as f64 * 0.5));
        x
    }
    fn each<T: Element>() {
        let x = rows::<T>();
        let want = lse_ref(&x[5..]);
        let w: Vec<T> = (0..5).map(|i| T::from_f64(0.5 + i as f64)).collect();
        for (ls, weight) in [(0.0, None), (0.1, None), (0.1, Some(&w[..]))] {
            let opts = Options { ignore_index: IGNORE, label_smoothing: ls, reduction: Reduction::None };
            let (mut out, mut lse) = ([T::from_f64(0.0); 2], [T::Acc::from_f64(0.0); 2]);
            forward_cpu(&x, &[1, 2], weight, &mut out, Some(&mut lse), 5, opts, Par::Seq).unwrap();
            assert_eq!(lse[0].to_f64(), f64::NEG_INFINITY, "ls {ls} weighted {}", weight.is_some());
            assert!((lse[1].to_f64() - want).abs() < 1e-6, "{} vs {want}", lse[1].to_f64());
            assert!(out[0].to_f64().is_nan() && out[1].to_f64().is_finite(), "losses {:?}", out.map(|v| v.to_f64()));
        }
        let p: Vec<T> = (0..10).map(|_| T::from_f64(0.2)).collect();
        let (mut out, mut lse) = ([T::from_f64(0.0); 2], [T::Acc::from_f64(0.0); 2]);
        forward_probs_cpu(&x, &p, None, &mut out, Some(&mut lse), 5, 0.0, Reduction::None, Par::Seq).unwrap();
        assert_eq!(lse[0].to_f64(), f64::NEG_INFINITY, "probabilities");
        assert!((lse[1].to_f64() - want).abs() < 1e-6 && out[0].to_f64().is_nan(), "probabilities");
    }
    each::<f32>();
    each::<bf16>();
}
