//! Layouts the kernels read element by element or with fewer lanes (rows
//! of no elements, unaligned or padded rows, short rows' teams): the same
//! bits as the vector paths, and nothing launched for no work.
use super::*;

/// Rows of no elements, strided or not, are no work and no error: the CUDA
/// entry points launch nothing (null pointers would fault if they did).
#[test]
fn emulated_rms_norm_of_zero_width_rows_is_a_no_op() {
    if skip("emulated_rms_norm_of_zero_width_rows_is_a_no_op") {
        return;
    }
    let t = Emu::new(1);
    for layout in [RowLayout::contiguous(6, 0), RowLayout::new(&[3, 2], &[2, 1]).unwrap()] {
        unsafe { rms_norm::forward_on(&t, f32::DTYPE, 0, layout, 0, 0, 0, 1e-6, Rounding::Once) }.unwrap();
        unsafe { rms_norm::backward_add_on(&t, f32::DTYPE, 0, 0, 0, 0, 0, 0, 0, layout, 0, 1e-6) }.unwrap();
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
            rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), cols, 1e-6, Rounding::Once).unwrap();
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
            let once = Rounding::Once;
            fused_add_rms_norm::forward_on(&t, dt, x, r, w, fy.addr(), fs.addr(), rows, cols, 1e-6, once).unwrap();
            fused_add_rms_norm::forward_inplace_on(&t, dt, fx.addr(), fr.addr(), w, rows, cols, 1e-6, once).unwrap();
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
        unsafe { rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), cols, 1e-6, Rounding::Once) }
            .unwrap();
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
        unsafe { rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), wide, 1e-6, Rounding::Once) }
            .unwrap();
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
            unsafe { rms_norm::forward_on(&t, dt, xd.addr(), layout, wd.addr(), y.addr(), cols, 1e-6, Rounding::Once) }
                .unwrap();
            bits(&y.to_vec())
        };
        let together = fwd(&x, rows);
        let alone: Vec<_> = x.chunks(cols).flat_map(|row| fwd(row, 1)).collect();
        assert_eq!(together, alone, "rms_norm {} of {rows}x{cols}: a team's bits differ from a warp's", T::NAME);
    }
}
