//! criterion: softmax on CPU, forward and backward, every dtype, on rayon's
//! pool. Throughput counts bytes read and written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keel::cpu::{Element, Par};
use keel::ops::softmax::{backward_cpu, forward_cpu};
use std::hint::black_box;

mod common;
use common::{bytes, data, ROWS_HIDDEN};

fn bench<T: Element>(c: &mut Criterion) {
    let par = Par::Rayon;
    let mut g = c.benchmark_group(format!("softmax/{}", T::NAME));
    for (rows, cols) in ROWS_HIDDEN {
        let n = rows * cols;
        let id = format!("{rows}x{cols}");
        let (x, dy) = (data::<T>(n, 0), data::<T>(n, 2));
        let (mut y, mut dx) = (vec![T::default(); n], vec![T::default(); n]);
        g.throughput(bytes::<T>(2 * n));
        g.bench_function(BenchmarkId::new("fwd", &id), |bn| {
            bn.iter(|| forward_cpu(black_box(&x), &mut y, cols, 1.0, par).unwrap())
        });
        g.throughput(bytes::<T>(3 * n));
        g.bench_function(BenchmarkId::new("bwd", &id), |bn| {
            bn.iter(|| backward_cpu(black_box(&dy), &x, &mut dx, cols, 1.0, par).unwrap())
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    every_dtype!(c, bench);
}

criterion_group! { name = softmax; config = common::config(); targets = benches }
criterion_main!(softmax);
