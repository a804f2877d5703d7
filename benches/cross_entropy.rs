//! criterion: fused cross_entropy on CPU, forward (mean loss, keeping each
//! row's log-sum-exp) and backward (recomputing the lse, and given it), every
//! dtype, on rayon's pool; every 8th row ignored; then with class weights
//! and label smoothing 0.1 (`weight/...`). Then the same against
//! probability targets (`probs/...`: a target row as long as each logits row,
//! read by the forward and the backward), and with class weights and label
//! smoothing 0.1 (`probs_weight/...`); for f16 and bf16 logits, float32
//! targets too (`probs_f32/...`, read as they are). Throughput counts the
//! logits (and targets) read and, backward, the gradient written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use keel::cpu::{Acc, Element, Par};
use keel::ops::cross_entropy::{backward_cpu, backward_probs_cpu, forward_cpu, forward_probs_cpu, Options, Reduction};
use std::hint::black_box;

mod common;
use common::{bytes, data, ROWS_VOCAB};

fn bench<T: Element>(c: &mut Criterion) {
    let par = Par::Rayon;
    let opts = Options { ignore_index: -100, label_smoothing: 0.0, reduction: Reduction::Mean };
    let mut g = c.benchmark_group(format!("cross_entropy/{}", T::NAME));
    for (rows, vocab) in ROWS_VOCAB {
        let n = rows * vocab;
        let id = format!("{rows}x{vocab}");
        let x = data::<T>(n, 0);
        let target: Vec<i64> = (0..rows).map(|i| if i % 8 == 0 { -100 } else { ((i * 7919) % vocab) as i64 }).collect();
        let (mut loss, grad, mut dx) = (vec![T::default(); 1], vec![T::from_f64(1.0)], vec![T::default(); n]);
        let mut lse = vec![T::Acc::ZERO; rows];
        g.throughput(bytes::<T>(n));
        g.bench_function(BenchmarkId::new("fwd", &id), |bn| {
            bn.iter(|| forward_cpu(black_box(&x), &target, None, &mut loss, Some(&mut lse), vocab, opts, par).unwrap())
        });
        g.throughput(bytes::<T>(2 * n));
        g.bench_function(BenchmarkId::new("bwd", &id), |bn| {
            bn.iter(|| backward_cpu(&grad, black_box(&x), &target, None, None, &mut dx, vocab, opts, par).unwrap())
        });
        g.bench_function(BenchmarkId::new("bwd_lse", &id), |bn| {
            bn.iter(|| {
                backward_cpu(&grad, black_box(&x), &target, None, Some(&lse), &mut dx, vocab, opts, par).unwrap()
            })
        });
        // Class weights (read beside each row, from cache) and label smoothing.
        let w: Vec<T> = data::<T>(vocab, 2).iter().map(|v| T::from_f64(v.to_f64().abs() + 0.5)).collect();
        let (w, smooth) = (Some(&w[..]), Options { label_smoothing: 0.1, ..opts });
        g.throughput(bytes::<T>(n));
        g.bench_function(BenchmarkId::new("weight/fwd", &id), |bn| {
            bn.iter(|| forward_cpu(black_box(&x), &target, w, &mut loss, Some(&mut lse), vocab, smooth, par).unwrap())
        });
        g.throughput(bytes::<T>(2 * n));
        g.bench_function(BenchmarkId::new("weight/bwd_lse", &id), |bn| {
            bn.iter(|| backward_cpu(&grad, black_box(&x), &target, w, Some(&lse), &mut dx, vocab, smooth, par).unwrap())
        });
        // Probability targets: non-negative, each row summing to about 1.
        let p: Vec<T> = data::<T>(n, 1).iter().map(|v| T::from_f64(v.to_f64().abs() * 2.0 / vocab as f64)).collect();
        let mean = Reduction::Mean;
        g.throughput(bytes::<T>(2 * n));
        g.bench_function(BenchmarkId::new("probs/fwd", &id), |bn| {
            bn.iter(|| {
                forward_probs_cpu(black_box(&x), &p, None, &mut loss, Some(&mut lse), vocab, 0.0, mean, par).unwrap()
            })
        });
        g.throughput(bytes::<T>(3 * n));
        g.bench_function(BenchmarkId::new("probs/bwd_lse", &id), |bn| {
            bn.iter(|| {
                backward_probs_cpu(&grad, black_box(&x), &p, None, Some(&lse), &mut dx, vocab, 0.0, mean, par).unwrap()
            })
        });
        // With the class weights and label smoothing.
        g.throughput(bytes::<T>(2 * n));
        g.bench_function(BenchmarkId::new("probs_weight/fwd", &id), |bn| {
            bn.iter(|| {
                forward_probs_cpu(black_box(&x), &p, w, &mut loss, Some(&mut lse), vocab, 0.1, mean, par).unwrap()
            })
        });
        g.throughput(bytes::<T>(3 * n));
        g.bench_function(BenchmarkId::new("probs_weight/bwd_lse", &id), |bn| {
            bn.iter(|| {
                backward_probs_cpu(&grad, black_box(&x), &p, w, Some(&lse), &mut dx, vocab, 0.1, mean, par).unwrap()
            })
        });
    }
    g.finish();
}

/// Probability targets of `P`, another type than the logits' `T` (f32 ones of
/// 16-bit logits: a teacher's float32 softmax against a student's logits; a
/// 16-bit one of f32 logits or of the other 16-bit type), read by the
/// kernels as they are; an f32 loss.
fn bench_other_targets<T: Element<Acc = f32>, P: Element<Acc = f32>>(c: &mut Criterion) {
    let (par, mean) = (Par::Rayon, Reduction::Mean);
    let mut g = c.benchmark_group(format!("cross_entropy/{}", T::NAME));
    for (rows, vocab) in ROWS_VOCAB {
        let n = rows * vocab;
        let id = format!("{rows}x{vocab}");
        let x = data::<T>(n, 0);
        let p: Vec<P> =
            data::<f32>(n, 1).iter().map(|v| P::from_f64(f64::from(v.abs() * 2.0 / vocab as f32))).collect();
        let (mut loss, grad, mut dx) = (vec![0f32; 1], vec![1f32], vec![T::default(); n]);
        let mut lse = vec![0f32; rows];
        // Bytes: the logits and the targets read, the gradient written.
        let per = |k: usize| Throughput::Bytes((n * (k * std::mem::size_of::<T>() + std::mem::size_of::<P>())) as u64);
        g.throughput(per(1));
        g.bench_function(BenchmarkId::new(format!("probs_{}/fwd", P::NAME), &id), |bn| {
            bn.iter(|| {
                forward_probs_cpu(black_box(&x), &p, None, &mut loss, Some(&mut lse), vocab, 0.0, mean, par).unwrap()
            })
        });
        g.throughput(per(2));
        g.bench_function(BenchmarkId::new(format!("probs_{}/bwd_lse", P::NAME), &id), |bn| {
            bn.iter(|| {
                backward_probs_cpu(&grad, black_box(&x), &p, None, Some(&lse), &mut dx, vocab, 0.0, mean, par).unwrap()
            })
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    use keel::cpu::{bf16, f16};
    every_dtype!(c, bench);
    bench_other_targets::<f16, f32>(c);
    bench_other_targets::<bf16, f32>(c);
    bench_other_targets::<f32, bf16>(c);
    bench_other_targets::<f32, f16>(c);
    bench_other_targets::<bf16, f16>(c);
    bench_other_targets::<f16, bf16>(c);
}

criterion_group! { name = cross_entropy; config = common::config(); targets = benches }
criterion_main!(cross_entropy);
