//! criterion: Keel against candle-nn on the CPU ops both have, in the same
//! groups (`<op>/<dtype>`, ids `keel/<shape>` and `candle/<shape>`), f32 and
//! bf16, on the same inputs, both on rayon's pool. Both sides return a fresh
//! output per call, as candle's ops do. Pairs:
//! - rms_norm: `keel::ops::rms_norm` / `candle_nn::ops::rms_norm`
//! - layer_norm: `keel::ops::layer_norm` / `candle_nn::ops::layer_norm`
//! - softmax: `keel::ops::softmax` / `candle_nn::ops::softmax_last_dim`
//! - silu_and_mul: `keel::ops::gated` (silu) / `candle_nn::ops::swiglu`
//! - rotary NeoX: Keel on `[b, s, h, d]` / `candle_nn::rotary_emb::rope_thd` on the same layout
//! - rotary GPT-J: Keel interleaved on `[b, s, h, d]` / `candle_nn::rotary_emb::rope_i`
//!   on `[b, h, s, d]` (candle's only interleaved layout; the same work)
use candle_core::{DType, Device, Tensor, WithDType};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keel::cpu::{bf16, Element, Par};
use keel::ops::{gated, layer_norm, rms_norm, rotary, softmax};
use rayon::prelude::*;
use std::hint::black_box;

// The main crate's bench helpers (inputs, shapes, criterion settings), shared by path.
#[path = "../../common/mod.rs"]
mod common;
use common::{bytes, data, BATCH_SEQ, ROWS_HIDDEN};

fn tensor<T: Element + WithDType>(v: &[T], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap()
}

/// A fresh zeroed output, as an op returning a new tensor needs: `alloc_zeroed`
/// (fresh pages, faulted in by the kernel's writes). `vec![T::default(); n]`
/// would write every element first for bf16 (only primitives get `calloc`).
fn fresh<T: Element + bytemuck::Zeroable>(n: usize) -> Vec<T> {
    bytemuck::zeroed_vec(n)
}

use common::Group;

/// The floor in each group: a fresh copy of `out_len` input elements (allocation,
/// page faults, one read and one write), what any op returning a new tensor pays;
/// on the calling thread (`clone`) and over rayon's pool in chunks of 256K
/// elements (`clone_par`, as the ops may split). The summary takes the faster.
fn floor<T: Element + bytemuck::Zeroable>(g: &mut Group<'_>, id: &str, x: &[T], out_len: usize) {
    g.bench_function(BenchmarkId::new("clone", id), |bn| {
        bn.iter(|| {
            let mut y = fresh::<T>(out_len);
            y.copy_from_slice(black_box(&x[..out_len]));
            y
        })
    });
    if out_len >= 2 * CHUNK {
        g.bench_function(BenchmarkId::new("clone_par", id), |bn| {
            bn.iter(|| {
                let mut y = fresh::<T>(out_len);
                y.par_chunks_mut(CHUNK).zip(black_box(&x[..out_len]).par_chunks(CHUNK)).for_each(|(y, x)| {
                    y.copy_from_slice(x);
                });
                y
            })
        });
    }
}

/// `clone_par`'s chunk, in elements.
const CHUNK: usize = 1 << 18;

fn group<'a, T: Element>(c: &'a mut Criterion, op: &str, elems: usize) -> Group<'a> {
    let mut g = c.benchmark_group(format!("{op}/{}", T::NAME));
    g.throughput(bytes::<T>(elems));
    g
}

fn bench<T: Element + WithDType + bytemuck::Zeroable>(c: &mut Criterion, dtype: DType) {
    let par = Par::Rayon;
    for (rows, cols) in ROWS_HIDDEN {
        let n = rows * cols;
        let id = format!("{rows}x{cols}");
        let (x, w, b) = (data::<T>(n, 0), data::<T>(cols, 3), data::<T>(cols, 4));
        let (xt, wt, bt) = (tensor(&x, &[rows, cols]), tensor(&w, &[cols]), tensor(&b, &[cols]));
        assert_eq!(xt.dtype(), dtype);

        let mut g = group::<T>(c, "rms_norm", 2 * n);
        floor(&mut g, &id, &x, n);
        g.bench_function(BenchmarkId::new("keel", &id), |bn| {
            bn.iter(|| {
                let mut y = fresh::<T>(n);
                rms_norm::forward_cpu(black_box(&x), Some(&w), &mut y, cols, 1e-6, par).unwrap();
                y
            })
        });
        g.bench_function(BenchmarkId::new("candle", &id), |bn| {
            bn.iter(|| candle_nn::ops::rms_norm(black_box(&xt), &wt, 1e-6).unwrap())
        });
        g.finish();

        let mut g = group::<T>(c, "layer_norm", 2 * n);
        floor(&mut g, &id, &x, n);
        g.bench_function(BenchmarkId::new("keel", &id), |bn| {
            bn.iter(|| {
                let mut y = fresh::<T>(n);
                layer_norm::forward_cpu(black_box(&x), Some(&w), Some(&b), &mut y, cols, 1e-5, par).unwrap();
                y
            })
        });
        g.bench_function(BenchmarkId::new("candle", &id), |bn| {
            bn.iter(|| candle_nn::ops::layer_norm(black_box(&xt), &wt, &bt, 1e-5).unwrap())
        });
        g.finish();

        let mut g = group::<T>(c, "softmax", 2 * n);
        floor(&mut g, &id, &x, n);
        g.bench_function(BenchmarkId::new("keel", &id), |bn| {
            bn.iter(|| {
                let mut y = fresh::<T>(n);
                softmax::forward_cpu(black_box(&x), &mut y, cols, 1.0, par).unwrap();
                y
            })
        });
        g.bench_function(BenchmarkId::new("candle", &id), |bn| {
            bn.iter(|| candle_nn::ops::softmax_last_dim(black_box(&xt)).unwrap())
        });
        g.finish();

        // silu_and_mul: input [rows, cols] = [a | b], output [rows, cols / 2].
        let mut g = group::<T>(c, "silu_and_mul", n + n / 2);
        floor(&mut g, &id, &x, n / 2);
        g.bench_function(BenchmarkId::new("keel", &id), |bn| {
            bn.iter(|| {
                let mut y = fresh::<T>(n / 2);
                gated::forward_cpu(gated::Activation::Silu, black_box(&x), &mut y, cols / 2, par).unwrap();
                y
            })
        });
        g.bench_function(BenchmarkId::new("candle", &id), |bn| {
            bn.iter(|| candle_nn::ops::swiglu(black_box(&xt)).unwrap())
        });
        g.finish();
    }
    for (batch, seq) in BATCH_SEQ {
        let (heads, d) = (32, 128);
        let shape = rotary::Shape { batch, seq, heads, head_dim: d, rotary_dim: d };
        let n = shape.numel();
        let id = format!("{batch}x{seq}x{heads}x{d}");
        let (x, cos, sin) = (data::<T>(n, 0), data::<T>(seq * d / 2, 1), data::<T>(seq * d / 2, 2));
        let (cost, sint) = (tensor(&cos, &[seq, d / 2]), tensor(&sin, &[seq, d / 2]));
        let x_bshd = tensor(&x, &[batch, seq, heads, d]);
        let x_bhsd = tensor(&x, &[batch, heads, seq, d]);
        for (op, interleaved) in [("rotary_neox", false), ("rotary_gptj", true)] {
            let mut g = group::<T>(c, op, 2 * n);
            floor(&mut g, &id, &x, n);
            g.bench_function(BenchmarkId::new("keel", &id), |bn| {
                bn.iter(|| {
                    let mut y = fresh::<T>(n);
                    rotary::apply_cpu(black_box(&x), &cos, &sin, &mut y, shape, interleaved, false, par).unwrap();
                    y
                })
            });
            g.bench_function(BenchmarkId::new("candle", &id), |bn| {
                bn.iter(|| {
                    if interleaved {
                        candle_nn::rotary_emb::rope_i(black_box(&x_bhsd), &cost, &sint).unwrap()
                    } else {
                        candle_nn::rotary_emb::rope_thd(black_box(&x_bshd), &cost, &sint).unwrap()
                    }
                })
            });
            g.finish();
        }
    }
}

fn benches(c: &mut Criterion) {
    bench::<f32>(c, DType::F32);
    bench::<bf16>(c, DType::BF16);
}

criterion_group! { name = vs_candle; config = common::config(); targets = benches }
criterion_main!(vs_candle);
