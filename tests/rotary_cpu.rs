//! Property tests: the CPU rotary embedding (both layouts, forward and the
//! inverse rotation) against the f64 reference, every dtype, partial rotary
//! dims, sequential and on rayon; and that the inverse undoes the forward.
//! The strided entry point (x read in place through its strides) against the
//! contiguous one on a gathered copy.
mod common;

use common::{assert_close, in_pool_if, to_elems, Tol};
use keel::cpu::{bf16, f16, Par};
use keel::ops::rotary::{apply_cpu, apply_inplace_cpu, apply_strided_cpu, Shape, Strides};
use keel_cpu::rotary::apply_ref;
use proptest::prelude::*;

fn case() -> impl Strategy<Value = (Shape, Vec<f64>, Vec<f64>)> {
    (0usize..=2, 1usize..=5, 1usize..=3, 1usize..=40, 0usize..=20).prop_flat_map(|(batch, seq, heads, hd, r)| {
        let head_dim = 2 * hd;
        let rotary_dim = 2 * (r % (hd + 1));
        let shape = Shape { batch, seq, heads, head_dim, rotary_dim };
        let x = prop::collection::vec(-4.0f64..4.0, shape.numel());
        let angles = prop::collection::vec(-10.0f64..10.0, seq * rotary_dim / 2);
        (Just(shape), x, angles)
    })
}

fn check<T: Tol>(shape: Shape, x: &[f64], angles: &[f64]) {
    let x = to_elems::<T>(x);
    let cos = to_elems::<T>(&angles.iter().map(|a| a.cos()).collect::<Vec<_>>());
    let sin = to_elems::<T>(&angles.iter().map(|a| a.sin()).collect::<Vec<_>>());
    for interleaved in [false, true] {
        for inverse in [false, true] {
            let want = apply_ref(&x, &cos, &sin, shape, interleaved, inverse);
            for par in [Par::Seq, Par::Rayon] {
                let mut y = vec![T::default(); shape.numel()];
                apply_cpu(&x, &cos, &sin, &mut y, shape, interleaved, inverse, par).unwrap();
                // Two products and a sum in f32, one rounding: |a| + |b| <= 8 sets the floor.
                assert_close(&y, &want, 8.0, &format!("interleaved={interleaved} inverse={inverse}"));
            }
        }
    }
}

/// The orders of x's storage dims (batch 0, seq 1, heads 2), outermost first.
const ORDERS: [[usize; 3]; 6] = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];

/// A shape and a layout of x: its dims stored in any order, each head padded by
/// up to 3 elements, maybe a spare head per token (q sliced from a wider
/// projection), maybe the batch broadcast (stride 0); the storage holds the
/// span of that layout.
fn strided_case() -> impl Strategy<Value = (Shape, Strides, Vec<f64>, Vec<f64>)> {
    (case(), 0usize..6, 0usize..=3, 0usize..=1, any::<bool>()).prop_flat_map(
        |((shape, _, angles), order, pad, spare, broadcast)| {
            let sizes = [shape.batch, shape.seq, shape.heads + spare];
            let (mut st, mut step) = ([0usize; 3], shape.head_dim + pad);
            for &d in ORDERS[order].iter().rev() {
                st[d] = step;
                step *= sizes[d].max(1);
            }
            if broadcast {
                st[0] = 0;
            }
            let strides = Strides { batch: st[0], seq: st[1], heads: st[2] };
            let storage = prop::collection::vec(-4.0f64..4.0, shape.span(strides).unwrap());
            (Just(shape), Just(strides), storage, Just(angles))
        },
    )
}

/// x's elements in contiguous order, gathered from `storage` through `st`.
fn gather<T: Copy>(storage: &[T], st: Strides, shape: Shape) -> Vec<T> {
    let mut x = Vec::with_capacity(shape.numel());
    for b in 0..shape.batch {
        for s in 0..shape.seq {
            for h in 0..shape.heads {
                x.extend_from_slice(&storage[b * st.batch + s * st.seq + h * st.heads..][..shape.head_dim]);
            }
        }
    }
    x
}

fn check_strided<T: Tol + PartialEq + std::fmt::Debug>(shape: Shape, st: Strides, storage: &[f64], angles: &[f64]) {
    let storage = to_elems::<T>(storage);
    let x = gather(&storage, st, shape);
    let cos = to_elems::<T>(&angles.iter().map(|a| a.cos()).collect::<Vec<_>>());
    let sin = to_elems::<T>(&angles.iter().map(|a| a.sin()).collect::<Vec<_>>());
    for interleaved in [false, true] {
        for inverse in [false, true] {
            let mut want = vec![T::default(); shape.numel()];
            apply_cpu(&x, &cos, &sin, &mut want, shape, interleaved, inverse, Par::Seq).unwrap();
            for (name, par) in [("seq", Par::Seq), ("rayon", Par::Rayon)] {
                // rayon from inside its pool, where inputs this size are split.
                in_pool_if(name == "rayon", || {
                    let mut y = vec![T::default(); shape.numel()];
                    apply_strided_cpu(&storage, st, &cos, &sin, &mut y, shape, interleaved, inverse, par).unwrap();
                    // The same arithmetic per element as on the contiguous copy.
                    assert_eq!(y, want, "{st:?} interleaved={interleaved} inverse={inverse} {name}");
                    check_inplace(&storage, st, &cos, &sin, shape, interleaved, inverse, par, &want);
                });
            }
        }
    }
}

/// In place on `storage` (a copy): the rows hold `want`, every other element
/// is unchanged; a layout whose heads overlap (a broadcast batch) is refused.
#[allow(clippy::too_many_arguments)]
fn check_inplace<T: Tol + PartialEq + std::fmt::Debug>(
    storage: &[T],
    st: Strides,
    cos: &[T],
    sin: &[T],
    shape: Shape,
    interleaved: bool,
    inverse: bool,
    par: Par<'_>,
    want: &[T],
) {
    let mut x = storage.to_vec();
    let r = apply_inplace_cpu(&mut x, st, cos, sin, shape, interleaved, inverse, par);
    if st.batch == 0 && shape.batch > 1 && shape.numel() > 0 {
        assert!(r.unwrap_err().to_string().contains("has heads that overlap"), "{st:?}");
        assert_eq!(x, storage, "a refused call writes nothing");
        return;
    }
    r.unwrap();
    assert_eq!(gather(&x, st, shape), want, "in place, {st:?} interleaved={interleaved} inverse={inverse}");
    let mut in_rows = vec![false; storage.len()];
    for b in 0..shape.batch {
        for s in 0..shape.seq {
            for h in 0..shape.heads {
                in_rows[b * st.batch + s * st.seq + h * st.heads..][..shape.head_dim].fill(true);
            }
        }
    }
    for (i, ((a, b), inside)) in x.iter().zip(storage).zip(&in_rows).enumerate() {
        assert!(*inside || a == b, "in place wrote element {i} outside x's heads ({st:?})");
    }
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn f32_strided_matches_contiguous((shape, st, x, a) in strided_case()) { check_strided::<f32>(shape, st, &x, &a); }

    #[test]
    fn bf16_strided_matches_contiguous((shape, st, x, a) in strided_case()) { check_strided::<bf16>(shape, st, &x, &a); }

    #[test]
    fn f16_strided_matches_contiguous((shape, st, x, a) in strided_case()) { check_strided::<f16>(shape, st, &x, &a); }

    #[test]
    fn f32_matches_reference((shape, x, a) in case()) { check::<f32>(shape, &x, &a); }

    #[test]
    fn f64_matches_reference((shape, x, a) in case()) { check::<f64>(shape, &x, &a); }

    #[test]
    fn f16_matches_reference((shape, x, a) in case()) { check::<f16>(shape, &x, &a); }

    #[test]
    fn bf16_matches_reference((shape, x, a) in case()) { check::<bf16>(shape, &x, &a); }
}

/// Transposed layouts large enough for several parallel blocks, whose edges
/// fall inside a tile of tokens (the strided kernel then works tile by tile,
/// head by head), and with more tokens than one tile.
#[test]
fn transposed_layout_over_many_blocks_matches_contiguous() {
    for (batch, seq, heads, head_dim, rotary_dim) in [(3, 50, 7, 130, 96), (1, 300, 3, 64, 64), (2, 17, 2, 8, 8)] {
        let shape = Shape { batch, seq, heads, head_dim, rotary_dim };
        let st = Strides { batch: heads * seq * head_dim, seq: head_dim, heads: seq * head_dim };
        let storage: Vec<f64> =
            (0..shape.span(st).unwrap()).map(|i| ((i * 7919 % 2001) as f64 - 1000.0) / 400.0).collect();
        let angles: Vec<f64> = (0..seq * rotary_dim / 2).map(|i| (i as f64 * 0.37).sin() * 3.0).collect();
        check_strided::<f32>(shape, st, &storage, &angles);
        check_strided::<bf16>(shape, st, &storage, &angles);
    }
}

#[test]
fn inverse_undoes_forward_and_layouts_pair_the_right_dims() {
    let shape = Shape { batch: 1, seq: 2, heads: 1, head_dim: 6, rotary_dim: 4 };
    let x: Vec<f64> = (0..12).map(|i| i as f64 + 1.0).collect();
    let a = [0.3, -1.1, 2.0, 0.7];
    let (cos, sin): (Vec<f64>, Vec<f64>) = a.iter().map(|a: &f64| (a.cos(), a.sin())).unzip();
    for interleaved in [false, true] {
        let mut y = vec![0f64; 12];
        let mut back = vec![0f64; 12];
        apply_cpu(&x, &cos, &sin, &mut y, shape, interleaved, false, Par::Seq).unwrap();
        apply_cpu(&y, &cos, &sin, &mut back, shape, interleaved, true, Par::Seq).unwrap();
        assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() < 1e-12));
        assert_eq!((y[4], y[5]), (5.0, 6.0), "dims past rotary_dim pass through");
    }
    // Position 0, NeoX: the pair (x0, x2) at angle 0.3.
    let mut y = vec![0f64; 12];
    apply_cpu(&x, &cos, &sin, &mut y, shape, false, false, Par::Seq).unwrap();
    assert!((y[0] - (0.3f64.cos() - 3.0 * 0.3f64.sin())).abs() < 1e-12);
    // GPT-J: the pair (x0, x1).
    apply_cpu(&x, &cos, &sin, &mut y, shape, true, false, Par::Seq).unwrap();
    assert!((y[0] - (0.3f64.cos() - 2.0 * 0.3f64.sin())).abs() < 1e-12);
}

#[test]
fn bad_shapes_are_errors() {
    let err = |r: keel::Result<()>| r.unwrap_err().to_string();
    let shape = Shape { batch: 1, seq: 2, heads: 1, head_dim: 4, rotary_dim: 6 };
    let mut y = [0f32; 8];
    assert!(err(apply_cpu(&[0f32; 8], &[0f32; 6], &[0f32; 6], &mut y, shape, false, false, Par::Seq))
        .contains("rotary_dim = 6 (2 x its last dim), which must be even and at most head_dim = 4"));
    let shape = Shape { rotary_dim: 4, ..shape };
    assert_eq!(
        err(apply_cpu(&[0f32; 8], &[0f32; 4], &[0f32; 3], &mut y, shape, false, false, Par::Seq)),
        "rotary_embedding: argument 'sin' has length 3, expected 4"
    );
    // Strided: x must reach the last row (position 1 at 6, plus a head of 4).
    let st = Strides { batch: 0, seq: 6, heads: 4 };
    let (c, s) = ([0f32; 4], [0f32; 4]);
    assert_eq!(
        err(apply_strided_cpu(&[0f32; 9], st, &c, &s, &mut y, shape, false, false, Par::Seq)),
        "rotary_embedding: argument 'x': holds 9 elements, but its shape and strides \
         [0, 6, 4, 1] reach 10"
    );
    assert!(apply_strided_cpu(&[0f32; 10], st, &c, &s, &mut y, shape, false, false, Par::Seq).is_ok());
    let huge = Strides { batch: 0, seq: usize::MAX, heads: 4 };
    assert!(err(apply_strided_cpu(&[0f32; 10], huge, &c, &s, &mut y, shape, false, false, Par::Seq))
        .contains("overflow the address space"));
}
