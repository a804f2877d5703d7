//! softmax and cross_entropy (class indices and probabilities): each case
//! against the CPU kernels, and the loss's precision on shifted logits.
use super::*;

/// How far the CUDA and CPU kernels' f32 cross-entropy gradients may differ:
/// of each value, the lse's rounding (2^-24 |lse|, up to 4e-6 of each
/// probability at |lse| = 64, past which the backward recomputes it) and
/// `__expf`'s error (about 1e-6 on a GPU, for 16-bit logits); of the row's
/// terms (`ce_scale`), f32's rounding where they cancel (the target's `p - 1`).
const CE_GRAD_ERR: (f64, f64) = (8e-6, 1e-6);

/// The size of the terms of row `r`'s cross-entropy gradient: its loss's
/// gradient (`grad`, one a row or one for all) times the largest class weight
/// (1 without) and the target's sum (1 for class indices).
fn ce_scale<G: Element>(grad: &[G], r: usize, wmax: f64, target_sum: f64) -> f64 {
    grad[if grad.len() > 1 { r } else { 0 }].to_f64().abs() * wmax.max(1.0) * target_sum.max(1.0)
}

fn largest<T: Element>(v: Option<&[T]>) -> f64 {
    v.map_or(1.0, |v| v.iter().map(|x| x.to_f64().abs()).fold(0.0, f64::max))
}

pub(super) fn case<T: Dt>(c: Case) {
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
                let ok = a == b || (a - b).abs() <= 1e-5 * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
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
        let scale = |r| ce_scale(&grad, r, largest(w), 1.0);
        close_rounded(&got[2], &wdx, cols, CE_GRAD_ERR, scale, &format!("{what} grad"));
        close_rounded(&got[3], &wdx, cols, CE_GRAD_ERR, scale, &format!("{what} grad given the lse"));
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
    // read fails there, as a synchronising one would end a real capture), and
    // with the target checks off (set_cuda_target_checks(false); the emulated
    // read fails there too): the bad row's loss is NaN, so is the sum, and so
    // is its gradient.
    let mut ignored = bad.clone();
    ignored[rows - 1] = opts.ignore_index;
    let mut want = cpu(n);
    let one = [T::from_f64(1.0)];
    cross_entropy::backward_cpu(&one, &x, &ignored, Some(&weights), None, &mut want, cols, opts, Par::Seq).unwrap();
    let good = (rows - 1) * cols;
    for (t, how) in [
        (Emu { capturing: true, ..Emu::new(sm) }, "while capturing"),
        (Emu { checks_targets: false, ..Emu::new(sm) }, "with the target checks off"),
    ] {
        let (od, sd) = (z(1), garbage::<f32>(rows + 2, 0));
        unsafe {
            cross_entropy::forward_on(&t, dt, xd.addr(), td.addr(), pw, od.addr(), 0, sd.addr(), rows, cols, opts)
        }
        .unwrap_or_else(|e| panic!("no read back {how}: {e}"));
        assert!(od.to_vec()[0].to_f64().is_nan(), "the sum over a bad target {how}");
        let (dxd, sd) = (z(n), garbage::<f32>(rows + 2, 0));
        unsafe {
            let (g, x, tg, d, sc) = (gd.addr(), xd.addr(), td.addr(), dxd.addr(), sd.addr());
            cross_entropy::backward_on(&t, dt, g, x, tg, pw, 0, d, sc, rows, cols, opts)
        }
        .unwrap_or_else(|e| panic!("no read back {how}: {e}"));
        let dx = dxd.to_vec();
        assert!(dx[(rows - 1) * cols..].iter().all(|v| v.to_f64().is_nan()), "the bad row's gradient {how}");
        // The other rows' gradients are those with the bad row ignored.
        close(&dx[..good], &want[..good], 4.0 * tol, &format!("good rows' gradient {how}"));
    }
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
                let ok = a == b || (a - b).abs() <= 1e-5 * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
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
        let psum = |r: usize| probs[r * cols..][..cols].iter().map(|p| p.to_f64().abs()).sum::<f64>();
        let scale = |r| ce_scale(&grad, r, largest(w), psum(r));
        close_rounded(&grads[0], &wdx, cols, CE_GRAD_ERR, scale, &format!("{what} grad"));
        close_rounded(&grads[1], &wdx, cols, CE_GRAD_ERR, scale, &format!("{what} grad given the lse"));
    }
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

/// The CUDA forward's lse of a row of `-inf` only is `-inf`, as
/// `torch.logsumexp`'s and the CPU kernel's (`row_lse`), and its loss NaN;
/// the row beside it keeps its lse. Class indices with and without label
/// smoothing and class weights, and probabilities, f32 and bf16.
#[test]
fn emulated_cross_entropy_lse_of_a_row_of_neg_inf() {
    if skip("emulated_cross_entropy_lse_of_a_row_of_neg_inf") {
        return;
    }
    fn each<T: Dt>(t: &Emu) {
        let (rows, cols, dt) = (2, 5, T::DTYPE);
        let mut x = vec![T::from_f64(f64::NEG_INFINITY); rows * cols];
        x[cols..].iter_mut().enumerate().for_each(|(i, v)| *v = T::from_f64(i as f64 * 0.5));
        let want = (0..cols).map(|i| (i as f64 * 0.5).exp()).sum::<f64>().ln();
        let w: Vec<T> = (0..cols).map(|i| T::from_f64(0.5 + i as f64)).collect();
        let p: Vec<T> = vec![T::from_f64(0.2); rows * cols];
        let (xd, td, wd, pd) =
            (Buf::shifted(&x, 0), Buf::shifted(&[1i64, 2], 0), Buf::shifted(&w, 0), Buf::shifted(&p, 0));
        let check = |out: Vec<T>, lse: Vec<f32>, what: &str| {
            assert_eq!(lse[0], f32::NEG_INFINITY, "{what}: lse {lse:?}");
            assert!((f64::from(lse[1]) - want).abs() < 1e-5, "{what}: lse {lse:?} vs {want}");
            assert!(out[0].to_f64().is_nan() && out[1].to_f64().is_finite(), "{what}: losses");
        };
        let none = cross_entropy::Reduction::None;
        for (ls, weight) in [(0.0, 0), (0.1, 0), (0.1, wd.addr())] {
            let opts = cross_entropy::Options { ignore_index: -100, label_smoothing: ls, reduction: none };
            let (od, ld, sd) =
                (garbage::<T>(rows, 0), garbage::<f32>(rows, 0), garbage::<f32>(cross_entropy::scratch_len(rows), 0));
            let (px, pt, po, pl, ps) = (xd.addr(), td.addr(), od.addr(), ld.addr(), sd.addr());
            unsafe { cross_entropy::forward_on(t, dt, px, pt, weight, po, pl, ps, rows, cols, opts) }.unwrap();
            check(od.to_vec(), ld.to_vec(), &format!("{dt:?} ls {ls} weighted {}", weight != 0));
        }
        let (od, ld, sd) =
            (garbage::<T>(rows, 0), garbage::<f32>(rows, 0), garbage::<f32>(cross_entropy::scratch_len(rows), 0));
        let ptrs = (xd.addr(), pd.addr(), 0, od.addr(), ld.addr(), sd.addr());
        unsafe { cross_entropy::forward_probs_on(t, (dt, dt), ptrs, rows, cols, 0.0, none) }.unwrap();
        check(od.to_vec(), ld.to_vec(), &format!("{dt:?} probabilities"));
    }
    let t = Emu::new(2);
    each::<f32>(&t);
    each::<bf16>(&t);
}
