//! criterion: the CPU rms_norm kernels (forward and backward), f32 and bf16,
//! on an LLM-sized input and small ones, sequential and on rayon's pool.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keel::cpu::{bf16, Element, Par};
use keel::ops::rms_norm::{backward_cpu, forward_cpu};
use std::hint::black_box;

fn bench_dtype<T: Element>(c: &mut Criterion) {
    let mut g = c.benchmark_group(format!("rms_norm/{}", T::NAME));
    for (rows, cols) in [(4096usize, 4096usize), (32, 4096), (1, 4096), (2048, 8192)] {
        let x: Vec<T> = (0..rows * cols).map(|i| T::from_f64(((i * 7919) % 2001) as f64 / 1000.0 - 1.0)).collect();
        let w: Vec<T> = (0..cols).map(|i| T::from_f64(1.0 + (i % 5) as f64 / 10.0)).collect();
        let mut y = vec![T::default(); rows * cols];
        let bytes = (2 * rows * cols + cols) * std::mem::size_of::<T>();
        g.throughput(Throughput::Bytes(bytes as u64));
        for (pname, par) in [("seq", Par::Seq), ("rayon", Par::Rayon)] {
            g.bench_function(BenchmarkId::new(format!("fwd/{pname}"), format!("{rows}x{cols}")), |b| {
                b.iter(|| forward_cpu(black_box(&x), Some(&w), &mut y, cols, 1e-6, par).unwrap())
            });
        }
        let mut dx = vec![T::default(); rows * cols];
        let mut dw = vec![T::default(); cols];
        g.throughput(Throughput::Bytes(((3 * rows * cols + 2 * cols) * std::mem::size_of::<T>()) as u64));
        g.bench_function(BenchmarkId::new("bwd/rayon", format!("{rows}x{cols}")), |b| {
            b.iter(|| {
                backward_cpu(black_box(&y), &x, Some(&w), &mut dx, Some(&mut dw), cols, 1e-6, Par::Rayon).unwrap()
            })
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_dtype::<f32>(c);
    bench_dtype::<bf16>(c);
}

criterion_group! {
    name = rms_norm;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(rms_norm);
