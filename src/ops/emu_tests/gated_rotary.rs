//! The gated activations and rotary embedding: each case against the CPU kernels.
use super::*;

pub(super) fn case<T: Dt>(c: Case) {
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
