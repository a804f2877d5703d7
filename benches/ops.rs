//! criterion: the CPU kernels of layer_norm, fused_add_rms_norm and the gated
//! activations, forward and backward, f32 and bf16, on LLM-sized inputs and a
//! small one, on rayon's pool. Throughput counts bytes read and written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keel::cpu::{bf16, Element, Par};
use keel::ops::{fused_add_rms_norm, gated, layer_norm};
use std::hint::black_box;

fn data<T: Element>(n: usize, seed: usize) -> Vec<T> {
    (0..n).map(|i| T::from_f64((((i + seed) * 7919) % 2001) as f64 / 1000.0 - 1.0)).collect()
}

fn bench_dtype<T: Element>(c: &mut Criterion) {
    let size = std::mem::size_of::<T>();
    let par = Par::Rayon;
    let mut g = c.benchmark_group(format!("ops/{}", T::NAME));
    for (rows, cols) in [(4096usize, 4096usize), (2048, 8192), (32, 4096)] {
        let n = rows * cols;
        let id = format!("{rows}x{cols}");
        let (x, r, dy, w, b) =
            (data::<T>(n, 0), data::<T>(n, 1), data::<T>(n, 2), data::<T>(cols, 3), data::<T>(cols, 4));
        let (mut y, mut s, mut dx) = (vec![T::default(); n], vec![T::default(); n], vec![T::default(); n]);
        let (mut dw, mut db) = (vec![T::default(); cols], vec![T::default(); cols]);

        g.throughput(Throughput::Bytes((2 * n * size) as u64));
        g.bench_function(BenchmarkId::new("layer_norm/fwd", &id), |bn| {
            bn.iter(|| layer_norm::forward_cpu(black_box(&x), Some(&w), Some(&b), &mut y, cols, 1e-5, par).unwrap())
        });
        g.throughput(Throughput::Bytes((3 * n * size) as u64));
        g.bench_function(BenchmarkId::new("layer_norm/bwd", &id), |bn| {
            bn.iter(|| {
                let (dw, db) = (Some(&mut dw[..]), Some(&mut db[..]));
                layer_norm::backward_cpu(black_box(&dy), &x, Some(&w), Some(&b), &mut dx, dw, db, cols, 1e-5, par)
                    .unwrap()
            })
        });
        g.throughput(Throughput::Bytes((4 * n * size) as u64));
        g.bench_function(BenchmarkId::new("fused_add_rms_norm/fwd", &id), |bn| {
            bn.iter(|| {
                fused_add_rms_norm::forward_cpu(black_box(&x), &r, Some(&w), &mut y, &mut s, cols, 1e-6, par).unwrap()
            })
        });
        // Gated: input [rows, cols] = [a | b], output [rows, cols / 2].
        let d = cols / 2;
        for act in [gated::Activation::Silu, gated::Activation::Gelu, gated::Activation::GeluTanh] {
            let name = format!("{act:?}").to_lowercase();
            g.throughput(Throughput::Bytes((n * size + n / 2 * size) as u64));
            g.bench_function(BenchmarkId::new(format!("{name}_and_mul/fwd"), &id), |bn| {
                bn.iter(|| gated::forward_cpu(act, black_box(&x), &mut y[..n / 2], d, par).unwrap())
            });
            g.throughput(Throughput::Bytes((2 * n * size + n / 2 * size) as u64));
            g.bench_function(BenchmarkId::new(format!("{name}_and_mul/bwd"), &id), |bn| {
                bn.iter(|| gated::backward_cpu(act, black_box(&dy[..n / 2]), &x, &mut dx, d, par).unwrap())
            });
        }
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_dtype::<f32>(c);
    bench_dtype::<bf16>(c);
}

criterion_group! {
    name = ops;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(ops);
