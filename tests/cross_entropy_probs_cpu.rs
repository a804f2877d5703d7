//! Property tests: the CPU fused cross-entropy against probability targets
//! (loss, each row's log-sum-exp, and the gradient, recomputing the lse and
//! given it) against the f64 reference for every reduction, with and without
//! label smoothing, with and without class weights, targets that sum to 1
//! and ones that do not, every dtype, sequential and on rayon, and targets
//! of another dtype than the logits (f32 probabilities of f16 and bf16
//! logits, 16-bit ones of f32 logits or of the other 16-bit type, read as
//! they are); plus known values and bad arguments.
mod common;

use common::{assert_close_floor, assert_relative, sum_scale, to_elems, Tol, OFFSETS};
use keel::cpu::{bf16, f16, Acc, Element, Par};
use keel::ops::cross_entropy::{backward_probs_cpu, forward_probs_cpu, Reduction};
use keel_cpu::cross_entropy_probs::{backward_ref, forward_ref};
use proptest::prelude::*;

/// Rows, columns, logits, targets, whether to normalise them, label
/// smoothing, the loss gradient, and class weights (none, or in [0, 4)).
#[allow(clippy::type_complexity)]
fn case() -> impl Strategy<Value = (usize, usize, Vec<f64>, Vec<f64>, bool, f64, f64, Option<Vec<f64>>)> {
    (0usize..=7, 1usize..=300, prop_oneof![Just(0.0), 0.0f64..=1.0]).prop_flat_map(|(rows, cols, ls)| {
        let x = prop::collection::vec(prop_oneof![-5.0f64..5.0, -40.0f64..40.0], rows * cols);
        let p = prop::collection::vec(prop_oneof![Just(0.0), 0.0f64..1.0], rows * cols);
        let w = prop::option::of(prop::collection::vec(prop_oneof![Just(0.0), 0.0f64..4.0], cols));
        (Just(rows), Just(cols), x, p, any::<bool>(), Just(ls), -2.0f64..2.0, w)
    })
}

/// `p` as `T`, each row scaled to sum to 1 when `normalise` (and it can).
fn targets<T: Element>(p: &[f64], cols: usize, normalise: bool) -> Vec<T> {
    let mut p = p.to_vec();
    if normalise {
        for row in p.chunks_mut(cols) {
            let s: f64 = row.iter().sum();
            if s > 0.0 {
                row.iter_mut().for_each(|v| *v /= s);
            }
        }
    }
    to_elems::<T>(&p)
}

/// Logits of `T`, targets of `P` (the reference reads the same values), the
/// loss and its gradient of `O`, at `T`'s tolerances.
#[allow(clippy::too_many_arguments)]
fn check<T: Tol, P: Element<Acc = T::Acc>, O: Element>(
    rows: usize,
    cols: usize,
    x: &[f64],
    p: &[f64],
    normalise: bool,
    ls: f64,
    g: f64,
    w: Option<Vec<f64>>,
) {
    let (x, p) = (to_elems::<T>(x), targets::<P>(p, cols, normalise));
    let w = w.map(|w| to_elems::<P>(&w));
    let w = w.as_deref();
    // Terms of size |x| (times the row's target sum, at most `cols`, times
    // the largest weight) enter each loss: compare relative to that scale.
    let wmax = w.map_or(1.0, |w| w.iter().fold(1.0f64, |m, v| m.max(v.to_f64())));
    let psum = wmax * p.chunks(cols.max(1)).map(|r| r.iter().map(|v| v.to_f64()).sum::<f64>()).fold(1.0f64, f64::max);
    let floor = x.iter().fold(1.0f64, |m, v| m.max(v.to_f64().abs())) * psum;
    for reduction in [Reduction::None, Reduction::Mean, Reduction::Sum] {
        let n = reduction.out_len(rows);
        let grad = to_elems::<O>(&(0..n).map(|i| g + i as f64 * 0.25).collect::<Vec<_>>());
        let want = forward_ref(&x, &p, w, cols, ls, reduction);
        let want_dx = backward_ref(&grad, &x, &p, w, cols, ls, reduction);
        for par in [Par::Seq, Par::Rayon] {
            let (mut out, mut lse) = (vec![O::default(); n], vec![T::Acc::ONE; rows]);
            forward_probs_cpu(&x, &p, w, &mut out, Some(&mut lse), cols, ls, reduction, par).unwrap();
            for (i, (l, xr)) in lse.iter().zip(x.chunks(cols)).enumerate() {
                let want = lse_ref(xr);
                let bound = if T::NAME == "f64" { 1e-12 } else { 1e-6 } * (1.0 + want.abs());
                assert!((l.to_f64() - want).abs() <= bound, "lse [{}] row {i}: {} vs {want}", T::NAME, l.to_f64());
            }
            if reduction == Reduction::Mean && rows == 0 {
                assert!(out[0].to_f64().is_nan(), "mean over no rows is NaN, as torch");
                continue;
            }
            // At T's tolerance (an O wider than T is held to T's).
            let out: Vec<T> = out.iter().map(|v| T::from_f64(v.to_f64())).collect();
            assert_close_floor(
                &out,
                &want,
                2.0 * sum_scale::<T>(cols * rows.max(1)),
                floor * if reduction == Reduction::None { 1.0 } else { rows as f64 },
                &format!("{reduction:?} loss"),
            );
            for (how, lse) in [("", None), (" given the lse", Some(lse.as_slice()))] {
                let mut dx = vec![T::default(); rows * cols];
                backward_probs_cpu(&grad, &x, &p, w, lse, &mut dx, cols, ls, reduction, par).unwrap();
                assert_close_floor(
                    &dx,
                    &want_dx,
                    2.0 * sum_scale::<T>(cols),
                    (g.abs() + 1.0) * psum,
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
    fn f32_matches_reference((rows, cols, x, p, norm, ls, g, w) in case()) { check::<f32, f32, f32>(rows, cols, &x, &p, norm, ls, g, w); }

    #[test]
    fn f64_matches_reference((rows, cols, x, p, norm, ls, g, w) in case()) { check::<f64, f64, f64>(rows, cols, &x, &p, norm, ls, g, w); }

    #[test]
    fn f16_matches_reference((rows, cols, x, p, norm, ls, g, w) in case()) { check::<f16, f16, f16>(rows, cols, &x, &p, norm, ls, g, w); }

    #[test]
    fn bf16_matches_reference((rows, cols, x, p, norm, ls, g, w) in case()) { check::<bf16, bf16, bf16>(rows, cols, &x, &p, norm, ls, g, w); }

    #[test]
    fn bf16_logits_f32_targets_match_reference((rows, cols, x, p, norm, ls, g, w) in case()) {
        check::<bf16, f32, f32>(rows, cols, &x, &p, norm, ls, g, w);
    }

    #[test]
    fn f16_logits_f32_targets_match_reference((rows, cols, x, p, norm, ls, g, w) in case()) {
        check::<f16, f32, f32>(rows, cols, &x, &p, norm, ls, g, w);
    }

    #[test]
    fn f32_logits_bf16_targets_match_reference((rows, cols, x, p, norm, ls, g, w) in case()) {
        check::<f32, bf16, f32>(rows, cols, &x, &p, norm, ls, g, w);
    }

    #[test]
    fn f32_logits_f16_targets_match_reference((rows, cols, x, p, norm, ls, g, w) in case()) {
        check::<f32, f16, f32>(rows, cols, &x, &p, norm, ls, g, w);
    }

    #[test]
    fn f16_logits_bf16_targets_match_reference((rows, cols, x, p, norm, ls, g, w) in case()) {
        check::<f16, bf16, f32>(rows, cols, &x, &p, norm, ls, g, w);
    }

    #[test]
    fn bf16_logits_f16_targets_match_reference((rows, cols, x, p, norm, ls, g, w) in case()) {
        check::<bf16, f16, f32>(rows, cols, &x, &p, norm, ls, g, w);
    }
}

/// An f32 target of bf16 logits is read as it is, not rounded to bf16, and
/// the loss is f32 (torch's promotion): a target value that bf16 cannot hold
/// gives the loss and gradient of that value, not of the rounded one.
#[test]
fn f32_targets_are_not_rounded_to_the_logits_dtype() {
    let x = [bf16::ZERO; 4];
    // 1 + 3 2^-10 is not a bf16 (8 significant bits): bf16 rounds it to 1.
    let p = [1.0f32 + 3.0 / 1024.0, 0.0, 0.0, 0.0];
    let (mut out, mut lse) = ([0f32], [0f32]);
    forward_probs_cpu(&x, &p, None, &mut out, Some(&mut lse), 4, 0.0, Reduction::None, Par::Seq).unwrap();
    // Uniform logits: the loss is p_0 ln 4, in f32.
    let want = f64::from(p[0]) * 4f64.ln();
    assert!((f64::from(out[0]) - want).abs() < 1e-6 * want, "{} vs {want}", out[0]);
    assert!((lse[0] - 4f32.ln()).abs() < 1e-6);
    // The gradient is bf16: dx_0 = A / 4 - p_0 with A = p_0, -0.75 p_0 =
    // -0.75220, rounds to -0.75391; the rounded target's -0.75 is bf16 already.
    let mut dx = [bf16::ZERO; 4];
    backward_probs_cpu(&[1f32], &x, &p, None, Some(&lse), &mut dx, 4, 0.0, Reduction::Sum, Par::Seq).unwrap();
    let want = -0.75 * f64::from(p[0]);
    assert_eq!(dx[0], bf16::from_f64(want), "{} vs {want}", dx[0]);
    assert_ne!(dx[0], bf16::from_f64(-0.75), "the target was rounded to bf16");
}

#[test]
fn known_values() {
    // Uniform logits over 4 classes: each row's lse is ln 4; a one-hot row
    // loses ln 4, a row of halves (sum 1) too, a row of zeros nothing.
    let x = [0f32; 12];
    let p: [f32; 12] = [0.0, 1.0, 0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0];
    let mut out = [0f32; 3];
    let mut lse = [f32::NAN; 3];
    forward_probs_cpu(&x, &p, None, &mut out, Some(&mut lse), 4, 0.0, Reduction::None, Par::Seq).unwrap();
    let l4 = 4f32.ln();
    assert_eq!(lse, [l4; 3]);
    assert!((out[0] - l4).abs() < 1e-6 && (out[1] - l4).abs() < 1e-6 && out[2] == 0.0, "{out:?}");
    // dx = g (A softmax - q): 1/4 - p at sum 1; 0 where the target is all zeros.
    let mut dx = [9f32; 12];
    backward_probs_cpu(&[1.0f32; 3], &x, &p, None, Some(&lse), &mut dx, 4, 0.0, Reduction::None, Par::Seq).unwrap();
    let want = [0.25, -0.75, 0.25, 0.25, -0.25, 0.25, -0.25, 0.25, 0.0, 0.0, 0.0, 0.0];
    assert!(dx.iter().zip(want).all(|(d, w)| (d - w).abs() < 1e-6), "{dx:?}");
    // Full label smoothing ignores the target: the loss is lse - mean(x) = ln 4.
    let mut mean = [0f32];
    forward_probs_cpu(&x, &p, None, &mut mean, None, 4, 1.0, Reduction::Mean, Par::Seq).unwrap();
    assert!((mean[0] - l4).abs() < 1e-6, "{mean:?}");
    // Class weights [1, 3, 1, 1], one-hot on class 1: a = [0, 3, 0, 0], the
    // loss 3 ln 4, dx = A softmax - a = 0.75 - a; smoothing 1 with them, a =
    // w / 4: the loss (sum w / 4) ln 4 = 1.5 ln 4.
    let (w, p1) = ([1.0f32, 3.0, 1.0, 1.0], [0.0f32, 1.0, 0.0, 0.0]);
    let mut one = [0f32];
    forward_probs_cpu(&x[..4], &p1, Some(&w), &mut one, None, 4, 0.0, Reduction::Sum, Par::Seq).unwrap();
    assert!((one[0] - 3.0 * l4).abs() < 1e-5, "{one:?}");
    forward_probs_cpu(&x[..4], &p1, Some(&w), &mut one, None, 4, 1.0, Reduction::Sum, Par::Seq).unwrap();
    assert!((one[0] - 1.5 * l4).abs() < 1e-5, "{one:?}");
    let mut dx = [9f32; 4];
    backward_probs_cpu(&[1.0f32], &x[..4], &p1, Some(&w), None, &mut dx, 4, 0.0, Reduction::Sum, Par::Seq).unwrap();
    assert!(dx.iter().zip([0.75, -2.25, 0.75, 0.75]).all(|(d, w)| (d - w).abs() < 1e-6), "{dx:?}");
}

#[test]
fn bad_arguments_are_errors() {
    let err = |r: keel::Result<()>| r.unwrap_err().to_string();
    let mut out = [0f32];
    let x = [0f32; 8];
    assert!(err(forward_probs_cpu(&x, &[0f32; 4], None, &mut out, None, 4, 0.0, Reduction::Sum, Par::Seq))
        .contains("cross_entropy: argument 'target' has length 4, expected 8"));
    assert!(err(forward_probs_cpu(&x, &x, None, &mut out, None, 4, -0.5, Reduction::Sum, Par::Seq))
        .contains("'label_smoothing': must be in [0, 1]"));
    assert!(err(forward_probs_cpu(&x, &x, None, &mut out, None, 3, 0.0, Reduction::Sum, Par::Seq))
        .contains("'logits': length 8 is not a multiple of v = 3"));
    assert!(err(forward_probs_cpu(&x, &x, None, &mut out, Some(&mut [0f32; 3]), 4, 0.0, Reduction::Sum, Par::Seq))
        .contains("'lse' has length 3, expected 2"));
    assert!(err(forward_probs_cpu(&x, &x, Some(&[1f32; 3]), &mut out, None, 4, 0.0, Reduction::Sum, Par::Seq))
        .contains("cross_entropy: argument 'weight' has length 3, expected 4"));
    let mut dx = [0f32; 8];
    assert!(err(backward_probs_cpu(&[1.0f32; 2], &x, &x, None, None, &mut dx, 4, 0.0, Reduction::Sum, Par::Seq))
        .contains("cross_entropy_backward: argument 'grad' has length 2, expected 1"));
    let w = Some(&[1f32; 5][..]);
    assert!(err(backward_probs_cpu(&[1.0f32], &x, &x, w, None, &mut dx, 4, 0.0, Reduction::Sum, Par::Seq))
        .contains("cross_entropy_backward: argument 'weight' has length 5, expected 4"));
}

/// The loss of f32 and f64 rows far from 0 keeps the precision of the loss,
/// not of the offset: `sum_c a_c (lse - x_c)` is summed from `x - max` (`A
/// lse - sum(a x)` cancelled the offset: 2.7e-5 relative at 1000 in f32,
/// where torch has 1.3e-7). Relative to each row's loss.
#[test]
fn shifted_logits_keep_the_losss_precision() {
    shifted_rows::<f32>(2e-7);
    shifted_rows::<f64>(1e-12); // the reference's lse rounds at 1e4: 2e-13 of the loss
}

fn shifted_rows<T: Tol>(bound: f64) {
    let (rows, cols) = (4, 2003);
    let p: Vec<f64> = (0..rows * cols).map(|i| (i * 104_729 % 1009) as f64).collect();
    let p = targets::<T>(&p, cols, true);
    for off in OFFSETS {
        let (x, weights) = common::shifted_rows::<T>(rows, cols, off);
        for (w, ls) in [(None, 0.0), (None, 0.1), (Some(&weights[..]), 0.1)] {
            let mut out = vec![T::default(); rows];
            forward_probs_cpu(&x, &p, w, &mut out, None, cols, ls, Reduction::None, Par::Seq).unwrap();
            let want = forward_ref(&x, &p, w, cols, ls, Reduction::None);
            assert_relative(&out, &want, bound, &format!("offset {off} ls {ls} weighted {}", w.is_some()));
        }
    }
}
