//! Property tests: the CPU gated activations (silu_and_mul, gelu_and_mul
//! exact and tanh) against the f64 reference, every dtype, odd widths, zero
//! and one row, sequential and on rayon.
mod common;

use common::{to_elems, Tol};
use keel::cpu::{bf16, f16, Par};
use keel::ops::gated::{backward_cpu, forward_cpu, Activation};
use keel_cpu::gated::{backward_ref, forward_ref};
use proptest::prelude::*;

const ACTS: [Activation; 3] = [Activation::Silu, Activation::Gelu, Activation::GeluTanh];

fn case() -> impl Strategy<Value = (usize, usize, Vec<f64>, Vec<f64>)> {
    (0usize..=9, 1usize..=150).prop_flat_map(|(rows, d)| {
        // Wide enough to reach the saturated tails of exp and erf.
        let v = |n| prop::collection::vec(prop_oneof![-6.0f64..6.0, -100.0f64..100.0], n);
        (Just(rows), Just(d), v(rows * 2 * d), v(rows * d))
    })
}

/// `|got - want| <= 2 (atol + rtol |want|) + 2e-6 (1 + |a|) |m|` element-wise:
/// the dtype's rounding, plus the f32 activation's error (exp/erf/tanh within
/// 5e-7 absolute, scaled by |a| for the `a *` in silu/gelu) times the factor
/// `m` it is multiplied by.
fn assert_gated<T: Tol>(got: &[T], want: &[f64], a: &[f64], m: &[f64], what: &str) {
    let t = T::TOL;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = 2.0 * (t.atol + t.rtol * w.abs()) + 2e-6 * (1.0 + a[i].abs()) * m[i].abs();
        let g = g.to_f64();
        assert!((g - w).abs() <= bound, "{what} [{}] at {i}: got {g}, want {w} (bound {bound})", T::NAME);
    }
}

fn check<T: Tol>(rows: usize, d: usize, x: &[f64], dy: &[f64]) {
    let (x, dy) = (to_elems::<T>(x), to_elems::<T>(dy));
    // Per output: the activation's input a, and what multiplies the activation.
    let (mut a, mut m, mut a2, mut m2) = (vec![], vec![], vec![], vec![]);
    for (row, g) in x.chunks(2 * d).zip(dy.chunks(d)) {
        for j in 0..d {
            let (av, bv, gv) = (row[j].to_f64(), row[d + j].to_f64(), g[j].to_f64());
            a.push(av);
            m.push(bv);
            a2.push(av);
            m2.push(gv * bv);
        }
        for j in 0..d {
            a2.push(row[j].to_f64());
            m2.push(g[j].to_f64());
        }
    }
    for act in ACTS {
        let want = forward_ref(act, &x, d);
        let want_dx = backward_ref(act, &dy, &x, d);
        for par in [Par::Seq, Par::Rayon] {
            let mut y = vec![T::default(); rows * d];
            forward_cpu(act, &x, &mut y, d, par).unwrap();
            assert_gated(&y, &want, &a, &m, &format!("{act:?} forward"));
            let mut dx = vec![T::default(); rows * 2 * d];
            backward_cpu(act, &dy, &x, &mut dx, d, par).unwrap();
            assert_gated(&dx, &want_dx, &a2, &m2, &format!("{act:?} grad_input"));
        }
    }
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn f32_matches_reference((rows, d, x, dy) in case()) { check::<f32>(rows, d, &x, &dy); }

    #[test]
    fn f64_matches_reference((rows, d, x, dy) in case()) { check::<f64>(rows, d, &x, &dy); }

    #[test]
    fn f16_matches_reference((rows, d, x, dy) in case()) { check::<f16>(rows, d, &x, &dy); }

    #[test]
    fn bf16_matches_reference((rows, d, x, dy) in case()) { check::<bf16>(rows, d, &x, &dy); }
}

/// Infinities, NaN and huge finite values on both halves, through the vector
/// loop (d = 40) and its tail: where the f64 reference is NaN or infinite
/// the kernel must give the same (`silu(-inf)` is NaN, as in torch: `-inf /
/// (1 + e^inf)`), and close to it elsewhere. At +-3e19 and beyond, `x^2`
/// overflows f32: gelu_tanh's derivative must still be 1 or 0 (torch's CPU
/// backward gives NaN there).
fn check_special<T: Tol>() {
    let (inf, nan) = (f64::INFINITY, f64::NAN);
    let special = [-inf, inf, nan, -100.0, 100.0, -1.5, 0.0, 3.0, 3e19, -3e19, 1e20, -2e37];
    let d = 40;
    let mut x = vec![];
    for j in 0..d {
        x.push(special[j % special.len()]); // row 0: a special, b = 2
    }
    x.extend(std::iter::repeat_n(2.0, d));
    for j in 0..d {
        x.push([0.5, -2.0, 7.0][j % 3]); // row 1: a finite, b special
    }
    for j in 0..d {
        x.push(special[j % special.len()]);
    }
    let x = to_elems::<T>(&x);
    let dy = to_elems::<T>(&vec![1.0; 2 * d]);
    for act in ACTS {
        let want = forward_ref(act, &x, d);
        let want_dx = backward_ref(act, &dy, &x, d);
        let mut y = vec![T::default(); 2 * d];
        forward_cpu(act, &x, &mut y, d, Par::Seq).unwrap();
        let mut dx = vec![T::default(); 4 * d];
        backward_cpu(act, &dy, &x, &mut dx, d, Par::Seq).unwrap();
        for (got, want, what) in [(&y, &want, "forward"), (&dx, &want_dx, "grad_input")] {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let g = g.to_f64();
                let ok = if w.is_finite() {
                    (g - w).abs() <= 4.0 * (T::TOL.atol + T::TOL.rtol * w.abs()) + 1e-3 * w.abs().max(1.0)
                } else {
                    g == *w || (g.is_nan() && w.is_nan())
                };
                assert!(ok, "{act:?} {what} [{}] at {i}: got {g}, want {w}", T::NAME);
            }
        }
    }
}

#[test]
fn special_values_match_reference() {
    check_special::<f32>();
    check_special::<f64>();
    check_special::<f16>();
    check_special::<bf16>();
}

#[test]
fn known_values() {
    // silu(1) * 2 = 2 / (1 + e^-1); gelu(1) = Phi(1) = 0.8413447460685429.
    let x = [1.0f32, 2.0];
    let mut y = [0f32];
    forward_cpu(Activation::Silu, &x, &mut y, 1, Par::Seq).unwrap();
    assert!((y[0] as f64 - 2.0 / (1.0 + (-1f64).exp())).abs() < 1e-6);
    forward_cpu(Activation::Gelu, &x, &mut y, 1, Par::Seq).unwrap();
    assert!((y[0] as f64 - 2.0 * 0.841_344_746_068_542_9).abs() < 2e-6);
}

#[test]
fn bad_shapes_and_approximate_are_errors() {
    let err = |r: keel::Result<()>| r.unwrap_err().to_string();
    let mut y = [0f32; 3];
    assert!(err(forward_cpu(Activation::Silu, &[0f32; 7], &mut y, 3, Par::Seq)).contains("not a multiple of 2d = 6"));
    assert_eq!(
        err(forward_cpu(Activation::Gelu, &[0f32; 6], &mut y[..2], 3, Par::Seq)),
        "gelu_and_mul: argument 'out' has length 2, expected 3"
    );
    assert_eq!(
        Activation::gelu("fast").unwrap_err().to_string(),
        "gelu_and_mul: argument 'approximate': must be \"none\" or \"tanh\", got \"fast\""
    );
}
