//! The CUDA entry points (`*_on`: launch shapes, argument lists, launch
//! order, scratch) and the kernels' source, run on the CPU emulation of
//! `crate::cuda::emu`, against the CPU kernels (themselves checked against
//! f64 references). Each case runs with the threads of every block in both
//! orders between barriers, which must agree bit for bit, and on one SM and
//! on 132 (grid-stride loops with many rows per block, and one row per block).
//!
//! These do not run the PTX or touch a GPU; `tests/ops_cuda.rs` does that
//! where there is one.
mod gated_rotary;
mod layouts;
mod norms;
mod softmax_ce;

use super::rms_norm::Rounding;
use super::{
    cross_entropy, fused_add_rms_norm, gated, layer_norm, norm_backward_config, reduce_parts, rms_norm, rotary, softmax,
};
use crate::cpu::{bf16, f16, Acc, Element, Par, RowLayout};
use crate::cuda::emu::{unavailable, Buf, Emu};
use crate::cuda::{CudaElement, NormKeep, Target};
use proptest::prelude::*;

/// The CUDA element types, with the tolerance of `close` for each and their
/// unit roundoff (half an ulp, relative) for `close_rounded`.
trait Dt: Element<Acc = f32> + CudaElement {
    const TOL: f64;
    const UNIT: f64;
}
impl Dt for f32 {
    const TOL: f64 = 2e-5;
    const UNIT: f64 = 1.0 / (1u64 << 24) as f64;
}
impl Dt for f16 {
    const TOL: f64 = 2e-3;
    const UNIT: f64 = 1.0 / (1u64 << 11) as f64;
}
impl Dt for bf16 {
    const TOL: f64 = 1.6e-2;
    const UNIT: f64 = 1.0 / (1u64 << 8) as f64;
}

fn skip(test: &str) -> bool {
    match unavailable() {
        Some(why) => {
            eprintln!("SKIPPED {test}: {why}");
            true
        }
        None => false,
    }
}

fn data<T: Element>(n: usize, seed: usize) -> Vec<T> {
    (0..n).map(|i| T::from_f64((((i + seed) * 7919 % 2001) as f64 - 1000.0) / 400.0)).collect()
}

/// The kernels' main input: [`data`], and for a special case (at least 5
/// rows of at least 8) row 0 all `-inf`, then a NaN, a `+inf` and a `-inf`
/// in rows 1 to 3, and row 4 masked: its first half `-inf` (so that some
/// threads see only `-inf` in a row that has finite values); from 6 rows,
/// row 5 is finite but spread by about 1e20, so that its variance and its
/// sum of squares overflow f32 (in f16, whose range ends at 65504, it is
/// `inf`s); from 8 rows, rows 6 and 7 are finite and far from 0 (see below).
fn input<T: Element>(c: Case) -> Vec<T> {
    let mut x = data::<T>(c.rows * c.cols, 0);
    if c.special {
        let inf = f64::INFINITY;
        x[..c.cols].fill(T::from_f64(-inf));
        for (row, col, v) in [(1, 3, f64::NAN), (2, 5, inf), (3, 7, -inf)] {
            x[row * c.cols + col] = T::from_f64(v);
        }
        x[4 * c.cols..][..c.cols / 2].fill(T::from_f64(-inf));
        if c.rows >= 6 {
            for (i, v) in x[5 * c.cols..][..c.cols].iter_mut().enumerate() {
                *v = T::from_f64(1e20 * (1.5 + ((i * 7919 % 2001) as f64 - 1000.0) / 1000.0));
            }
        }
        if c.rows >= 8 {
            // Row 6: its first 16 elements 40 above the rest, a poor shift
            // for layer_norm's moments (the CUDA backward's second pass);
            // row 7: all 64 above, a mean large against the spread.
            for (i, v) in x[6 * c.cols..][..c.cols].iter_mut().enumerate() {
                *v = T::from_f64(v.to_f64() + if i < 16 { 40.0 } else { 0.0 });
            }
            for v in &mut x[7 * c.cols..][..c.cols] {
                *v = T::from_f64(v.to_f64() + 64.0);
            }
        }
    }
    x
}

/// Element-wise `|got - want| <= tol (1 + |want|)`; where `want` is NaN or
/// infinite, `got` must be the same.
fn close<T: Element>(got: &[T], want: &[T], tol: f64, what: &str) {
    close_scaled(got, want, tol, |_| 0.0, what)
}

/// [`close`] with `scale(i)` added to `|want|` in element `i`'s tolerance.
fn close_scaled<T: Element>(got: &[T], want: &[T], tol: f64, scale: impl Fn(usize) -> f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let (a, b, s) = (a.to_f64(), b.to_f64(), scale(i));
        let ok = if b.is_finite() {
            (a - b).abs() <= tol * (1.0 + b.abs() + s)
        } else {
            a == b || (a.is_nan() && b.is_nan())
        };
        assert!(ok, "{what} {} at {i}: {a} vs {b} (scale {s})", T::NAME);
    }
}

/// Two roundings to `T` of f32 results that differ by at most `rel` of their
/// value and `abs` of their row's scale: `|got - want| <= (2.1 u + rel) |want|
/// + abs s` (u: `T::UNIT`, one ulp where the f32 values straddle a rounding
/// boundary; `s` the larger of the row's largest finite `|want|` and
/// `scale(row)`, the size of the terms it sums, for values that cancel); a
/// non-finite `want` as [`close`]. Far tighter than [`close`] on small
/// values, which it holds to `tol` absolute.
fn close_rounded<T: Dt>(
    got: &[T],
    want: &[T],
    cols: usize,
    (rel, abs): (f64, f64),
    scale: impl Fn(usize) -> f64,
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (r, (gr, wr)) in got.chunks(cols.max(1)).zip(want.chunks(cols.max(1))).enumerate() {
        let top = wr.iter().map(|v| v.to_f64().abs()).filter(|v| v.is_finite()).fold(scale(r), f64::max);
        for (j, (a, b)) in gr.iter().zip(wr).enumerate() {
            let (a, b) = (a.to_f64(), b.to_f64());
            let allowed = (2.1 * T::UNIT + rel) * b.abs() + abs * top;
            let ok = if b.is_finite() { (a - b).abs() <= allowed } else { a == b || (a.is_nan() && b.is_nan()) };
            assert!(ok, "{what} {} at [{r}, {j}]: {a} vs {b} (allowed {allowed:.3e}, the row's scale {top})", T::NAME);
        }
    }
}

/// [`close`] for a rotation, whose outputs can cancel far below its inputs
/// (`x1 cos - x2 sin`) while their rounding stays of the inputs' size: each
/// element's tolerance also scales with the largest finite input of its row
/// (`cols` elements of `x`, laid out as the outputs).
fn close_rotated<T: Element>(got: &[T], want: &[T], x: &[T], cols: usize, tol: f64, what: &str) {
    let scales: Vec<f64> = x
        .chunks(cols)
        .map(|row| row.iter().map(|v| v.to_f64().abs()).filter(|v| v.is_finite()).fold(0.0, f64::max))
        .collect();
    close_scaled(got, want, tol, |i| scales[i / cols], what)
}

fn bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// Runs `f` on an emulated GPU of `sm` SMs, with each block's threads in one
/// order and then the other; returns the outputs, which must be identical.
fn both<T: Element>(sm: u32, what: &str, f: impl Fn(&dyn Target) -> Vec<Vec<T>>) -> Vec<Vec<T>> {
    orders(NormKeep::Reload, sm, what, f)
}

/// `f` on `sm` SMs with the threads of each block in both orders, as
/// [`both`], the norms' backward kernels keeping rows as `keep` says.
fn orders<T: Element>(keep: NormKeep, sm: u32, what: &str, f: impl Fn(&dyn Target) -> Vec<Vec<T>>) -> Vec<Vec<T>> {
    let a = f(&Emu { norm_keep: keep, ..Emu::new(sm) });
    let b = f(&Emu { reverse: true, norm_keep: keep, ..Emu::new(sm) });
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(bits(x), bits(y), "{what} {}: depends on the order of threads between barriers", T::NAME);
    }
    a
}

/// Where a norm's backward (over `rows` rows of `cols`) writes its sums over
/// rows, for [`both_kernels`]: the outputs that hold them (`at`), and their
/// tolerance against the default kernels' sums (`tol`).
struct Sums<'a> {
    at: &'a [usize],
    tol: f64,
    rows: usize,
    cols: usize,
}

/// [`both`], and again with each of the norms' held backward kernels
/// (`*_bwd2h_*`, `*_bwd2s_*`, which a GPU run picks with `KEEL_NORM_BWD`):
/// the same bits as the default ones, except for the sums over rows (`sums`)
/// where a held launch cuts the rows into fewer parts (`bwd2h`: two blocks an
/// SM, not three), which sums them in another order: those within `sums.tol`
/// of the default's.
fn both_kernels<T: Element>(sm: u32, what: &str, sums: Sums, f: impl Fn(&dyn Target) -> Vec<Vec<T>>) -> Vec<Vec<T>> {
    let a = orders(NormKeep::Reload, sm, what, &f);
    let parts = |keep| norm_backward_config(sm, sums.rows, sums.cols, std::mem::size_of::<T>(), keep).1;
    for keep in [NormKeep::Held, NormKeep::HeldShared] {
        let h = orders(keep, sm, what, &f);
        let same_parts = parts(NormKeep::Reload) == parts(keep);
        for (i, (x, y)) in a.iter().zip(&h).enumerate() {
            if sums.at.contains(&i) && !same_parts {
                close(y, x, sums.tol, &format!("{what}: output {i} of the {keep:?} backward kernels"));
                continue;
            }
            let at = bits(x).iter().zip(bits(y)).position(|(p, q)| *p != q);
            assert!(at.is_none(), "{what} {}: output {i} of the {keep:?} backward kernels differs at {at:?}", T::NAME);
        }
    }
    a
}

/// An output or scratch buffer of `n` elements, `shift` past a 16-byte
/// boundary (f32 scratch, which callers allocate whole, is passed 0). It is
/// filled with NaN, not zeros: the torch operators allocate both with
/// `empty`, so a kernel must write every element it is meant to (0 for an
/// ignored row included) and never read scratch it has not written.
fn garbage<T: Element>(n: usize, shift: usize) -> Buf<T> {
    Buf::shifted(&vec![T::from_f64(f64::NAN); n], shift)
}

fn cpu<T: Element>(n: usize) -> Vec<T> {
    vec![T::default(); n]
}

/// One run: SMs, rows, width, the elements by which every buffer starts past
/// a 16-byte boundary, and whether the input holds infinities and NaN.
#[derive(Debug, Clone, Copy)]
struct Case {
    sm: u32,
    rows: usize,
    cols: usize,
    shift: usize,
    special: bool,
}

/// One element, odd widths (scalar loads), widths of whole 16-byte vectors,
/// rows that are not 16-byte aligned (scalar loads again), blocks of 32 to
/// 1024 threads, a row of more than four vectors per thread; then inputs
/// with infinities and NaN, on vector and scalar paths.
const SHAPES: [(usize, usize, usize, bool); 11] = [
    (1, 1, 0, false),
    (3, 34, 0, false),
    (37, 300, 0, false),
    (5, 4094, 0, false),
    (4, 4096, 0, false),
    (4, 4096, 1, false),
    (2, 8200, 0, false),
    (1, 20000, 0, false),
    (8, 64, 0, true),
    (8, 38, 0, true),
    (6, 26, 0, true),
];

fn each_case(f: impl Fn(Case)) {
    for sm in [1, 132] {
        for (rows, cols, shift, special) in SHAPES {
            f(Case { sm, rows, cols, shift, special });
        }
    }
}

/// The ops, in three groups so that the tests of each run in parallel.
#[derive(Debug, Clone, Copy)]
enum Family {
    Norms,
    SoftmaxAndCrossEntropy,
    GatedAndRotary,
}

fn run<T: Dt>(family: Family, c: Case) {
    match family {
        Family::Norms => norms::case::<T>(c),
        Family::SoftmaxAndCrossEntropy => softmax_ce::case::<T>(c),
        Family::GatedAndRotary => gated_rotary::case::<T>(c),
    }
}

/// `family` on every case in every dtype, unless the emulation cannot run here.
fn every_case(test: &str, family: Family) {
    if skip(test) {
        return;
    }
    each_case(|c| {
        run::<f32>(family, c);
        run::<f16>(family, c);
        run::<bf16>(family, c);
    });
}

#[test]
fn emulated_norms_match_cpu() {
    every_case("emulated_norms_match_cpu", Family::Norms);
}

#[test]
fn emulated_softmax_and_cross_entropy_match_cpu() {
    every_case("emulated_softmax_and_cross_entropy_match_cpu", Family::SoftmaxAndCrossEntropy);
}

#[test]
fn emulated_gated_and_rotary_match_cpu() {
    every_case("emulated_gated_and_rotary_match_cpu", Family::GatedAndRotary);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random small shapes, alignments and SM counts, every op family in a
    /// dtype picked by the case (the fixed cases above cover every dtype).
    #[test]
    fn emulated_kernels_match_cpu_on_random_shapes(
        rows in 0usize..7,
        cols in 1usize..300,
        shift in 0usize..3,
        sm in 1u32..5,
        dtype in 0usize..3,
        special: bool,
    ) {
        if unavailable().is_some() {
            return Ok(());
        }
        let c = Case { sm, rows, cols, shift, special: special && rows >= 5 && cols >= 8 };
        for family in [Family::Norms, Family::SoftmaxAndCrossEntropy, Family::GatedAndRotary] {
            match dtype {
                0 => run::<f32>(family, c),
                1 => run::<f16>(family, c),
                _ => run::<bf16>(family, c),
            }
        }
    }
}
