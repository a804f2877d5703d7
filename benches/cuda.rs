//! criterion: the CUDA kernels (forward of every op, f32 / f16 / bf16) with
//! device-synchronised timing: `iter_custom` launches `iters` times on one
//! stream and waits for the stream before reading the clock, so the figure is
//! GPU time, not launch time. Runs only where a GPU is found; elsewhere it
//! prints why and measures nothing. Throughput counts bytes read and written.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keel::cpu::{bf16, f16, Element};
use keel::cuda::{gpu, is_available, CudaElement, CudaSlice, CudaStream};
use keel::ops::rms_norm::Rounding;
use keel::ops::{cross_entropy, fused_add_rms_norm, gated, layer_norm, rms_norm, rotary, softmax};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::{bytes, data, BATCH_SEQ, ROWS_HIDDEN, ROWS_VOCAB};

/// Mean of `iters` launches of `f` on `s`, from the first launch to the end of the last kernel.
fn timed(s: &Arc<CudaStream>, iters: u64, mut f: impl FnMut()) -> Duration {
    s.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    s.synchronize().unwrap();
    t.elapsed()
}

/// One float32 value on the device.
fn up32(s: &Arc<CudaStream>, v: f32) -> CudaSlice<f32> {
    s.clone_htod(&[v]).unwrap()
}

/// cross_entropy's forward and backward given the lse against probabilities of
/// `P`, another type than the logits' `T` (the `_p{P}_` kernels: a float32
/// loss), on the logits `x` with its `lse` and gradient `dx` buffers.
fn bench_probs_other<T: Element + CudaElement, P: Element + CudaElement>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    s: &Arc<CudaStream>,
    (x, lse, dx): (&CudaSlice<T>, &mut CudaSlice<f32>, &mut CudaSlice<T>),
    vocab: usize,
    id: &str,
) {
    let (n, mean) = (x.len(), cross_entropy::Reduction::Mean);
    let p: Vec<P> = data::<f32>(n, 1).iter().map(|v| P::from_f64(f64::from(v.abs() * 2.0 / vocab as f32))).collect();
    let (p, mut loss, grad) = (s.clone_htod(&p).unwrap(), s.alloc_zeros::<f32>(1).unwrap(), up32(s, 1.0));
    let per =
        |k: usize| criterion::Throughput::Bytes((n * (k * std::mem::size_of::<T>() + std::mem::size_of::<P>())) as u64);
    g.throughput(per(1));
    g.bench_function(BenchmarkId::new(format!("cross_entropy/probs_{}/fwd", P::NAME), id), |bn| {
        bn.iter_custom(|it| {
            timed(s, it, || {
                let lse = Some(&mut *lse);
                cross_entropy::forward_probs_cuda(s, x, &p, None, &mut loss, lse, vocab, 0.0, mean).unwrap()
            })
        })
    });
    g.throughput(per(2));
    g.bench_function(BenchmarkId::new(format!("cross_entropy/probs_{}/bwd_lse", P::NAME), id), |bn| {
        bn.iter_custom(|it| {
            timed(s, it, || {
                let lse = Some(&*lse);
                cross_entropy::backward_probs_cuda(s, &grad, x, &p, None, lse, dx, vocab, 0.0, mean).unwrap()
            })
        })
    });
}

fn bench<T: Element + CudaElement>(c: &mut Criterion, s: &Arc<CudaStream>) {
    let up = |v: &[T]| -> CudaSlice<T> { s.clone_htod(v).unwrap() };
    let zeros = |n: usize| -> CudaSlice<T> { s.alloc_zeros::<T>(n).unwrap() };
    let mut g = c.benchmark_group(format!("cuda/{}", T::NAME));
    for (rows, cols) in ROWS_HIDDEN {
        let n = rows * cols;
        let id = format!("{rows}x{cols}");
        let (x, r, w, b) = (up(&data(n, 0)), up(&data(n, 1)), up(&data(cols, 3)), up(&data(cols, 4)));
        let (mut y, mut sum, mut half) = (zeros(n), zeros(n), zeros(n / 2));
        g.throughput(bytes::<T>(2 * n));
        g.bench_function(BenchmarkId::new("rms_norm/fwd", &id), |bn| {
            bn.iter_custom(|it| timed(s, it, || rms_norm::forward_cuda(s, &x, Some(&w), &mut y, cols, 1e-6).unwrap()))
        });
        g.bench_function(BenchmarkId::new("layer_norm/fwd", &id), |bn| {
            bn.iter_custom(|it| {
                timed(s, it, || layer_norm::forward_cuda(s, &x, Some(&w), Some(&b), &mut y, cols, 1e-5).unwrap())
            })
        });
        g.bench_function(BenchmarkId::new("softmax/fwd", &id), |bn| {
            bn.iter_custom(|it| timed(s, it, || softmax::forward_cuda(s, &x, &mut y, cols, 1.0).unwrap()))
        });
        g.throughput(bytes::<T>(4 * n));
        g.bench_function(BenchmarkId::new("fused_add_rms_norm/fwd", &id), |bn| {
            bn.iter_custom(|it| {
                timed(s, it, || {
                    fused_add_rms_norm::forward_cuda(s, &x, &r, Some(&w), &mut y, &mut sum, cols, 1e-6, Rounding::Once)
                        .unwrap()
                })
            })
        });
        let (mut xi, mut ri) = (s.clone_dtod(&x).unwrap(), s.clone_dtod(&r).unwrap());
        g.bench_function(BenchmarkId::new("fused_add_rms_norm/fwd_inplace", &id), |bn| {
            bn.iter_custom(|it| {
                timed(s, it, || {
                    fused_add_rms_norm::forward_inplace_cuda(s, &mut xi, &mut ri, Some(&w), cols, 1e-6, Rounding::Once)
                        .unwrap()
                })
            })
        });
        // Gated: input [rows, cols] = [a | b], output [rows, cols / 2].
        g.throughput(bytes::<T>(n + n / 2));
        for act in [gated::Activation::Silu, gated::Activation::Gelu, gated::Activation::GeluTanh] {
            g.bench_function(BenchmarkId::new(format!("{}_and_mul/fwd", act.name()), &id), |bn| {
                bn.iter_custom(|it| timed(s, it, || gated::forward_cuda(s, act, &x, &mut half, cols / 2).unwrap()))
            });
        }
    }
    let opts =
        cross_entropy::Options { ignore_index: -100, label_smoothing: 0.0, reduction: cross_entropy::Reduction::Mean };
    for (rows, vocab) in ROWS_VOCAB {
        let n = rows * vocab;
        let id = format!("{rows}x{vocab}");
        let x = up(&data(n, 0));
        let target: Vec<i64> = (0..rows).map(|i| if i % 8 == 0 { -100 } else { ((i * 7919) % vocab) as i64 }).collect();
        let target = s.clone_htod(&target).unwrap();
        let (mut loss, grad, mut dx) = (zeros(1), up(&[T::from_f64(1.0)]), zeros(n));
        let mut lse = s.alloc_zeros::<f32>(rows).unwrap();
        // Each call reads back its count of bad targets (one sync per call, as through torch).
        g.throughput(bytes::<T>(n));
        g.bench_function(BenchmarkId::new("cross_entropy/fwd", &id), |bn| {
            bn.iter_custom(|it| {
                timed(s, it, || {
                    cross_entropy::forward_cuda(s, &x, &target, None, &mut loss, Some(&mut lse), vocab, opts).unwrap()
                })
            })
        });
        g.throughput(bytes::<T>(2 * n));
        for (name, lse) in [("cross_entropy/bwd", None), ("cross_entropy/bwd_lse", Some(&lse))] {
            g.bench_function(BenchmarkId::new(name, &id), |bn| {
                bn.iter_custom(|it| {
                    timed(s, it, || {
                        cross_entropy::backward_cuda(s, &grad, &x, &target, None, lse, &mut dx, vocab, opts).unwrap()
                    })
                })
            });
        }
        // Class weights (read beside each row) and label smoothing 0.1.
        let w: Vec<T> = data::<T>(vocab, 2).iter().map(|v| T::from_f64(v.to_f64().abs() + 0.5)).collect();
        let (w, smooth) = (up(&w), cross_entropy::Options { label_smoothing: 0.1, ..opts });
        g.throughput(bytes::<T>(n));
        g.bench_function(BenchmarkId::new("cross_entropy/weight/fwd", &id), |bn| {
            bn.iter_custom(|it| {
                timed(s, it, || {
                    let lse = Some(&mut lse);
                    cross_entropy::forward_cuda(s, &x, &target, Some(&w), &mut loss, lse, vocab, smooth).unwrap()
                })
            })
        });
        g.throughput(bytes::<T>(2 * n));
        g.bench_function(BenchmarkId::new("cross_entropy/weight/bwd_lse", &id), |bn| {
            bn.iter_custom(|it| {
                timed(s, it, || {
                    let (w, lse) = (Some(&w), Some(&lse));
                    cross_entropy::backward_cuda(s, &grad, &x, &target, w, lse, &mut dx, vocab, smooth).unwrap()
                })
            })
        });
        // Probability targets (no synchronisation): the target rows are read too.
        let p: Vec<T> = data::<T>(n, 1).iter().map(|v| T::from_f64(v.to_f64().abs() * 2.0 / vocab as f64)).collect();
        let (p, mean) = (up(&p), cross_entropy::Reduction::Mean);
        // Without and with the class weights (and label smoothing 0.1).
        for (name, w, ls) in [("cross_entropy/probs", None, 0.0), ("cross_entropy/probs_weight", Some(&w), 0.1)] {
            g.throughput(bytes::<T>(2 * n));
            g.bench_function(BenchmarkId::new(format!("{name}/fwd"), &id), |bn| {
                bn.iter_custom(|it| {
                    timed(s, it, || {
                        let lse = Some(&mut lse);
                        cross_entropy::forward_probs_cuda(s, &x, &p, w, &mut loss, lse, vocab, ls, mean).unwrap()
                    })
                })
            });
            g.throughput(bytes::<T>(3 * n));
            g.bench_function(BenchmarkId::new(format!("{name}/bwd_lse"), &id), |bn| {
                bn.iter_custom(|it| {
                    timed(s, it, || {
                        let lse = Some(&lse);
                        cross_entropy::backward_probs_cuda(s, &grad, &x, &p, w, lse, &mut dx, vocab, ls, mean).unwrap()
                    })
                })
            });
        }
        // Probabilities of another type than the logits (the `_p{P}_` kernels): float32 ones
        // of 16-bit logits, bfloat16 ones of float32 logits.
        if T::DTYPE != keel::cuda::DType::F32 {
            bench_probs_other::<T, f32>(&mut g, s, (&x, &mut lse, &mut dx), vocab, &id);
        } else {
            bench_probs_other::<T, bf16>(&mut g, s, (&x, &mut lse, &mut dx), vocab, &id);
        }
    }
    for (batch, seq) in BATCH_SEQ {
        let shape = rotary::Shape { batch, seq, heads: 32, head_dim: 128, rotary_dim: 128 };
        let n = shape.numel();
        let id = format!("{batch}x{seq}x32x128");
        let (x, cos, sin, mut y) = (up(&data(n, 0)), up(&data(seq * 64, 1)), up(&data(seq * 64, 2)), zeros(n));
        g.throughput(bytes::<T>(2 * n));
        for (name, interleaved) in [("rotary_embedding/neox", false), ("rotary_embedding/gptj", true)] {
            g.bench_function(BenchmarkId::new(name, &id), |bn| {
                bn.iter_custom(|it| {
                    timed(s, it, || rotary::apply_cuda(s, &x, &cos, &sin, &mut y, shape, interleaved, false).unwrap())
                })
            });
        }
        let (mut xi, st) = (s.clone_dtod(&x).unwrap(), shape.contiguous());
        g.bench_function(BenchmarkId::new("rotary_embedding/neox_inplace", &id), |bn| {
            bn.iter_custom(|it| {
                timed(s, it, || rotary::apply_inplace_cuda(s, &mut xi, st, &cos, &sin, shape, false, false).unwrap())
            })
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    if !is_available() {
        // scripts/gpu-run.sh sets KEEL_REQUIRE_GPU=1: there, a GPU that is not found is an error.
        assert!(
            std::env::var("KEEL_REQUIRE_GPU").as_deref() != Ok("1"),
            "cuda benches: no GPU, and KEEL_REQUIRE_GPU=1"
        );
        println!("cuda benches: skipped (no CUDA driver or GPU found on this machine)");
        return;
    }
    let s = gpu(0).and_then(|g| g.new_stream()).expect("a GPU was found but a stream could not be made");
    bench::<f32>(c, &s);
    bench::<f16>(c, &s);
    bench::<bf16>(c, &s);
}

criterion_group! { name = cuda; config = common::config(); targets = benches }
criterion_main!(cuda);
