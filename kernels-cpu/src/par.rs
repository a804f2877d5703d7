//! Where a kernel's parallel work runs: chosen by the caller, as in faer.
use rayon::prelude::*;
use std::ops::Range;

/// A thread pool that the caller owns (e.g. torch's intra-op pool).
///
/// `parallel_for` must call `f` on disjoint ranges that together cover
/// `0..n`, each at least `grain` long except possibly the last, and return
/// only once every call has returned.
pub trait ParallelFor: Sync {
    /// Number of threads work may be spread over.
    fn num_threads(&self) -> usize;
    /// Runs `f` over disjoint ranges covering `0..n`.
    fn parallel_for(&self, n: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync));
}

/// The parallelism a kernel call may use.
#[derive(Clone, Copy)]
pub enum Par<'a> {
    /// Everything on the calling thread.
    Seq,
    /// rayon's current pool (the global one unless called inside `install`).
    Rayon,
    /// A pool owned by the caller.
    External(&'a dyn ParallelFor),
}

impl std::fmt::Debug for Par<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Par::Seq => f.write_str("Par::Seq"),
            Par::Rayon => f.write_str("Par::Rayon"),
            Par::External(p) => write!(f, "Par::External({} threads)", p.num_threads()),
        }
    }
}

impl Par<'_> {
    /// Number of threads this parallelism may use.
    pub fn num_threads(&self) -> usize {
        match self {
            Par::Seq => 1,
            Par::Rayon => rayon::current_num_threads(),
            Par::External(p) => p.num_threads().max(1),
        }
    }

    /// Calls `f(i)` once for every task `i` in `0..n_tasks`, possibly in parallel.
    pub fn for_each(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        match self {
            _ if n_tasks <= 1 => (0..n_tasks).for_each(f),
            Par::Seq => (0..n_tasks).for_each(f),
            Par::Rayon => (0..n_tasks).into_par_iter().for_each(f),
            Par::External(p) => p.parallel_for(n_tasks, 1, &|r: Range<usize>| r.for_each(f)),
        }
    }
}

/// Splits `rows` rows of `cols` elements into blocks for parallel work: at
/// most a few blocks per thread, and none smaller than `min_elems` elements
/// (so small inputs stay on one thread, without asking `par` for its thread
/// count). Returns rows per block (>= 1).
pub(crate) fn rows_per_block(par: &Par<'_>, rows: usize, cols: usize, min_elems: usize) -> usize {
    // One block when two would not both reach the minimum, decided before
    // asking the pool for its thread count (which may cost a call into it).
    if rows <= 1 || rows.saturating_mul(cols) < min_elems.saturating_mul(2) {
        return rows.max(1);
    }
    let threads = par.num_threads();
    if threads <= 1 {
        return rows;
    }
    let min_rows = min_elems.div_ceil(cols.max(1)).max(1);
    let even = rows.div_ceil(threads * 4);
    even.max(min_rows).min(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Chunky;
    impl ParallelFor for Chunky {
        fn num_threads(&self) -> usize {
            3
        }
        fn parallel_for(&self, n: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
            let step = grain.max(2);
            let mut s = 0;
            while s < n {
                f(s..(s + step).min(n));
                s += step;
            }
        }
    }

    #[test]
    fn every_task_runs_once_under_each_parallelism() {
        for par in [Par::Seq, Par::Rayon, Par::External(&Chunky)] {
            for n in [0usize, 1, 2, 7, 64] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                par.for_each(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{par:?} n={n}");
            }
        }
    }

    #[test]
    fn blocks_cover_rows_and_respect_minimum() {
        assert_eq!(rows_per_block(&Par::Seq, 100, 10, 1), 100);
        assert_eq!(rows_per_block(&Par::External(&Chunky), 1000, 4096, 1), 84);
        assert_eq!(rows_per_block(&Par::External(&Chunky), 10, 16, 1 << 14), 10);
        assert_eq!(rows_per_block(&Par::External(&Chunky), 0, 16, 1), 1);
    }
}
