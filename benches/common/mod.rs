//! Shared by the criterion benches: deterministic inputs, the shapes, the
//! criterion settings, and a macro that runs a generic bench for every dtype.
#![allow(dead_code)] // each bench uses a different part

use criterion::{measurement::WallTime, BenchmarkGroup, Criterion, Throughput};
use keel::cpu::Element;
use std::time::Duration;

/// A benchmark group measured in wall time.
pub type Group<'a> = BenchmarkGroup<'a, WallTime>;

/// Row ops `[rows, hidden]`: Llama-7B and -70B hidden sizes over a 4096-token
/// (or 2048) prefill, and a 32-token decode batch.
pub const ROWS_HIDDEN: [(usize, usize); 3] = [(4096, 4096), (2048, 8192), (32, 4096)];

/// cross_entropy `[rows, vocab]`: Llama-2 and Llama-3 vocabularies, and a small batch.
pub const ROWS_VOCAB: [(usize, usize); 3] = [(4096, 32000), (1024, 128256), (8, 32000)];

/// rotary `(batch, seq)` with 32 heads of 128: seq 1024 to 4096, and a short one.
pub const BATCH_SEQ: [(usize, usize); 3] = [(4, 1024), (1, 4096), (1, 16)];

/// Values in [-1, 1), different per `seed`, the same on every run.
pub fn data<T: Element>(n: usize, seed: usize) -> Vec<T> {
    (0..n).map(|i| T::from_f64((((i + seed) * 7919) % 2001) as f64 / 1000.0 - 1.0)).collect()
}

/// `elems` elements of `T` read plus written, for criterion's GB/s.
pub fn bytes<T>(elems: usize) -> Throughput {
    Throughput::Bytes((elems * std::mem::size_of::<T>()) as u64)
}

/// Short runs: these inputs are large and the machines small.
pub fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

/// Runs `$bench::<T>(c)` for f32, f16, bf16 and f64.
#[macro_export]
macro_rules! every_dtype {
    ($c:expr, $bench:ident) => {{
        $bench::<f32>($c);
        $bench::<keel::cpu::f16>($c);
        $bench::<keel::cpu::bf16>($c);
        $bench::<f64>($c);
    }};
}
