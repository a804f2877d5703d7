//! The CUDA entry points (`*_on`: launch shapes, argument lists, launch
//! order, scratch) and the kernels' source, run on the CPU emulation of
//! `crate::cuda::emu`, against the CPU kernels (themselves checked against
//! f64 references). Each case runs with the threads of every block in both
//! orders between barriers, which must agree bit for bit, and on one SM and
//! on 132 (grid-stride loops with many rows per block, and one row per block).
//!
//! These do not run the PTX or touch a GPU; `tests/ops_cuda.rs` does that
//! where there is one.
use super::{
    cross_entropy, fused_add_rms_norm, gated, layer_norm, norm_backward_config, reduce_parts, rms_norm, rotary, softmax,
};
use crate::cpu::{bf16, f16, Acc, Element, Par, RowLayout};
use crate::cuda::emu::{unavailable, Buf, Emu};
use crate::cuda::{CudaElement, NormKeep, Target};
use proptest::prelude::*;

/// The CUDA element types, with the tolerance of `close` for each.
trait Dt: Element<Acc = f32> + CudaElement {
    const TOL: f64;
}
impl Dt for f32 {
    const TOL: f64 = 2e-5;
}
impl Dt for f16 {
    const TOL: f64 = 2e-3;
}
impl Dt for bf16 {
    const TOL: f64 = 1.6e-2;
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

fn norms<T: Dt>(c: Case) {
    let tol = T::TOL;
    let Case { sm, rows, cols, shift, .. } = c;
    let up = |v: &[T]| Buf::shifted(v, shift);
    let z = |n: usize| garbage::<T>(n, shift);
    let n = rows * cols;
    let (x, r, w, b, dy) = (input::<T>(c), data::<T>(n, 3), data::<T>(cols, 5), data::<T>(cols, 7), data::<T>(n, 11));
    let dt = T::DTYPE;
    let sum_tol = 4.0 * tol * (rows as f64).sqrt();
    let scratch = |t: &dyn Target| garbage::<f32>(reduce_parts(t.sm_count(), rows) * cols + 1, 0);

    // rms_norm, with and without weight
    for weighted in [true, false] {
        let what = format!("rms_norm weighted={weighted} {c:?}");
        let wt = weighted.then_some(&w[..]);
        let sums = Sums { at: &[2], tol: sum_tol, rows, cols };
        let got = both_kernels::<T>(sm, &what, sums, |t| {
            let (xd, wd, yd) = (up(&x), up(&w), z(n));
            let pw = if weighted { wd.addr() } else { 0 };
            let layout = RowLayout::contiguous(rows, cols);
            unsafe { rms_norm::forward_on(t, dt, xd.addr(), layout, pw, yd.addr(), cols, 1e-6) }.unwrap();
            let (dyd, dxd, dwd, s) = (up(&dy), z(n), z(cols), scratch(t));
            let pdw = if weighted { dwd.addr() } else { 0 };
            unsafe {
                rms_norm::backward_add_on(
                    t,
                    dt,
                    dyd.addr(),
                    0,
                    xd.addr(),
                    pw,
                    dxd.addr(),
                    pdw,
                    s.addr(),
                    RowLayout::contiguous(rows, cols),
                    cols,
                    1e-6,
                )
            }
            .unwrap();
            vec![yd.to_vec(), dxd.to_vec(), dwd.to_vec()]
        });
        let mut want = cpu(n);
        rms_norm::forward_cpu(&x, wt, &mut want, cols, 1e-6, Par::Seq).unwrap();
        close(&got[0], &want, tol, &what);
        let (mut wdx, mut wdw) = (cpu(n), cpu(cols));
        rms_norm::backward_cpu(&dy, &x, wt, &mut wdx, weighted.then_some(&mut wdw[..]), cols, 1e-6, Par::Seq).unwrap();
        close(&got[1], &wdx, 4.0 * tol, &format!("{what} grad_input"));
        if weighted {
            close(&got[2], &wdw, sum_tol, &format!("{what} grad_weight"));
        }
    }

    // rms_norm forward and backward reading a strided x, against the CPU's
    // strided kernels on the same storage: q of a fused qkv as
    // [rows, 2 heads, cols] (heads padded by 8, keeping 16-byte vectors, or by
    // 1, not), and a transposed [2, rows, cols] from [rows, 2, cols]. Each
    // layout has 2 x rows rows.
    let qkv = |pad: usize| {
        let h = cols + pad;
        RowLayout::new(&[rows, 2], &[3 * 2 * h, h]).unwrap()
    };
    let transposed = RowLayout::new(&[2, rows], &[cols, 2 * cols]).unwrap();
    for (layout_name, layout) in [("qkv pad 8", qkv(8)), ("qkv pad 1", qkv(1)), ("transposed", transposed)] {
        let what = format!("rms_norm {layout_name} {c:?}");
        let storage = data::<T>(layout.span(cols).unwrap(), 13);
        let m = layout.rows() * cols;
        let dy2 = data::<T>(m, 29);
        let sums = Sums { at: &[2], tol: 4.0 * tol * (m as f64 / cols as f64).sqrt(), rows: m / cols, cols };
        let got = both_kernels::<T>(sm, &what, sums, |t| {
            let (xd, wd, yd) = (up(&storage), up(&w), z(m));
            unsafe { rms_norm::forward_on(t, dt, xd.addr(), layout, wd.addr(), yd.addr(), cols, 1e-6) }.unwrap();
            let (dyd, dxd, dwd) = (up(&dy2), z(m), z(cols));
            let s = garbage::<f32>(reduce_parts(t.sm_count(), layout.rows()) * cols + 1, 0);
            let (px, pw) = (xd.addr(), wd.addr());
            unsafe {
                rms_norm::backward_add_on(
                    t,
                    dt,
                    dyd.addr(),
                    0,
                    px,
                    pw,
                    dxd.addr(),
                    dwd.addr(),
                    s.addr(),
                    layout,
                    cols,
                    1e-6,
                )
            }
            .unwrap();
            vec![yd.to_vec(), dxd.to_vec(), dwd.to_vec()]
        });
        let mut want = cpu(m);
        rms_norm::forward_strided_cpu(&storage, layout, Some(&w), &mut want, cols, 1e-6, Par::Seq).unwrap();
        close(&got[0], &want, tol, &what);
        let (mut wdx, mut wdw) = (cpu(m), cpu(cols));
        let (x, ww) = (&storage[..], Some(&w[..]));
        rms_norm::backward_strided_cpu(&dy2, x, layout, ww, &mut wdx, Some(&mut wdw), cols, 1e-6, Par::Seq).unwrap();
        close(&got[1], &wdx, 4.0 * tol, &format!("{what} grad_input"));
        close(&got[2], &wdw, 4.0 * tol * (layout.rows() as f64).sqrt(), &format!("{what} grad_weight"));
    }

    // layer_norm
    let what = format!("layer_norm {c:?}");
    let got = both_kernels::<T>(sm, &what, Sums { at: &[2, 3], tol: sum_tol, rows, cols }, |t| {
        let (xd, wd, bd, yd) = (up(&x), up(&w), up(&b), z(n));
        unsafe { layer_norm::forward_on(t, dt, xd.addr(), wd.addr(), bd.addr(), yd.addr(), rows, cols, 1e-5) }.unwrap();
        let (dyd, dxd, dwd, dbd) = (up(&dy), z(n), z(cols), z(cols));
        let (sw, sb) = (scratch(t), scratch(t));
        unsafe {
            layer_norm::backward_on(
                t,
                dt,
                dyd.addr(),
                xd.addr(),
                wd.addr(),
                dxd.addr(),
                dwd.addr(),
                dbd.addr(),
                sw.addr(),
                sb.addr(),
                rows,
                cols,
                1e-5,
            )
        }
        .unwrap();
        vec![yd.to_vec(), dxd.to_vec(), dwd.to_vec(), dbd.to_vec()]
    });
    let mut want = cpu(n);
    layer_norm::forward_cpu(&x, Some(&w), Some(&b), &mut want, cols, 1e-5, Par::Seq).unwrap();
    close(&got[0], &want, tol, &what);
    let (mut wdx, mut wdw, mut wdb) = (cpu(n), cpu(cols), cpu(cols));
    layer_norm::backward_cpu(
        &dy,
        &x,
        Some(&w),
        Some(&b),
        &mut wdx,
        Some(&mut wdw),
        Some(&mut wdb),
        cols,
        1e-5,
        Par::Seq,
    )
    .unwrap();
    close(&got[1], &wdx, 4.0 * tol, &format!("{what} grad_input"));
    close(&got[2], &wdw, sum_tol, &format!("{what} grad_weight"));
    close(&got[3], &wdb, sum_tol, &format!("{what} grad_bias"));

    // fused_add_rms_norm: forward, then its backward (rms_norm's with the addend)
    let what = format!("fused_add_rms_norm {c:?}");
    let got = both_kernels::<T>(sm, &what, Sums { at: &[3], tol: sum_tol, rows, cols }, |t| {
        let (xd, rd, wd, yd, sd) = (up(&x), up(&r), up(&w), z(n), z(n));
        unsafe {
            fused_add_rms_norm::forward_on(
                t,
                dt,
                xd.addr(),
                rd.addr(),
                wd.addr(),
                yd.addr(),
                sd.addr(),
                rows,
                cols,
                1e-6,
            )
        }
        .unwrap();
        let (dyd, dad, dxd, dwd, s) = (up(&dy), up(&r), z(n), z(cols), scratch(t));
        let (ps, pw) = (sd.addr(), wd.addr());
        unsafe {
            rms_norm::backward_add_on(
                t,
                dt,
                dyd.addr(),
                dad.addr(),
                ps,
                pw,
                dxd.addr(),
                dwd.addr(),
                s.addr(),
                RowLayout::contiguous(rows, cols),
                cols,
                1e-6,
            )
        }
        .unwrap();
        vec![yd.to_vec(), sd.to_vec(), dxd.to_vec(), dwd.to_vec()]
    });
    let (mut wy, mut ws) = (cpu(n), cpu(n));
    fused_add_rms_norm::forward_cpu(&x, &r, Some(&w), &mut wy, &mut ws, cols, 1e-6, Par::Seq).unwrap();
    close(&got[1], &ws, 0.0, &format!("{what} sum"));
    close(&got[0], &wy, tol, &what);
    let (mut wdx, mut wdw) = (cpu(n), cpu(cols));
    fused_add_rms_norm::backward_cpu(&dy, Some(&r), &ws, Some(&w), &mut wdx, Some(&mut wdw), cols, 1e-6, Par::Seq)
        .unwrap();
    close(&got[2], &wdx, 4.0 * tol, &format!("{what} grad"));
    close(&got[3], &wdw, sum_tol, &format!("{what} grad_weight"));

    // In place: x becomes the output and residual the sum, the bits of the
    // out-of-place kernel; with and without a weight.
    for weighted in [true, false] {
        let what = format!("fused_add_rms_norm_ {c:?} weight {weighted}");
        let out_of_place = both::<T>(sm, &what, |t| {
            let (xd, rd, wd, yd, sd) = (up(&x), up(&r), up(&w), z(n), z(n));
            let pw = if weighted { wd.addr() } else { 0 };
            let (px, pr, py, ps) = (xd.addr(), rd.addr(), yd.addr(), sd.addr());
            unsafe { fused_add_rms_norm::forward_on(t, dt, px, pr, pw, py, ps, rows, cols, 1e-6) }.unwrap();
            vec![yd.to_vec(), sd.to_vec()]
        });
        let in_place = both::<T>(sm, &what, |t| {
            let (xd, rd, wd) = (up(&x), up(&r), up(&w));
            let pw = if weighted { wd.addr() } else { 0 };
            let (px, pr) = (xd.addr(), rd.addr());
            unsafe { fused_add_rms_norm::forward_inplace_on(t, dt, px, pr, pw, rows, cols, 1e-6) }.unwrap();
            vec![xd.to_vec(), rd.to_vec()]
        });
        assert_eq!(bits(&in_place[0]), bits(&out_of_place[0]), "{what} {}: x (the output)", T::NAME);
        assert_eq!(bits(&in_place[1]), bits(&out_of_place[1]), "{what} {}: residual (the sum)", T::NAME);
    }
}

fn softmax_and_ce<T: Dt>(c: Case) {
    let tol = T::TOL;
    let Case { sm, rows, cols, shift, .. } = c;
    let up = |v: &[T]| Buf::shifted(v, shift);
    let z = |n: usize| garbage::<T>(n, shift);
    let n = rows * cols;
    let (x, dy) = (input::<T>(c), data::<T>(n, 11));
    let dt = T::DTYPE;

    let what = format!("softmax {c:?}");
    let got = both::<T>(sm, &what, |t| {
        let (xd, yd, dyd, dxd) = (up(&x), z(n), up(&dy), z(n));
        unsafe { softmax::run_on(t, "softmax", "fwd", dt, &[xd.addr(), yd.addr()], rows, cols, 0.7) }.unwrap();
        let ptrs = [dyd.addr(), yd.addr(), dxd.addr()];
        unsafe { softmax::run_on(t, "softmax_backward", "bwd", dt, &ptrs, rows, cols, 0.7) }.unwrap();
        vec![yd.to_vec(), dxd.to_vec()]
    });
    let mut want = cpu(n);
    softmax::forward_cpu(&x, &mut want, cols, 0.7, Par::Seq).unwrap();
    close(&got[0], &want, tol, &what);
    let mut wdx = cpu(n);
    softmax::backward_cpu(&dy, &got[0], &mut wdx, cols, 0.7, Par::Seq).unwrap();
    close(&got[1], &wdx, 4.0 * tol, &format!("{what} grad"));

    // cross_entropy: every third row ignored, label smoothing 0.1 (and 0 with
    // weights), each reduction, with and without class weights (in [0.25, 2));
    // and weights 0 at every target's class, whose mean is NaN (as torch's)
    // with label smoothing too, and so is each gradient of a row not ignored
    let target: Vec<i64> = (0..rows).map(|i| if i % 3 == 1 { -100 } else { ((i * 7919) % cols) as i64 }).collect();
    let weights: Vec<T> = data::<T>(cols, 23).iter().map(|v| T::from_f64(v.to_f64().abs() * 0.5 + 0.25)).collect();
    let mut unweighted_targets = weights.clone();
    target.iter().filter(|&&t| t >= 0).for_each(|&t| unweighted_targets[t as usize] = T::from_f64(0.0));
    let reductions = [cross_entropy::Reduction::None, cross_entropy::Reduction::Mean, cross_entropy::Reduction::Sum];
    let weighted = Some(&weights[..]);
    let mean = cross_entropy::Reduction::Mean;
    for (reduction, ls, w) in reductions
        .into_iter()
        .flat_map(|r| [(r, 0.1, None), (r, 0.1, weighted), (r, 0.0, weighted)])
        .chain([(mean, 0.1, Some(&unweighted_targets[..])), (mean, 0.0, Some(&unweighted_targets[..]))])
    {
        let opts = cross_entropy::Options { ignore_index: -100, label_smoothing: ls, reduction };
        let m = reduction.out_len(rows);
        let grad = data::<T>(m, 13);
        let what = format!("cross_entropy {reduction:?} ls {ls} weighted {} {c:?}", w.is_some());
        let mut want = cpu(m);
        let mut wlse = vec![T::Acc::ZERO; rows];
        cross_entropy::forward_cpu(&x, &target, w, &mut want, Some(&mut wlse), cols, opts, Par::Seq).unwrap();
        // Outputs: the loss, the lse (as T), then the gradient recomputing the
        // lse and the gradient given it.
        let got = both::<T>(sm, &what, |t| {
            let (xd, td, od) = (up(&x), Buf::shifted(&target, shift), z(m));
            let (sd, ld) = (garbage::<f32>(cross_entropy::scratch_len(rows), 0), garbage::<f32>(rows, 0));
            let wd = w.map(&up);
            let (px, pt, pw) = (xd.addr(), td.addr(), wd.as_ref().map_or(0, |w| w.addr()));
            let (po, pl, ps) = (od.addr(), ld.addr(), sd.addr());
            unsafe { cross_entropy::forward_on(t, dt, px, pt, pw, po, pl, ps, rows, cols, opts) }.unwrap();
            let lse = ld.to_vec();
            for (i, (a, b)) in lse.iter().zip(&wlse).enumerate() {
                let (a, b) = (f64::from(*a), f64::from(*b));
                let ok = (a - b).abs() <= 1e-5 * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
                assert!(ok, "{what} {} lse at row {i}: {a} vs {b}", T::NAME);
            }
            let mut grads = vec![];
            for l in [0, ld.addr()] {
                let (gd, dxd, sd) = (up(&grad), z(n), garbage::<f32>(cross_entropy::scratch_len(rows), 0));
                let (pg, pd, ps) = (gd.addr(), dxd.addr(), sd.addr());
                unsafe { cross_entropy::backward_on(t, dt, pg, px, pt, pw, l, pd, ps, rows, cols, opts) }.unwrap();
                grads.push(dxd.to_vec());
            }
            let lse = lse.iter().map(|v| T::from_f64(f64::from(*v))).collect();
            [vec![od.to_vec(), lse], grads].concat()
        });
        close(&got[0], &want, 4.0 * tol * (cols as f64).log2().max(1.0), &what);
        let mut wdx = cpu(n);
        cross_entropy::backward_cpu(&grad, &x, &target, w, None, &mut wdx, cols, opts, Par::Seq).unwrap();
        close(&got[2], &wdx, 4.0 * tol, &format!("{what} grad"));
        close(&got[3], &wdx, 4.0 * tol, &format!("{what} grad given the lse"));
    }

    // cross_entropy against probabilities (rows summing to about 1, some
    // zeros), of the logits' dtype and of each other of f32, f16 and bf16
    // (an f32 loss)
    let probs = |v: f64, i: usize| if i % 5 == 2 { 0.0 } else { (v.abs() + 0.1) * 1.6 / cols as f64 };
    let p64: Vec<f64> = data::<f64>(n, 17).iter().enumerate().map(|(i, v)| probs(*v, i)).collect();
    ce_probs::<T, T, T>(c, &x, &p64.iter().map(|v| T::from_f64(*v)).collect::<Vec<T>>(), &weights);
    if T::DTYPE != f32::DTYPE {
        // f32 weights: values bf16 cannot hold (the weights' own, scaled by 1 + 2^-10).
        let w32: Vec<f32> = weights.iter().map(|w| (w.to_f64() * (1.0 + 1.0 / 1024.0)) as f32).collect();
        ce_probs::<T, f32, f32>(c, &x, &p64.iter().map(|v| *v as f32).collect::<Vec<f32>>(), &w32);
    }
    if T::DTYPE != f16::DTYPE {
        let to = |v: &[f64]| v.iter().map(|v| f16::from_f64(*v)).collect::<Vec<_>>();
        let (p, w) = (to(&p64), to(&weights.iter().map(|w| w.to_f64()).collect::<Vec<_>>()));
        ce_probs::<T, f16, f32>(c, &x, &p, &w);
    }
    if T::DTYPE != bf16::DTYPE {
        let to = |v: &[f64]| v.iter().map(|v| bf16::from_f64(*v)).collect::<Vec<_>>();
        let (p, w) = (to(&p64), to(&weights.iter().map(|w| w.to_f64()).collect::<Vec<_>>()));
        ce_probs::<T, bf16, f32>(c, &x, &p, &w);
    }

    // a target out of range is an error, from the count the kernels leave
    // (with class weights, which no bad target may index)
    if rows == 0 {
        return;
    }
    let bad: Vec<i64> = (0..rows).map(|i| if i == rows - 1 { cols as i64 } else { 0 }).collect();
    let opts =
        cross_entropy::Options { ignore_index: -100, label_smoothing: 0.0, reduction: cross_entropy::Reduction::Sum };
    let t = Emu::new(sm);
    let (xd, td, od, sd) = (up(&x), Buf::shifted(&bad, shift), z(1), garbage::<f32>(rows + 2, 0));
    let wd = up(&weights);
    let pw = wd.addr();
    let err = unsafe {
        cross_entropy::forward_on(&t, dt, xd.addr(), td.addr(), pw, od.addr(), 0, sd.addr(), rows, cols, opts)
    }
    .unwrap_err();
    assert!(err.to_string().contains("argument 'target'"), "{err}");
    let (gd, dxd) = (Buf::shifted(&[T::from_f64(1.0)], shift), z(n));
    let err = unsafe {
        let (g, x, tg, d, sc) = (gd.addr(), xd.addr(), td.addr(), dxd.addr(), sd.addr());
        cross_entropy::backward_on(&t, dt, g, x, tg, pw, 0, d, sc, rows, cols, opts)
    }
    .unwrap_err();
    assert!(err.to_string().contains("argument 'target'"), "{err}");
    // Given the forward's lse, the backward reads nothing back: the forward that
    // wrote it checked the targets. A bad one (a broken promise) leaves NaN.
    let (ld, dxd) = (Buf::shifted(&vec![0f32; rows], 0), z(n));
    unsafe {
        let (g, x, tg) = (gd.addr(), xd.addr(), td.addr());
        cross_entropy::backward_on(&t, dt, g, x, tg, pw, ld.addr(), dxd.addr(), sd.addr(), rows, cols, opts)
    }
    .expect("no target check given the lse");
    assert!(dxd.to_vec()[(rows - 1) * cols..].iter().all(|v| v.to_f64().is_nan()), "the bad row's gradient");

    // ... except during graph capture, where nothing is read back (the emulated
    // read fails there, as a synchronising one would end a real capture): the
    // bad row's loss is NaN, so is the sum, and so is its gradient.
    let t = Emu { capturing: true, ..Emu::new(sm) };
    let (od, sd) = (z(1), garbage::<f32>(rows + 2, 0));
    unsafe { cross_entropy::forward_on(&t, dt, xd.addr(), td.addr(), pw, od.addr(), 0, sd.addr(), rows, cols, opts) }
        .expect("no read back while capturing");
    assert!(od.to_vec()[0].to_f64().is_nan(), "the sum over a bad target while capturing");
    let (dxd, sd) = (z(n), garbage::<f32>(rows + 2, 0));
    unsafe {
        let (g, x, tg, d, sc) = (gd.addr(), xd.addr(), td.addr(), dxd.addr(), sd.addr());
        cross_entropy::backward_on(&t, dt, g, x, tg, pw, 0, d, sc, rows, cols, opts)
    }
    .expect("no read back while capturing");
    let dx = dxd.to_vec();
    assert!(dx[(rows - 1) * cols..].iter().all(|v| v.to_f64().is_nan()), "the bad row's gradient while capturing");
    // The other rows' gradients are those with the bad row ignored.
    let mut ignored = bad.clone();
    ignored[rows - 1] = opts.ignore_index;
    let mut want = cpu(n);
    let one = [T::from_f64(1.0)];
    cross_entropy::backward_cpu(&one, &x, &ignored, Some(&weights), None, &mut want, cols, opts, Par::Seq).unwrap();
    let good = (rows - 1) * cols;
    close(&dx[..good], &want[..good], 4.0 * tol, "good rows' gradient while capturing");
}

/// cross_entropy against the probabilities `probs` (of the logits' dtype, or
/// another: the class weights of the target's dtype, the loss and its
/// gradient of `O`, f32 there), label smoothing 0.1, each reduction, with and
/// without class weights (`weights`, in [0.25, 2)), against the CPU kernels
/// given the same targets.
fn ce_probs<T: Dt, P: Dt, O: Dt>(c: Case, x: &[T], probs: &[P], weights: &[P]) {
    let Case { sm, rows, cols, shift, .. } = c;
    let up = |v: &[T]| Buf::shifted(v, shift);
    let (n, dt) = (rows * cols, (T::DTYPE, P::DTYPE));
    let reductions = [cross_entropy::Reduction::None, cross_entropy::Reduction::Mean, cross_entropy::Reduction::Sum];
    for (reduction, w) in reductions.into_iter().flat_map(|r| [(r, None), (r, Some(weights))]) {
        let m = reduction.out_len(rows);
        let grad = data::<O>(m, 19);
        let what = format!("cross_entropy probs ({}) {reduction:?} weighted {} {c:?}", P::NAME, w.is_some());
        let (mut want, mut wlse) = (cpu::<O>(m), vec![0f32; rows]);
        cross_entropy::forward_probs_cpu(x, probs, w, &mut want, Some(&mut wlse), cols, 0.1, reduction, Par::Seq)
            .unwrap();
        let (xd, pd) = (up(x), Buf::shifted(probs, shift));
        let wd = w.map(|w| Buf::shifted(w, shift));
        let (px, pp, pw) = (xd.addr(), pd.addr(), wd.as_ref().map_or(0, |w| w.addr()));
        let lse = garbage::<f32>(rows, 0);
        let got = both::<O>(sm, &what, |t| {
            let (sd, od) = (garbage::<f32>(cross_entropy::scratch_len(rows), 0), garbage::<O>(m, shift));
            let ptrs = (px, pp, pw, od.addr(), lse.addr(), sd.addr());
            unsafe { cross_entropy::forward_probs_on(t, dt, ptrs, rows, cols, 0.1, reduction) }.unwrap();
            for (i, (a, b)) in lse.to_vec().iter().zip(&wlse).enumerate() {
                let (a, b) = (f64::from(*a), f64::from(*b));
                let ok = (a - b).abs() <= 1e-5 * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
                assert!(ok, "{what} {} lse at row {i}: {a} vs {b}", T::NAME);
            }
            vec![od.to_vec()]
        });
        close(&got[0], &want, 4.0 * T::TOL * (cols as f64).log2().max(1.0), &what);
        let grads = both::<T>(sm, &what, |t| {
            let mut grads = vec![];
            for l in [0, lse.addr()] {
                let (gd, dxd) = (Buf::shifted(&grad, shift), garbage::<T>(n, shift));
                let ptrs = (gd.addr(), px, pp, pw, l, dxd.addr());
                unsafe { cross_entropy::backward_probs_on(t, dt, ptrs, rows, cols, 0.1, reduction) }.unwrap();
                grads.push(dxd.to_vec());
            }
            grads
        });
        let mut wdx = cpu(n);
        cross_entropy::backward_probs_cpu(&grad, x, probs, w, None, &mut wdx, cols, 0.1, reduction, Par::Seq).unwrap();
        close(&grads[0], &wdx, 4.0 * T::TOL, &format!("{what} grad"));
        close(&grads[1], &wdx, 4.0 * T::TOL, &format!("{what} grad given the lse"));
    }
}

fn gated_and_rotary<T: Dt>(c: Case) {
    let tol = T::TOL;
    let Case { sm, rows, cols, shift, .. } = c;
    let up = |v: &[T]| Buf::shifted(v, shift);
    let z = |n: usize| garbage::<T>(n, shift);
    let n = rows * cols;
    let (x, dy) = (input::<T>(c), data::<T>(n, 11));
    let dt = T::DTYPE;
    if !cols.is_multiple_of(2) {
        return;
    }
    // gated: input [rows, cols] is [a | b] with d = cols / 2
    let d = cols / 2;
    let dyh = &dy[..rows * d];
    for act in [gated::Activation::Silu, gated::Activation::Gelu, gated::Activation::GeluTanh] {
        let what = format!("{act:?} {c:?}");
        let got = both::<T>(sm, &what, |t| {
            let (xd, yd, gd, dxd) = (up(&x), z(rows * d), up(dyh), z(n));
            unsafe { gated::forward_on(t, act, dt, xd.addr(), yd.addr(), rows, d) }.unwrap();
            unsafe { gated::backward_on(t, act, dt, gd.addr(), xd.addr(), dxd.addr(), rows, d) }.unwrap();
            vec![yd.to_vec(), dxd.to_vec()]
        });
        let mut want = cpu(rows * d);
        gated::forward_cpu(act, &x, &mut want, d, Par::Seq).unwrap();
        close(&got[0], &want, tol, &what);
        let mut wdx = cpu(n);
        gated::backward_cpu(act, dyh, &x, &mut wdx, d, Par::Seq).unwrap();
        close(&got[1], &wdx, 2.0 * tol, &format!("{what} grad"));
    }

    // rotary: [batch, seq rows, heads, head_dim cols], all of a narrow head
    // rotated, 80 dims of a wide one; batch 1 and 1 head (the input with its
    // special values), then batch 2 and 3 heads (positions repeat per head).
    let half = if cols <= 256 { cols / 2 } else { 40 };
    let angles: Vec<f64> = (0..rows * half).map(|i| (i as f64 * 0.37).sin() * 3.0).collect();
    let cos: Vec<T> = angles.iter().map(|a| T::from_f64(a.cos())).collect();
    let sin: Vec<T> = angles.iter().map(|a| T::from_f64(a.sin())).collect();
    for (batch, heads) in [(1, 1), (2, 3)] {
        let shape = rotary::Shape { batch, seq: rows, heads, head_dim: cols, rotary_dim: 2 * half };
        let m = shape.numel();
        let x = if batch == 1 { x.clone() } else { data::<T>(m, 17) };
        for interleaved in [false, true] {
            for inverse in [false, true] {
                let what = format!("rotary {batch}x{heads} heads interleaved={interleaved} inverse={inverse} {c:?}");
                let got = both::<T>(sm, &what, |t| {
                    let (xd, cd, sd, yd) = (up(&x), up(&cos), up(&sin), z(m));
                    let (px, pc, ps) = (xd.addr(), cd.addr(), sd.addr());
                    let st = shape.contiguous();
                    unsafe { rotary::apply_on(t, dt, px, st, pc, ps, yd.addr(), shape, interleaved, inverse) }.unwrap();
                    vec![yd.to_vec()]
                });
                let mut want = cpu(m);
                rotary::apply_cpu(&x, &cos, &sin, &mut want, shape, interleaved, inverse, Par::Seq).unwrap();
                close_rotated(&got[0], &want, &x, cols, tol, &what);
            }
        }
    }

    // rotary reading a strided x in place, against the CPU kernel on a
    // contiguous copy: heads `pad` elements apart with a spare head per token
    // (q sliced from a wider projection; pad 8 keeps 16-byte vectors, 1 does
    // not), and [batch, heads, seq, head_dim] transposed to this layout.
    let (batch, heads) = (2, 3);
    let shape = rotary::Shape { batch, seq: rows, heads, head_dim: cols, rotary_dim: 2 * half };
    let padded = |pad: usize| {
        let h = cols + pad;
        rotary::Strides { batch: rows * (heads + 1) * h, seq: (heads + 1) * h, heads: h }
    };
    let transposed = rotary::Strides { batch: heads * rows * cols, seq: cols, heads: rows * cols };
    let layouts = [
        ("padded by 8", padded(8)),
        ("padded by 1", padded(1)),
        ("transposed", transposed),
        ("contiguous", shape.contiguous()),
    ];
    for (layout, st) in layouts {
        let buf = data::<T>(shape.span(st).unwrap(), 23);
        let mut xc = Vec::with_capacity(shape.numel());
        for (b, p, h) in (0..batch).flat_map(|b| (0..rows).flat_map(move |p| (0..heads).map(move |h| (b, p, h)))) {
            xc.extend_from_slice(&buf[b * st.batch + p * st.seq + h * st.heads..][..cols]);
        }
        for interleaved in [false, true] {
            let what = format!("rotary {layout} interleaved={interleaved} {c:?}");
            let got = both::<T>(sm, &what, |t| {
                let (xd, cd, sd, yd) = (up(&buf), up(&cos), up(&sin), z(shape.numel()));
                let (px, pc, ps) = (xd.addr(), cd.addr(), sd.addr());
                unsafe { rotary::apply_on(t, dt, px, st, pc, ps, yd.addr(), shape, interleaved, false) }.unwrap();
                vec![yd.to_vec()]
            });
            let mut want = cpu(shape.numel());
            rotary::apply_cpu(&xc, &cos, &sin, &mut want, shape, interleaved, false, Par::Seq).unwrap();
            close_rotated(&got[0], &want, &xc, cols, tol, &what);

            // In place: x's heads become the out-of-place kernel's rows, bit
            // for bit, and nothing else in the buffer changes.
            let what = format!("rotary in place {layout} interleaved={interleaved} {c:?}");
            let inplace = both::<T>(sm, &what, |t| {
                let (xd, cd, sd) = (up(&buf), up(&cos), up(&sin));
                let (px, pc, ps) = (xd.addr(), cd.addr(), sd.addr());
                unsafe { rotary::apply_inplace_on(t, dt, px, st, pc, ps, shape, interleaved, false) }.unwrap();
                vec![xd.to_vec()]
            });
            let mut expect = buf.clone();
            let mut rows_of_got = got[0].chunks_exact(cols);
            for (b, p, h) in (0..batch).flat_map(|b| (0..rows).flat_map(move |p| (0..heads).map(move |h| (b, p, h)))) {
                let row = rows_of_got.next().expect("one output row per head");
                expect[b * st.batch + p * st.seq + h * st.heads..][..cols].copy_from_slice(row);
            }
            assert_eq!(bits(&inplace[0]), bits(&expect), "{what} {}", T::NAME);
        }
    }
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
        Family::Norms => norms::<T>(c),
        Family::SoftmaxAndCrossEntropy => softmax_and_ce::<T>(c),
        Family::GatedAndRotary => gated_and_rotary::<T>(c),
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

/// Rows of no elements, strided or not, are no work and no error: the CUDA
/// entry points launch nothing (null pointers would fault if they did).
#[test]
fn emulated_rms_norm_of_zero_width_rows_is_a_no_op() {
    if skip("emulated_rms_norm_of_zero_width_rows_is_a_no_op") {
        return;
    }
    let t = Emu::new(1);
    for layout in [RowLayout::contiguous(6, 0), RowLayout::new(&[3, 2], &[2, 1]).unwrap()] {
        unsafe { rms_norm::forward_on(&t, f32::DTYPE, 0, layout, 0, 0, 0, 1e-6) }.unwrap();
        unsafe { rms_norm::backward_add_on(&t, f32::DTYPE, 0, 0, 0, 0, 0, 0, 0, layout, 0, 1e-6) }.unwrap();
    }
}

#[test]
fn emulated_norms_match_cpu() {
    every_case("emulated_norms_match_cpu", Family::Norms);
}

#[test]
fn emulated_softmax_and_cross_entropy_match_cpu() {
    every_case("emulated_softmax_and_cross_entropy_match_cpu", Family::SoftmaxAndCrossEntropy);
}

/// The CUDA forward's loss of f32 rows far from 0 keeps the precision of the
/// loss, not of the offset (its sums are of `x - x[0]`; `lse - x` summed
/// from `W lse - sum(w x)` lost 1e-5 of the loss near 1000): class indices
/// with label smoothing, with and without class weights, and probabilities,
/// each row against the f64 reference, relative to its loss. Widths of 2003
/// (element by element) and 2048 (vectors); a row whose first logit is
/// `-inf` (masked) shifts by 0 instead, and its loss is infinite (not NaN).
#[test]
fn emulated_cross_entropy_of_shifted_logits_keeps_the_losss_precision() {
    if skip("emulated_cross_entropy_of_shifted_logits_keeps_the_losss_precision") {
        return;
    }
    use crate::cpu::cross_entropy::forward_ref;
    use crate::cpu::cross_entropy_probs::forward_ref as probs_ref;
    let (t, rows, dt) = (Emu::new(2), 3, f32::DTYPE);
    let none = cross_entropy::Reduction::None;
    let opts = cross_entropy::Options { ignore_index: -100, label_smoothing: 0.1, reduction: none };
    for cols in [2003, 2048] {
        let noise = |i: usize| ((i * 7919 % 4001) as f64 - 2000.0) / 500.0;
        let w: Vec<f32> = (0..cols).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let mut p: Vec<f32> = (0..rows * cols).map(|i| (i * 104_729 % 1009) as f32).collect();
        for row in p.chunks_mut(cols) {
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= s);
        }
        let target = [3i64, 500, 1000];
        for off in [0.0, -1e2, 1e3, 1e4] {
            let mut x: Vec<f32> = (0..rows * cols).map(|i| (off + noise(i)) as f32).collect();
            x[2 * cols] = f32::NEG_INFINITY; // row 2: masked first logit
            let check = |got: Vec<f32>, want: Vec<f64>, what: &str| {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    // Row 2's -inf enters the smoothing term: an infinite loss, as torch's.
                    let err =
                        if w.is_infinite() && f64::from(*g) == *w { 0.0 } else { (f64::from(*g) - w).abs() / w.abs() };
                    assert!(err <= 3e-7, "{what} offset {off} cols {cols} row {i}: {g} vs {w} ({err:.1e})");
                }
            };
            let (xd, td, pd, wd) =
                (Buf::shifted(&x, 0), Buf::shifted(&target, 0), Buf::shifted(&p, 0), Buf::shifted(&w, 0));
            for weight in [None, Some(&wd)] {
                let (od, sd) = (garbage::<f32>(rows, 0), garbage::<f32>(cross_entropy::scratch_len(rows), 0));
                let pw = weight.map_or(0, |w| w.addr());
                let (px, pt, po, ps) = (xd.addr(), td.addr(), od.addr(), sd.addr());
                unsafe { cross_entropy::forward_on(&t, dt, px, pt, pw, po, 0, ps, rows, cols, opts) }.unwrap();
                let want = forward_ref(&x, &target, weight.map(|_| &w[..]), cols, opts);
                check(od.to_vec(), want, &format!("class indices weighted {}", weight.is_some()));
                let (od, sd) = (garbage::<f32>(rows, 0), garbage::<f32>(cross_entropy::scratch_len(rows), 0));
                let ptrs = (px, pd.addr(), pw, od.addr(), 0, sd.addr());
                unsafe { cross_entropy::forward_probs_on(&t, (dt, dt), ptrs, rows, cols, 0.1, none) }.unwrap();
                let want = probs_ref(&x, &p, weight.map(|_| &w[..]), cols, 0.1, none);
                check(od.to_vec(), want, &format!("probabilities weighted {}", weight.is_some()));
            }
        }
    }
}

/// The CUDA layer_norm forward of f32 rows whose mean is large against their
/// spread keeps the precision of the normalised values, not of the mean: it
/// normalises as `((x - k) - m1) rstd` with `k` near the row's values (the
/// backward's and the CPU kernels' moments). `x - mean` with the mean
/// rounded to f32 erred by half an ulp of the mean times `rstd`: 3e-3 for a
/// mean of 1000 and a spread of 0.01 (found on an H200 by
/// `test_ops_differential.py`). Widths of 2 (two values in a block of 32
/// threads), 130 and 2003 (element by element), 2048 (held in registers) and
/// 16384 (vectors read twice, blocks of 1024 threads), each output against
/// the f64 reference.
#[test]
fn emulated_layer_norm_of_rows_far_from_0_keeps_the_outputs_precision() {
    if skip("emulated_layer_norm_of_rows_far_from_0_keeps_the_outputs_precision") {
        return;
    }
    use crate::cpu::layer_norm::forward_ref;
    let (t, rows, dt) = (Emu::new(2), 3, f32::DTYPE);
    for cols in [2, 130, 2003, 2048, 16384] {
        let noise = |i: usize| ((i * 7919 % 4001) as f64 - 2000.0) / 2000.0;
        let w: Vec<f32> = (0..cols).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let b: Vec<f32> = (0..cols).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
        for (off, spread) in [(0.0, 1.0), (-1e3, 1e-2), (1e3, 1.0), (1e4, 0.5), (-3e5, 64.0)] {
            let x: Vec<f32> = (0..rows * cols).map(|i| (off + spread * noise(i)) as f32).collect();
            let (xd, wd, bd) = (Buf::shifted(&x, 0), Buf::shifted(&w, 0), Buf::shifted(&b, 0));
            for (weighted, biased) in [(false, false), (true, true)] {
                let yd = garbage::<f32>(rows * cols, 0);
                let (pw, pb) = (if weighted { wd.addr() } else { 0 }, if biased { bd.addr() } else { 0 });
                unsafe { layer_norm::forward_on(&t, dt, xd.addr(), pw, pb, yd.addr(), rows, cols, 1e-5) }.unwrap();
                let want = forward_ref(&x, weighted.then_some(&w[..]), biased.then_some(&b[..]), cols, 1e-5);
                for (i, (g, w)) in yd.to_vec().iter().zip(&want).enumerate() {
                    // A few roundings of values of at most about 4.
                    let err = (f64::from(*g) - w).abs();
                    assert!(err <= 4e-6, "offset {off} spread {spread} cols {cols} at {i}: {g} vs {w} ({err:.1e})");
                }
            }
        }
    }
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

/// The norms and rotary on a row whose layout rules out 16-byte vectors (a
/// start off a 16-byte boundary, rows padded by one element) read it element by
/// element, each thread taking the columns the vector loops give it: the same
/// bits as the aligned, contiguous row; and so do the norms' held backward
/// kernels (layer_norm's second pass included). The emulation is built without FMA
/// contraction; `scripts/check-contraction.sh` checks that nvcc and ptxas
/// contract nothing in these kernels either, so the same holds on a GPU.
fn same_bits_without_vectors<T: Dt>() {
    let (rows, cols, sm) = (3, 256, 2);
    let n = rows * cols;
    let dt = T::DTYPE;
    let (mut x, w, b, dy) = (data::<T>(n, 0), data::<T>(cols, 5), data::<T>(cols, 7), data::<T>(n, 11));
    // The last row's first 16 elements 40 above the rest: layer_norm's
    // backward takes its second pass there (a poor shift; see `input`).
    for v in &mut x[(rows - 1) * cols..][..16] {
        *v = T::from_f64(v.to_f64() + 40.0);
    }
    let run = |shift: usize, keep: NormKeep| {
        let t = Emu { norm_keep: keep, ..Emu::new(sm) };
        let up = |v: &[T]| Buf::shifted(v, shift);
        let z = |n: usize| garbage::<T>(n, shift);
        let scratch = || garbage::<f32>(reduce_parts(sm, rows) * cols + 1, 0);
        let (xd, wd, bd, dyd) = (up(&x), up(&w), up(&b), up(&dy));
        let (y, dx, dw) = (z(n), z(n), z(cols));
        let layout = RowLayout::contiguous(rows, cols);
        let s = scratch();
        unsafe {
            rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), cols, 1e-6).unwrap();
            let (g, x, w) = (dyd.addr(), xd.addr(), wd.addr());
            rms_norm::backward_add_on(&t, dt, g, 0, x, w, dx.addr(), dw.addr(), s.addr(), layout, cols, 1e-6).unwrap();
        }
        let (ly, ldx, ldw, ldb, sw, sb) = (z(n), z(n), z(cols), z(cols), scratch(), scratch());
        unsafe {
            layer_norm::forward_on(&t, dt, xd.addr(), wd.addr(), bd.addr(), ly.addr(), rows, cols, 1e-5).unwrap();
            let (g, x, w) = (dyd.addr(), xd.addr(), wd.addr());
            let (gx, gw, gb) = (ldx.addr(), ldw.addr(), ldb.addr());
            layer_norm::backward_on(&t, dt, g, x, w, gx, gw, gb, sw.addr(), sb.addr(), rows, cols, 1e-5).unwrap();
        }
        let (fy, fs, fx, fr) = (z(n), z(n), up(&x), up(&dy));
        unsafe {
            let (x, r, w) = (xd.addr(), dyd.addr(), wd.addr());
            fused_add_rms_norm::forward_on(&t, dt, x, r, w, fy.addr(), fs.addr(), rows, cols, 1e-6).unwrap();
            fused_add_rms_norm::forward_inplace_on(&t, dt, fx.addr(), fr.addr(), w, rows, cols, 1e-6).unwrap();
        }
        // rotary: rows * 2 tokens of 2 heads of 64, each head rotated whole.
        let shape = rotary::Shape { batch: 1, seq: rows * 2, heads: 2, head_dim: 64, rotary_dim: 64 };
        let (cs, sn) = (up(&w[..rows * 2 * 32]), up(&b[..rows * 2 * 32]));
        let rot = [false, true].map(|interleaved| {
            let ry = z(n);
            let st = shape.contiguous();
            let (c, s) = (cs.addr(), sn.addr());
            unsafe { rotary::apply_on(&t, dt, xd.addr(), st, c, s, ry.addr(), shape, interleaved, false) }.unwrap();
            ry
        });
        let [neox, gptj] = rot;
        [y, dx, dw, fy, fs, fx, fr, neox, gptj, ly, ldx, ldw, ldb].map(|b| bits(&b.to_vec()))
    };
    let (aligned, shifted) = (run(0, NormKeep::Reload), run(1, NormKeep::Reload));
    let held = [NormKeep::Held, NormKeep::HeldShared].map(|keep| run(0, keep));
    let names = [
        "rms_norm",
        "rms_norm grad_input",
        "rms_norm grad_weight",
        "fused_add_rms_norm",
        "fused_add_rms_norm sum",
        "fused_add_rms_norm_ (in place) input",
        "fused_add_rms_norm_ (in place) residual",
        "rotary_embedding",
        "rotary_embedding interleaved",
        "layer_norm",
    ];
    for (i, (a, s)) in aligned.iter().zip(&shifted).enumerate() {
        let name = names.get(i).copied().unwrap_or("layer_norm gradients");
        assert_eq!(a, s, "{name} {}: bits depend on the alignment", T::NAME);
        for (keep, h) in [NormKeep::Held, NormKeep::HeldShared].iter().zip(&held) {
            assert_eq!(a, &h[i], "{name} {}: the {keep:?} backward kernels give other bits", T::NAME);
        }
    }
    // A view with rows padded by one element against the same rows contiguous.
    let padded = RowLayout::new(&[rows], &[cols + 1]).unwrap();
    let storage = data::<T>(padded.span(cols).unwrap(), 13);
    let packed: Vec<T> = (0..rows).flat_map(|r| storage[r * (cols + 1)..][..cols].to_vec()).collect();
    let t = Emu::new(sm);
    let fwd = |v: &[T], layout: RowLayout| {
        let (xd, wd, y) = (Buf::shifted(v, 0), Buf::shifted(&w, 0), garbage::<T>(n, 0));
        unsafe { rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), cols, 1e-6) }.unwrap();
        bits(&y.to_vec())
    };
    let want = fwd(&packed, RowLayout::contiguous(rows, cols));
    assert_eq!(fwd(&storage, padded), want, "rms_norm {} of rows padded by one: bits differ", T::NAME);
    // Rows that rows_config gives a block, not a warp (the rows above take
    // the warp-rows forward): the block forward's vectors against its
    // element-wise loop.
    let wide = 2048;
    let (xw, ww) = (data::<T>(rows * wide, 17), data::<T>(wide, 19));
    let fwd_wide = |shift: usize| {
        let (xd, wd, y) = (Buf::shifted(&xw, shift), Buf::shifted(&ww, shift), garbage::<T>(rows * wide, shift));
        let layout = RowLayout::contiguous(rows, wide);
        unsafe { rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), wide, 1e-6) }.unwrap();
        bits(&y.to_vec())
    };
    assert_eq!(fwd_wide(0), fwd_wide(1), "rms_norm {} of {wide}-wide rows: bits depend on the alignment", T::NAME);
}

#[test]
fn emulated_norms_and_rotary_give_the_same_bits_without_vectors() {
    if skip("emulated_norms_and_rotary_give_the_same_bits_without_vectors") {
        return;
    }
    same_bits_without_vectors::<f32>();
    same_bits_without_vectors::<f16>();
    same_bits_without_vectors::<bf16>();
}

/// The warp-rows forward reads a short row with a team of fewer than 32 lanes
/// (`row_team`) and sums it within the team: the same bits as the block
/// forward, which reads a lone row (forward_config gives it one warp) with
/// all 32 lanes. Widths of 3, 10, 16 and 32 vectors, and 5 rows (a warp's
/// last team past the end), each row against itself alone.
#[test]
fn emulated_rms_norm_teams_give_the_bits_of_a_warp() {
    if skip("emulated_rms_norm_teams_give_the_bits_of_a_warp") {
        return;
    }
    teams_give_the_bits_of_a_warp::<f32>();
    teams_give_the_bits_of_a_warp::<f16>();
    teams_give_the_bits_of_a_warp::<bf16>();
}

fn teams_give_the_bits_of_a_warp<T: Dt>() {
    let (rows, dt, t) = (5, T::DTYPE, Emu::new(2));
    let per_vec = 16 / std::mem::size_of::<T>();
    for cols in [3 * per_vec, 10 * per_vec, 16 * per_vec, 32 * per_vec, 10 * per_vec + 1] {
        let (x, w) = (data::<T>(rows * cols, 23), data::<T>(cols, 29));
        let wd = Buf::shifted(&w, 0);
        let fwd = |x: &[T], rows: usize| {
            let (xd, y) = (Buf::shifted(x, 0), garbage::<T>(rows * cols, 0));
            let layout = RowLayout::contiguous(rows, cols);
            unsafe { rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), cols, 1e-6) }.unwrap();
            bits(&y.to_vec())
        };
        let together = fwd(&x, rows);
        let alone: Vec<_> = x.chunks(cols).flat_map(|row| fwd(row, 1)).collect();
        assert_eq!(together, alone, "rms_norm {} of {rows}x{cols}: a team's bits differ from a warp's", T::NAME);
    }
}
