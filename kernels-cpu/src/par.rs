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
    ///
    /// Called from a thread outside the pool (the usual case: a program's
    /// main thread), the call cannot take part in the work: it queues the
    /// blocks, wakes the pool's threads and sleeps until they are done, two
    /// handoffs between threads per call. Work is then split only into
    /// blocks of at least [`OUTSIDE_POOL_MIN_ELEMS`] elements, so that small
    /// calls run on the calling thread. Inside the pool (in `install`, or a
    /// parallel iterator's closure) the usual minimum applies.
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

/// The fewest elements per block where [`Par::Rayon`] is used from a thread
/// outside rayon's pool.
///
/// Measured on the 2-core CI machine (a VM; rms_norm and rotary forward,
/// f32 and bf16, `[rows, 4096]`, `Par::Seq` against `Par::Rayon` called
/// from the main thread, alternated, medians of 600): rayon took 2.1-3.9x
/// as long at 64K elements (17 against 36 us for rms_norm f32 into a fresh
/// output; rotary 26 against 102 us), 0.8-2.3x at 128K-512K (over 1.4x in
/// 9 of the 12 fresh-output cases), about as long at 1M, and 0.7x at 2M
/// with an output written before. Under torch's own
/// pool, whose calling thread works too, two threads were 1.2-2.7x faster
/// from 64K elements on, so this minimum is for rayon from outside only.
pub const OUTSIDE_POOL_MIN_ELEMS: usize = 1 << 18;

/// Splits `rows` rows of `cols` elements into blocks for parallel work: at
/// most a few blocks per thread, and none smaller than `min_elems` elements
/// (or [`OUTSIDE_POOL_MIN_ELEMS`], for rayon from outside its pool), so that
/// small inputs stay on one thread, without asking `par` for its thread
/// count. Returns rows per block (>= 1).
pub(crate) fn rows_per_block(par: &Par<'_>, rows: usize, cols: usize, min_elems: usize) -> usize {
    let min_elems = match par {
        Par::Rayon if rayon::current_thread_index().is_none() => min_elems.max(OUTSIDE_POOL_MIN_ELEMS),
        _ => min_elems,
    };
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
    fn rayon_from_outside_its_pool_splits_only_large_work() {
        let cols = 4096;
        let small = OUTSIDE_POOL_MIN_ELEMS * 2 / cols - 1;
        // This test's thread is outside rayon's pool: one block.
        assert_eq!(rows_per_block(&Par::Rayon, small, cols, 1 << 15), small);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        // Inside a pool the usual minimum applies: several blocks.
        let inside = pool.install(|| rows_per_block(&Par::Rayon, small, cols, 1 << 15));
        assert_eq!(inside, small.div_ceil(8));
        // Large work is split from outside too.
        let large = 16 * OUTSIDE_POOL_MIN_ELEMS / cols;
        assert!(rows_per_block(&Par::Rayon, large, cols, 1 << 15) < large || rayon::current_num_threads() == 1);
        // A caller's own pool keeps the given minimum.
        assert_eq!(rows_per_block(&Par::External(&Chunky), small, cols, 1 << 15), 11);
    }

    #[test]
    fn blocks_cover_rows_and_respect_minimum() {
        assert_eq!(rows_per_block(&Par::Seq, 100, 10, 1), 100);
        assert_eq!(rows_per_block(&Par::External(&Chunky), 1000, 4096, 1), 84);
        assert_eq!(rows_per_block(&Par::External(&Chunky), 10, 16, 1 << 14), 10);
        assert_eq!(rows_per_block(&Par::External(&Chunky), 0, 16, 1), 1);
    }
}
