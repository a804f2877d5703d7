//! CUDA rms_norm against the CPU kernel (itself checked against the f64
//! reference), contiguous and strided. Skips, saying why, where no GPU is usable.
use keel::cpu::{bf16, f16, Element, Par, RowLayout};
use keel::cuda::{gpu, CudaElement};
use keel::ops::rms_norm::{self as op, Rounding};

mod common;

fn run<T: Element + CudaElement>(rows: usize, cols: usize, tol: f64) {
    let g = gpu(0).unwrap();
    let stream = g.new_stream().unwrap();
    let x: Vec<T> = (0..rows * cols).map(|i| T::from_f64(((i * 7919 % 2001) as f64 - 1000.0) / 400.0)).collect();
    let w: Vec<T> = (0..cols).map(|i| T::from_f64(0.5 + (i % 7) as f64 / 7.0)).collect();
    let dy: Vec<T> = (0..rows * cols).map(|i| T::from_f64(((i * 104729 % 1001) as f64 - 500.0) / 300.0)).collect();
    let (dx_d, dw_d, y_d) =
        (stream.clone_htod(&x).unwrap(), stream.clone_htod(&w).unwrap(), stream.clone_htod(&dy).unwrap());
    let mut out = stream.alloc_zeros::<T>(rows * cols).unwrap();
    op::forward_cuda(&stream, &dx_d, Some(&dw_d), &mut out, cols, 1e-6).unwrap();
    let mut gi = stream.alloc_zeros::<T>(rows * cols).unwrap();
    let mut gw = stream.alloc_zeros::<T>(cols).unwrap();
    op::backward_cuda(&stream, &y_d, &dx_d, Some(&dw_d), &mut gi, Some(&mut gw), cols, 1e-6).unwrap();
    let (got_y, got_gi, got_gw) =
        (stream.clone_dtoh(&out).unwrap(), stream.clone_dtoh(&gi).unwrap(), stream.clone_dtoh(&gw).unwrap());

    let mut want_y = vec![T::default(); rows * cols];
    op::forward_cpu(&x, Some(&w), &mut want_y, cols, 1e-6, Par::Seq).unwrap();
    let mut want_gi = vec![T::default(); rows * cols];
    let mut want_gw = vec![T::default(); cols];
    op::backward_cpu(&dy, &x, Some(&w), &mut want_gi, Some(&mut want_gw), cols, 1e-6, Par::Seq).unwrap();
    let close = |a: &[T], b: &[T], what: &str, scale: f64| {
        for (i, (a, b)) in a.iter().zip(b).enumerate() {
            let (a, b) = (a.to_f64(), b.to_f64());
            assert!(
                (a - b).abs() <= scale * tol * (1.0 + b.abs()),
                "{what} {} {rows}x{cols} at {i}: {a} vs {b}",
                T::NAME
            );
        }
    };
    close(&got_y, &want_y, "forward", 1.0);
    close(&got_gi, &want_gi, "grad_input", 4.0);
    close(&got_gw, &want_gw, "grad_weight", 4.0 * (rows as f64).sqrt());

    // Forward and backward on a strided x: q of a fused qkv viewed [rows, 2, cols]
    // (heads padded by 8: 16-byte vectors; by 1: none), and [2, rows, cols]
    // transposed; against the CPU's strided kernel on the same storage.
    for layout in [
        RowLayout::new(&[rows, 2], &[6 * (cols + 8), cols + 8]).unwrap(),
        RowLayout::new(&[rows, 2], &[6 * (cols + 1), cols + 1]).unwrap(),
        RowLayout::new(&[rows, 2], &[cols, rows * cols]).unwrap(),
    ] {
        let storage: Vec<T> =
            (0..layout.span(cols).unwrap()).map(|i| T::from_f64(((i * 7919 % 2001) as f64 - 1000.0) / 400.0)).collect();
        let n = layout.rows() * cols;
        let mut out = stream.alloc_zeros::<T>(n).unwrap();
        let sd = stream.clone_htod(&storage).unwrap();
        // Each rounding against the CPU kernel's same rounding.
        for rounding in [Rounding::Once, Rounding::BeforeWeight] {
            op::forward_strided_cuda(&stream, &sd, layout, Some(&dw_d), &mut out, cols, 1e-6, rounding).unwrap();
            let mut want = vec![T::default(); n];
            op::forward_strided_cpu(&storage, layout, Some(&w), &mut want, cols, 1e-6, rounding, Par::Seq).unwrap();
            close(&stream.clone_dtoh(&out).unwrap(), &want, &format!("forward {layout:?} {rounding:?}"), 1.0);
        }
        let g: Vec<T> = (0..n).map(|i| T::from_f64(((i * 104729 % 1001) as f64 - 500.0) / 300.0)).collect();
        let gd = stream.clone_htod(&g).unwrap();
        let (mut gi, mut gw) = (stream.alloc_zeros::<T>(n).unwrap(), stream.alloc_zeros::<T>(cols).unwrap());
        op::backward_strided_cuda(&stream, &gd, &sd, layout, Some(&dw_d), &mut gi, Some(&mut gw), cols, 1e-6).unwrap();
        let (mut want_gi, mut want_gw) = (vec![T::default(); n], vec![T::default(); cols]);
        let (x, ww) = (&storage[..], Some(&w[..]));
        op::backward_strided_cpu(&g, x, layout, ww, &mut want_gi, Some(&mut want_gw), cols, 1e-6, Par::Seq).unwrap();
        close(&stream.clone_dtoh(&gi).unwrap(), &want_gi, &format!("grad_input {layout:?}"), 4.0);
        let scale = 4.0 * (layout.rows() as f64).sqrt();
        close(&stream.clone_dtoh(&gw).unwrap(), &want_gw, &format!("grad_weight {layout:?}"), scale);
    }
}

#[test]
fn cuda_matches_cpu() {
    if common::skip_without_gpu("cuda_matches_cpu") {
        return;
    }
    // (1000, 256): whole 16-byte vectors with many rows a block (the held
    // backward kernels keep w's vectors across them; KEEL_NORM_BWD).
    for (rows, cols) in [(1, 7), (3, 33), (64, 4096), (5, 4095), (1000, 129), (1000, 256), (2, 8200)] {
        run::<f32>(rows, cols, 2e-5);
        run::<f16>(rows, cols, 2e-3);
        run::<bf16>(rows, cols, 1.6e-2);
    }
}
