//! criterion: rotary_embedding on CPU in both layouts (NeoX halves, GPT-J
//! pairs), forward (the backward is the same kernel rotating the other way),
//! every dtype, on rayon's pool; x `[batch, seq, 32, 128]`, and NeoX on an x
//! read through its strides (a `[batch, 32, seq, 128]` tensor transposed),
//! and NeoX in place (contiguous, and transposed).
//! Throughput counts x read and the output written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keel::cpu::{Element, Par};
use keel::ops::rotary::{apply_cpu, apply_inplace_cpu, apply_strided_cpu, Shape, Strides};
use std::hint::black_box;

mod common;
use common::{bytes, data, BATCH_SEQ};

fn bench<T: Element>(c: &mut Criterion) {
    let par = Par::Rayon;
    let mut g = c.benchmark_group(format!("rotary_embedding/{}", T::NAME));
    for (batch, seq) in BATCH_SEQ {
        let shape = Shape { batch, seq, heads: 32, head_dim: 128, rotary_dim: 128 };
        let n = shape.numel();
        let id = format!("{batch}x{seq}x32x128");
        let (x, cos, sin) = (data::<T>(n, 0), data::<T>(seq * 64, 1), data::<T>(seq * 64, 2));
        let mut y = vec![T::default(); n];
        g.throughput(bytes::<T>(2 * n));
        for (name, interleaved) in [("neox", false), ("gptj", true)] {
            g.bench_function(BenchmarkId::new(name, &id), |bn| {
                bn.iter(|| apply_cpu(black_box(&x), &cos, &sin, &mut y, shape, interleaved, false, par).unwrap())
            });
        }
        let st = Strides { batch: 32 * seq * 128, seq: 128, heads: seq * 128 };
        g.bench_function(BenchmarkId::new("neox transposed", &id), |bn| {
            bn.iter(|| apply_strided_cpu(black_box(&x), st, &cos, &sin, &mut y, shape, false, false, par).unwrap())
        });
        // In place: x read and written (the same bytes). Each call rotates the
        // last one's output, so cos and sin are those of real angles: with
        // cos^2 + sin^2 = 1 the values keep their size (the made-up ones above
        // would shrink some to subnormals and grow others to infinity).
        let mut xi = x.clone();
        let angles = data::<f64>(seq * 64, 1);
        let cos_a: Vec<T> = angles.iter().map(|a| T::from_f64(a.cos())).collect();
        let sin_a: Vec<T> = angles.iter().map(|a| T::from_f64(a.sin())).collect();
        for (name, layout) in [("neox inplace", shape.contiguous()), ("neox inplace transposed", st)] {
            g.bench_function(BenchmarkId::new(name, &id), |bn| {
                bn.iter(|| {
                    apply_inplace_cpu(black_box(&mut xi), layout, &cos_a, &sin_a, shape, false, false, par).unwrap()
                })
            });
        }
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    every_dtype!(c, bench);
}

criterion_group! { name = rotary; config = common::config(); targets = benches }
criterion_main!(rotary);
