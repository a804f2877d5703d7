//! rms_norm, layer_norm and fused_add_rms_norm: each case against the CPU
//! kernels, and layer_norm's precision on rows far from 0.
use super::*;

pub(super) fn case<T: Dt>(c: Case) {
    let tol = T::TOL;
    let Case { sm, rows, cols, shift, .. } = c;
    let up = |v: &[T]| Buf::shifted(v, shift);
    let z = |n: usize| garbage::<T>(n, shift);
    let n = rows * cols;
    let (x, r, w, b, dy) = (input::<T>(c), data::<T>(n, 3), data::<T>(cols, 5), data::<T>(cols, 7), data::<T>(n, 11));
    let dt = T::DTYPE;
    let sum_tol = 4.0 * tol * (rows as f64).sqrt();
    let scratch = |t: &dyn Target| garbage::<f32>(reduce_parts(t.sm_count(), rows) * cols + 1, 0);

    // rms_norm, with and without weight, and with the weight rounding both ways
    let cases = [(true, Rounding::Once), (true, Rounding::BeforeWeight), (false, Rounding::Once)];
    for (weighted, rounding) in cases {
        let what = format!("rms_norm weighted={weighted} {rounding:?} {c:?}");
        let wt = weighted.then_some(&w[..]);
        let sums = Sums { at: &[2], tol: sum_tol, rows, cols };
        let got = both_kernels::<T>(sm, &what, sums, |t| {
            let (xd, wd, yd) = (up(&x), up(&w), z(n));
            let pw = if weighted { wd.addr() } else { 0 };
            let layout = RowLayout::contiguous(rows, cols);
            unsafe { rms_norm::forward_on(t, dt, xd.addr(), layout, pw, yd.addr(), cols, 1e-6, rounding) }.unwrap();
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
        let cpu_fwd = |rounding| {
            let mut want = cpu(n);
            let layout = RowLayout::contiguous(rows, cols);
            rms_norm::forward_strided_cpu(&x, layout, wt, &mut want, cols, 1e-6, rounding, Par::Seq).unwrap();
            want
        };
        let want = cpu_fwd(rounding);
        close(&got[0], &want, tol, &what);
        if weighted {
            nearer(&got[0], &want, &cpu_fwd(other(rounding)), &what);
        }
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
            let once = Rounding::Once;
            unsafe { rms_norm::forward_on(t, dt, xd.addr(), layout, wd.addr(), yd.addr(), cols, 1e-6, once) }.unwrap();
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
        let once = Rounding::Once;
        rms_norm::forward_strided_cpu(&storage, layout, Some(&w), &mut want, cols, 1e-6, once, Par::Seq).unwrap();
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
                Rounding::Once,
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
    fused_add_rms_norm::forward_cpu(&x, &r, Some(&w), &mut wy, &mut ws, cols, 1e-6, Rounding::Once, Par::Seq).unwrap();
    close(&got[1], &ws, 0.0, &format!("{what} sum"));
    close(&got[0], &wy, tol, &what);
    let (mut wdx, mut wdw) = (cpu(n), cpu(cols));
    fused_add_rms_norm::backward_cpu(&dy, Some(&r), &ws, Some(&w), &mut wdx, Some(&mut wdw), cols, 1e-6, Par::Seq)
        .unwrap();
    close(&got[2], &wdx, 4.0 * tol, &format!("{what} grad"));
    close(&got[3], &wdw, sum_tol, &format!("{what} grad_weight"));

    // In place: x becomes the output and residual the sum, the bits of the
    // out-of-place kernel; with and without a weight, rounded once and
    // before the weight (against the CPU's same rounding).
    for (weighted, rounding) in [(true, Rounding::Once), (true, Rounding::BeforeWeight), (false, Rounding::Once)] {
        let what = format!("fused_add_rms_norm_ {c:?} weight {weighted} {rounding:?}");
        let out_of_place = both::<T>(sm, &what, |t| {
            let (xd, rd, wd, yd, sd) = (up(&x), up(&r), up(&w), z(n), z(n));
            let pw = if weighted { wd.addr() } else { 0 };
            let (px, pr, py, ps) = (xd.addr(), rd.addr(), yd.addr(), sd.addr());
            unsafe { fused_add_rms_norm::forward_on(t, dt, px, pr, pw, py, ps, rows, cols, 1e-6, rounding) }.unwrap();
            vec![yd.to_vec(), sd.to_vec()]
        });
        let in_place = both::<T>(sm, &what, |t| {
            let (xd, rd, wd) = (up(&x), up(&r), up(&w));
            let pw = if weighted { wd.addr() } else { 0 };
            let (px, pr) = (xd.addr(), rd.addr());
            unsafe { fused_add_rms_norm::forward_inplace_on(t, dt, px, pr, pw, rows, cols, 1e-6, rounding) }.unwrap();
            vec![xd.to_vec(), rd.to_vec()]
        });
        assert_eq!(bits(&in_place[0]), bits(&out_of_place[0]), "{what} {}: x (the output)", T::NAME);
        assert_eq!(bits(&in_place[1]), bits(&out_of_place[1]), "{what} {}: residual (the sum)", T::NAME);
        let wt = weighted.then_some(&w[..]);
        let cpu_fwd = |rounding| {
            let (mut wy, mut ws) = (cpu(n), cpu(n));
            fused_add_rms_norm::forward_cpu(&x, &r, wt, &mut wy, &mut ws, cols, 1e-6, rounding, Par::Seq).unwrap();
            wy
        };
        let want = cpu_fwd(rounding);
        close(&out_of_place[0], &want, tol, &what);
        if weighted {
            nearer(&out_of_place[0], &want, &cpu_fwd(other(rounding)), &what);
        }
    }
}

/// The rounding that `rounding` is not.
fn other(rounding: Rounding) -> Rounding {
    if rounding == Rounding::Once {
        Rounding::BeforeWeight
    } else {
        Rounding::Once
    }
}

/// `got` (a norm's output) is nearer `want`, the CPU's output rounded as
/// asked, than `other`, the CPU's rounded the other way, counted in values
/// that differ (NaN equal to NaN): one ulp is within the tolerance of
/// `close`, so that alone cannot tell the two roundings apart. Strictly
/// nearer where the two differ at all.
fn nearer<T: Element>(got: &[T], want: &[T], other: &[T], what: &str) {
    let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan());
    let differ = |a: &[T], b: &[T]| a.iter().zip(b).filter(|(a, b)| !same(a.to_f64(), b.to_f64())).count();
    let (near, far) = (differ(got, want), differ(got, other));
    assert!(near <= far, "{what}: {near} values differ from the CPU's rounding, {far} from the other");
    if differ(want, other) > 0 {
        assert!(near < far, "{what}: {near} values differ from the CPU's rounding, {far} from the other");
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
