//! torch's intra-op pool as a `keel_cpu::ParallelFor`, so CPU kernels called
//! from torch respect `torch.set_num_threads` and share torch's threads.
use keel_cpu::{Par, ParallelFor};
use std::ops::Range;
use std::sync::OnceLock;

struct TorchPool {
    /// Asked of torch only when a kernel wants it: inputs too small to split
    /// never do, and they are the calls where the query's cost shows.
    threads: OnceLock<usize>,
}

impl ParallelFor for TorchPool {
    fn num_threads(&self) -> usize {
        *self.threads.get_or_init(|| match keel_abi::get_num_threads() {
            Ok(n) => n,
            // Caught by the op's boxed entry and raised as a RuntimeError.
            Err(e) => panic!("torch_get_num_threads failed: {e}"),
        })
    }

    fn parallel_for(&self, n: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        if let Err(e) = keel_abi::parallel_for(n, grain, f) {
            // Caught by the op's boxed entry and raised as a RuntimeError.
            panic!("torch_parallel_for failed: {e}");
        }
    }
}

/// Runs `f` with a `Par` over torch's pool.
pub(crate) fn with_torch_par<R>(f: impl FnOnce(Par<'_>) -> R) -> R {
    let pool = TorchPool { threads: OnceLock::new() };
    f(Par::External(&pool))
}
