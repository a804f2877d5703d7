//! criterion: the gated activations (silu_and_mul, gelu_and_mul exact and
//! tanh) on CPU, forward and backward, every dtype, on rayon's pool. Input
//! `[rows, 2 hidden]`, output `[rows, hidden]`; throughput counts bytes read
//! and written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keel::cpu::{Element, Par};
use keel::ops::gated::{backward_cpu, forward_cpu, Activation};
use std::hint::black_box;

mod common;
use common::{bytes, data, ROWS_HIDDEN};

fn bench<T: Element>(c: &mut Criterion) {
    let par = Par::Rayon;
    for act in [Activation::Silu, Activation::Gelu, Activation::GeluTanh] {
        let mut g = c.benchmark_group(format!("{}_and_mul/{}", act.name(), T::NAME));
        for (rows, d) in ROWS_HIDDEN {
            let n = rows * 2 * d;
            let id = format!("{rows}x{}", 2 * d);
            let (x, dy) = (data::<T>(n, 0), data::<T>(n / 2, 2));
            let (mut y, mut dx) = (vec![T::default(); n / 2], vec![T::default(); n]);
            g.throughput(bytes::<T>(n + n / 2));
            g.bench_function(BenchmarkId::new("fwd", &id), |bn| {
                bn.iter(|| forward_cpu(act, black_box(&x), &mut y, d, par).unwrap())
            });
            g.throughput(bytes::<T>(2 * n + n / 2));
            g.bench_function(BenchmarkId::new("bwd", &id), |bn| {
                bn.iter(|| backward_cpu(act, black_box(&dy), &x, &mut dx, d, par).unwrap())
            });
        }
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    every_dtype!(c, bench);
}

criterion_group! { name = activations; config = common::config(); targets = benches }
criterion_main!(activations);
