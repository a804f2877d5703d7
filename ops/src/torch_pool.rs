//! torch's intra-op pool as a `keel_cpu::ParallelFor`, so CPU kernels called
//! from torch respect `torch.set_num_threads` and share torch's threads.
use keel_cpu::{Par, ParallelFor};
use std::ops::Range;

struct TorchPool {
    threads: usize,
}

impl ParallelFor for TorchPool {
    fn num_threads(&self) -> usize {
        self.threads
    }

    fn parallel_for(&self, n: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        if let Err(e) = keel_abi::parallel_for(n, grain, f) {
            // Caught by the op's boxed entry and raised as a RuntimeError.
            panic!("torch_parallel_for failed: {e}");
        }
    }
}

/// Runs `f` with a `Par` over torch's pool.
pub(crate) fn with_torch_par<R>(f: impl FnOnce(Par<'_>) -> R) -> keel_abi::Result<R> {
    let pool = TorchPool { threads: keel_abi::get_num_threads()? };
    Ok(f(Par::External(&pool)))
}
