//! criterion: the CPU kernels of layer_norm, fused_add_rms_norm, the gated
//! activations, softmax, cross_entropy and rotary_embedding, forward and
//! backward, f32 and bf16, on LLM-sized inputs and a small one, on rayon's
//! pool. Throughput counts bytes read and written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keel::cpu::{bf16, Element, Par};
use keel::ops::{cross_entropy, fused_add_rms_norm, gated, layer_norm, rotary, softmax};
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
        g.throughput(Throughput::Bytes((2 * n * size) as u64));
        g.bench_function(BenchmarkId::new("softmax/fwd", &id), |bn| {
            bn.iter(|| softmax::forward_cpu(black_box(&x), &mut y, cols, 1.0, par).unwrap())
        });
        g.throughput(Throughput::Bytes((3 * n * size) as u64));
        g.bench_function(BenchmarkId::new("softmax/bwd", &id), |bn| {
            bn.iter(|| softmax::backward_cpu(black_box(&dy), &x, &mut dx, cols, 1.0, par).unwrap())
        });
    }
    bench_cross_entropy::<T>(&mut g, par);
    bench_rotary::<T>(&mut g, par);
    g.finish();
}

fn bench_cross_entropy<T: Element>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    par: Par<'_>,
) {
    let size = std::mem::size_of::<T>();
    for (rows, vocab) in [(4096usize, 32000usize), (1024, 128256), (8, 32000)] {
        let n = rows * vocab;
        let id = format!("{rows}x{vocab}");
        let x = data::<T>(n, 0);
        let target: Vec<i64> = (0..rows).map(|i| if i % 8 == 0 { -100 } else { ((i * 7919) % vocab) as i64 }).collect();
        let opts = cross_entropy::Options {
            ignore_index: -100,
            label_smoothing: 0.0,
            reduction: cross_entropy::Reduction::Mean,
        };
        let (mut loss, grad, mut dx) = (vec![T::default(); 1], vec![T::from_f64(1.0)], vec![T::default(); n]);
        g.throughput(Throughput::Bytes((n * size) as u64));
        g.bench_function(BenchmarkId::new("cross_entropy/fwd", &id), |bn| {
            bn.iter(|| cross_entropy::forward_cpu(black_box(&x), &target, &mut loss, vocab, opts, par).unwrap())
        });
        g.throughput(Throughput::Bytes((2 * n * size) as u64));
        g.bench_function(BenchmarkId::new("cross_entropy/bwd", &id), |bn| {
            bn.iter(|| cross_entropy::backward_cpu(&grad, black_box(&x), &target, &mut dx, vocab, opts, par).unwrap())
        });
    }
}

fn bench_rotary<T: Element>(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, par: Par<'_>) {
    let size = std::mem::size_of::<T>();
    for (batch, seq) in [(4usize, 1024usize), (1, 4096), (1, 16)] {
        let shape = rotary::Shape { batch, seq, heads: 32, head_dim: 128, rotary_dim: 128 };
        let n = shape.numel();
        let id = format!("{batch}x{seq}x32x128");
        let (x, cos, sin) = (data::<T>(n, 0), data::<T>(seq * 64, 1), data::<T>(seq * 64, 2));
        let mut y = vec![T::default(); n];
        g.throughput(Throughput::Bytes((2 * n * size) as u64));
        for interleaved in [false, true] {
            let name = if interleaved { "rotary_embedding/gptj" } else { "rotary_embedding/neox" };
            g.bench_function(BenchmarkId::new(name, &id), |bn| {
                bn.iter(|| {
                    rotary::apply_cpu(black_box(&x), &cos, &sin, &mut y, shape, interleaved, false, par).unwrap()
                })
            });
        }
    }
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
