//! criterion: rms_norm, layer_norm and fused_add_rms_norm on CPU, forward and
//! backward, every dtype, on rayon's pool (and rms_norm forward sequential).
//! Throughput counts the bytes read and written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keel::cpu::{Element, Par, RowLayout};
use keel::ops::rms_norm::Rounding;
use keel::ops::{fused_add_rms_norm, layer_norm, rms_norm};
use std::hint::black_box;

mod common;
use common::{bytes, data, ROWS_HIDDEN};

fn bench<T: Element>(c: &mut Criterion) {
    let par = Par::Rayon;
    for (rows, cols) in ROWS_HIDDEN {
        let n = rows * cols;
        let id = format!("{rows}x{cols}");
        let (x, r, dy, w, b) =
            (data::<T>(n, 0), data::<T>(n, 1), data::<T>(n, 2), data::<T>(cols, 3), data::<T>(cols, 4));
        let (mut y, mut s, mut dx) = (vec![T::default(); n], vec![T::default(); n], vec![T::default(); n]);
        let (mut dw, mut db) = (vec![T::default(); cols], vec![T::default(); cols]);

        let mut g = c.benchmark_group(format!("rms_norm/{}", T::NAME));
        g.throughput(bytes::<T>(2 * n + cols));
        for (pname, p) in [("seq", Par::Seq), ("rayon", par)] {
            g.bench_function(BenchmarkId::new(format!("fwd/{pname}"), &id), |bn| {
                bn.iter(|| rms_norm::forward_cpu(black_box(&x), Some(&w), &mut y, cols, 1e-6, p).unwrap())
            });
        }
        // Hugging Face LlamaRMSNorm's rounding (x / rms rounded to T before the weight).
        let layout = RowLayout::contiguous(rows, cols);
        g.bench_function(BenchmarkId::new("fwd_before_weight/rayon", &id), |bn| {
            bn.iter(|| {
                let before = Rounding::BeforeWeight;
                rms_norm::forward_strided_cpu(black_box(&x), layout, Some(&w), &mut y, cols, 1e-6, before, par).unwrap()
            })
        });
        g.throughput(bytes::<T>(3 * n + 2 * cols));
        g.bench_function(BenchmarkId::new("bwd", &id), |bn| {
            bn.iter(|| {
                rms_norm::backward_cpu(black_box(&dy), &x, Some(&w), &mut dx, Some(&mut dw), cols, 1e-6, par).unwrap()
            })
        });
        g.finish();

        let mut g = c.benchmark_group(format!("layer_norm/{}", T::NAME));
        g.throughput(bytes::<T>(2 * n + 2 * cols));
        g.bench_function(BenchmarkId::new("fwd", &id), |bn| {
            bn.iter(|| layer_norm::forward_cpu(black_box(&x), Some(&w), Some(&b), &mut y, cols, 1e-5, par).unwrap())
        });
        g.throughput(bytes::<T>(3 * n + 4 * cols));
        g.bench_function(BenchmarkId::new("bwd", &id), |bn| {
            bn.iter(|| {
                let (dw, db) = (Some(&mut dw[..]), Some(&mut db[..]));
                layer_norm::backward_cpu(black_box(&dy), &x, Some(&w), Some(&b), &mut dx, dw, db, cols, 1e-5, par)
                    .unwrap()
            })
        });
        g.finish();

        let mut g = c.benchmark_group(format!("fused_add_rms_norm/{}", T::NAME));
        g.throughput(bytes::<T>(4 * n + cols));
        g.bench_function(BenchmarkId::new("fwd", &id), |bn| {
            bn.iter(|| {
                let once = Rounding::Once;
                fused_add_rms_norm::forward_cpu(black_box(&x), &r, Some(&w), &mut y, &mut s, cols, 1e-6, once, par)
                    .unwrap()
            })
        });
        // In place (vLLM's form): the same bytes, into x and r. Repeated calls
        // keep adding the normalised x to r: values stay finite.
        let (mut xi, mut ri) = (x.clone(), r.clone());
        g.bench_function(BenchmarkId::new("fwd_inplace", &id), |bn| {
            bn.iter(|| {
                let once = Rounding::Once;
                fused_add_rms_norm::forward_inplace_cpu(black_box(&mut xi), &mut ri, Some(&w), cols, 1e-6, once, par)
                    .unwrap()
            })
        });
        // Backward with both output gradients: reads dy, d(sum), sum; writes d(sum).
        g.throughput(bytes::<T>(4 * n + 2 * cols));
        g.bench_function(BenchmarkId::new("bwd", &id), |bn| {
            bn.iter(|| {
                fused_add_rms_norm::backward_cpu(
                    black_box(&dy),
                    Some(&r),
                    &x,
                    Some(&w),
                    &mut dx,
                    Some(&mut dw),
                    cols,
                    1e-6,
                    par,
                )
                .unwrap()
            })
        });
        g.finish();
    }
}

/// QK-norm as Llama-style models with it run: rms_norm over each head
/// (`head_dim` 128) of q, read in place from a fused qkv projection's
/// output (`[tokens, 3 heads head_dim]`, q the first third), so rows are
/// short and strided. Keel's torch op takes this path for such views.
fn bench_qk<T: Element>(c: &mut Criterion) {
    let (tokens, heads, d) = (4096, 32, 128);
    let qkv = data::<T>(tokens * 3 * heads * d, 0);
    let w = data::<T>(d, 3);
    let layout = RowLayout::new(&[tokens, heads], &[3 * heads * d, d]).expect("two leading dims");
    let mut y = vec![T::default(); tokens * heads * d];
    let mut g = c.benchmark_group(format!("rms_norm/{}", T::NAME));
    g.throughput(bytes::<T>(2 * y.len() + d));
    g.bench_function(BenchmarkId::new("fwd_qkv_view", format!("{tokens}x{heads}x{d}")), |bn| {
        bn.iter(|| {
            let once = Rounding::Once;
            rms_norm::forward_strided_cpu(black_box(&qkv), layout, Some(&w), &mut y, d, 1e-6, once, Par::Rayon).unwrap()
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    every_dtype!(c, bench);
    every_dtype!(c, bench_qk);
}

criterion_group! { name = norms; config = common::config(); targets = benches }
criterion_main!(norms);
