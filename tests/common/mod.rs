//! Shared test helpers: per-dtype tolerances and comparison with a reference.
#![allow(dead_code)]
use keel::cpu::{bf16, f16, Element};

/// Absolute and relative tolerance of one dtype (torch.testing's defaults).
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
}

pub trait Tol: Element {
    const TOL: Tolerance;
    /// The type's machine epsilon: one unit in the last place of a normal
    /// value `v` is at most `EPS |v|`.
    const EPS: f64;
}
impl Tol for f64 {
    const TOL: Tolerance = Tolerance { atol: 1e-12, rtol: 1e-12 };
    const EPS: f64 = f64::EPSILON;
}
impl Tol for f32 {
    const TOL: Tolerance = Tolerance { atol: 1e-5, rtol: 1.3e-6 };
    const EPS: f64 = f32::EPSILON as f64;
}
impl Tol for f16 {
    const TOL: Tolerance = Tolerance { atol: 1e-3, rtol: 1e-3 };
    const EPS: f64 = 1.0 / 1024.0;
}
impl Tol for bf16 {
    const TOL: Tolerance = Tolerance { atol: 1e-2, rtol: 1.6e-2 };
    const EPS: f64 = 1.0 / 128.0;
}

/// Asserts `|got - want| <= scale * (atol + rtol * |want|)` element-wise.
pub fn assert_close<T: Tol>(got: &[T], want: &[f64], scale: f64, what: &str) {
    let t = T::TOL;
    assert_within(got, want, what, |w| scale * (t.atol + t.rtol * w.abs()));
}

/// Asserts `|got - want| <= bound(want)` element-wise.
fn assert_within<T: Tol>(got: &[T], want: &[f64], what: &str, bound: impl Fn(f64) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let (g, bound) = (g.to_f64(), bound(w));
        assert!((g - w).abs() <= bound, "{what} [{}] at {i}: got {g}, want {w} (bound {bound})", T::NAME);
    }
}

/// As [`assert_close`], for outputs `T(v) w` rounded to `T` before a
/// multiply, against an f64 reference that rounds there too: where `v` lies
/// near a tie between two `T` values, the kernel's f32 `v` and the
/// reference's can round to neighbours, one unit in the last place of `v`
/// apart, which `w` scales: at most `EPS |want|` more.
pub fn assert_close_rounded_within<T: Tol>(got: &[T], want: &[f64], scale: f64, what: &str) {
    let t = T::TOL;
    assert_within(got, want, what, |w| scale * (t.atol + t.rtol * w.abs()) + T::EPS * w.abs());
}

/// Rounds f64 samples to T (so the reference sees exactly the kernel's inputs).
pub fn to_elems<T: Element>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

/// As [`assert_close`], with the relative part measured against `|want| + floor`:
/// for results that are differences of terms of size about `floor`.
pub fn assert_close_floor<T: Tol>(got: &[T], want: &[f64], scale: f64, floor: f64, what: &str) {
    let t = T::TOL;
    assert_within(got, want, what, |w| scale * (t.atol + t.rtol * (w.abs() + floor)));
}

/// The floor for [`assert_close_floor`] of a norm's input gradient over one
/// row `x` (`dy` as long, `w` too where given): `dx = rstd (g - ...)`, with
/// `g = dy * w`, subtracts terms of about
/// `rstd max|g|`, and f32 loses their digits, not the result's. Where the
/// row's mean square (or, `centered`, its variance) is small against `eps`,
/// `rstd` is large and the difference small: a row of one value `-0.0124`
/// (`x + residual` of `-3.379` and `3.366`) gives `rstd` 80 and `dx` 3.33 from
/// terms of 516, 7.8e-5 off in f32 (session 51's CI). `4 rstd max|g|`.
pub fn grad_floor<T: Element>(x: &[T], dy: &[T], w: Option<&[T]>, eps: f64, centered: bool) -> f64 {
    let xs: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let n = xs.len().max(1) as f64;
    let mean = if centered { xs.iter().sum::<f64>() / n } else { 0.0 };
    let var = xs.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    let g_max = (0..x.len()).map(|j| (dy[j].to_f64() * w.map_or(1.0, |w| w[j].to_f64())).abs()).fold(0.0, f64::max);
    4.0 * g_max / (var + eps).sqrt()
}

/// Scale for a result that sums `n` f32-rounded terms: sqrt(n) f32 roundings
/// on top of the dtype's own tolerance.
pub fn sum_scale<T: Tol>(n: usize) -> f64 {
    1.0 + (n as f64).sqrt() * f32::EPSILON as f64 / T::TOL.rtol
}

/// Whether a GPU test should stop here: true (after saying why) where no CUDA
/// device is usable. With `KEEL_REQUIRE_GPU=1` (set by `scripts/gpu-run.sh` on
/// a GPU machine) a missing GPU fails the test instead of skipping it.
pub fn skip_without_gpu(test: &str) -> bool {
    if keel::cuda::is_available() {
        return false;
    }
    let why = "no usable CUDA device on this machine";
    assert!(std::env::var("KEEL_REQUIRE_GPU").as_deref() != Ok("1"), "{test}: {why}, and KEEL_REQUIRE_GPU=1");
    eprintln!("SKIPPED {test}: {why}");
    true
}

/// Runs `f` on a thread of a 3-thread rayon pool. `Par::Rayon` called there
/// splits work into blocks of the usual size; called from a test's own thread
/// (outside any pool) it splits only far larger inputs
/// (`keel::cpu::OUTSIDE_POOL_MIN_ELEMS`), so tests of the split run here.
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a rayon pool")).install(f)
}

/// `f()` inside [`in_pool`] where `pool`, else on this thread: a test's
/// `Par::Rayon` case, beside its `Par::Seq` one.
pub fn in_pool_if<R: Send>(pool: bool, f: impl FnOnce() -> R + Send) -> R {
    if pool {
        in_pool(f)
    } else {
        f()
    }
}

/// Random cases per property of the CPU property tests (`tests/*_cpu.rs`):
/// about 4 s for all of them on the 2-core CI machine. `PROPTEST_CASES`
/// overrides it (proptest 1.12 applies the variable over the config).
pub const CASES: u32 = 1000;

/// The CPU property tests' config: [`CASES`] cases, and failures saved in
/// `tests/<file>.proptest-regressions` beside the test file (re-run first
/// on every later run; commit the file). Proptest's default looks for a
/// `lib.rs` above the test file, finds none under `tests/`, says so twice on
/// every failure and then falls back to this same file.
pub fn config() -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases: CASES,
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Default::default()
    }
}

/// The offsets of the cross-entropy tests of rows far from 0.
pub const OFFSETS: [f64; 4] = [0.0, -1e2, 1e3, 1e4];

/// `rows * cols` logits of `T` spread over [-4, 4] around `offset`, and class
/// weights in [0.5, 2] for `cols` classes: rows far from 0 for the
/// cross-entropy tests of the loss's own precision.
pub fn shifted_rows<T: Element>(rows: usize, cols: usize, offset: f64) -> (Vec<T>, Vec<T>) {
    let noise = |i: usize| ((i * 7919 % 4001) as f64 - 2000.0) / 500.0;
    let x = (0..rows * cols).map(|i| T::from_f64(offset + noise(i))).collect();
    let w = (0..cols).map(|i| T::from_f64(0.5 + (i % 7) as f64 * 0.25)).collect();
    (x, w)
}

/// Asserts `|got - want| <= bound * |want|` element-wise (a relative error of
/// each value, with no absolute floor).
pub fn assert_relative<T: Element>(got: &[T], want: &[f64], bound: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g.to_f64() - w).abs() / w.abs();
        assert!(err <= bound, "{what} [{}] at {i}: got {}, want {w} ({err:.1e})", T::NAME, g.to_f64());
    }
}
