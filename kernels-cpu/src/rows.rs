//! The shared skeleton of the row kernels: blocks of whole rows spread over a
//! [`Par`], and each block's own piece of every output.
//!
//! Each block's output is faulted in at once before it is written, when the
//! output is fresh memory (see [`crate::prefault`]; decided once per output);
//! then it is written with ordinary stores. Non-temporal (streaming) stores
//! were tried for large outputs, twice, and were slower: before the prefault, rms_norm f32 4096x4096 into a fresh
//! tensor took 5.2 ms against 4.3 ms with huge pages, and 1.35x against 1.15x
//! of `x.clone()` without; with it, 0.97x as fast without huge pages and 0.85x
//! with them.
use crate::element::{Acc, Element};
use crate::par::{rows_per_block, Par};
use crate::prefault;
use crate::simd::dispatch;
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};

/// Below this many elements per block, work stays on one thread.
pub(crate) const MIN_BLOCK_ELEMS: usize = 1 << 15;

/// How `rows` rows are cut into blocks for a [`Par`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Blocks {
    rows: usize,
    /// Rows per block (the last block may have fewer).
    pub per: usize,
    /// Number of blocks (0 when there are no rows).
    pub count: usize,
}

impl Blocks {
    /// Blocks of at least [`MIN_BLOCK_ELEMS`] elements of `cols`-wide rows.
    pub(crate) fn new(par: &Par<'_>, rows: usize, cols: usize) -> Blocks {
        let per = rows_per_block(par, rows, cols, MIN_BLOCK_ELEMS);
        Blocks { rows, per, count: rows.div_ceil(per) }
    }

    /// The rows of block `b`.
    pub(crate) fn rows(&self, b: usize) -> Range<usize> {
        b * self.per..((b + 1) * self.per).min(self.rows)
    }
}

/// A mutable slice cut into consecutive chunks, one per parallel task, each
/// taken by exactly one task.
pub(crate) struct Split<'a, T> {
    chunks: Chunks<'a, T>,
    /// Whether the slice was found fresh (see [`prefault::fresh`]): only then
    /// is each chunk populated as it is taken.
    fresh: bool,
}

enum Chunks<'a, T> {
    /// The whole slice as one chunk: small inputs, with no heap allocation.
    One([Mutex<&'a mut [T]>; 1]),
    /// Several chunks.
    Many(Vec<Mutex<&'a mut [T]>>),
}

impl<'a, T: 'static> Split<'a, T> {
    /// Chunks of `chunk` elements (the last may be shorter).
    pub(crate) fn new(s: &'a mut [T], chunk: usize) -> Self {
        let fresh = prefault::fresh(s);
        let chunks = if s.len() <= chunk {
            Chunks::One([Mutex::new(s)])
        } else {
            Chunks::Many(s.chunks_mut(chunk.max(1)).map(Mutex::new).collect())
        };
        Split { chunks, fresh }
    }

    /// Chunk `b`, its pages faulted in where the slice is fresh (see
    /// [`prefault`]). Each task takes only its own chunk, so the lock never
    /// waits.
    pub(crate) fn get(&self, b: usize) -> MutexGuard<'_, &'a mut [T]> {
        let mut g = self.lock(b);
        if self.fresh {
            prefault::prefault(&mut g, false);
        }
        g
    }

    /// [`get`](Split::get) for a kernel that can write its rows in either
    /// [`Order`]: also the order to write chunk `b` in, descending where the
    /// chunk holds bf16 on fresh huge pages and the explicit kernels round
    /// it in registers ([`descends`]; see [`Order`] for why, and why not
    /// otherwise).
    pub(crate) fn get_ordered(&self, b: usize) -> (MutexGuard<'_, &'a mut [T]>, Order) {
        if !descends::<T>() {
            return (self.get(b), Order::Ascending);
        }
        self.get_descending_on_huge(b)
    }

    /// [`get_ordered`](Split::get_ordered) for a kernel that gains from the
    /// descending order in every type: chunk `b`, and
    /// [`Order::Descending`] wherever it is fresh on huge pages. Rotary's
    /// tiles of a transposed q, whose stores go head by head across a
    /// tile's rows (see `rotary::rotate_tiles`).
    pub(crate) fn get_descending_on_huge(&self, b: usize) -> (MutexGuard<'_, &'a mut [T]>, Order) {
        let mut g = self.lock(b);
        let huge = self.fresh && prefault::prefault(&mut g, true) == prefault::Pages::Huge;
        #[cfg(test)]
        DESCENDED.fetch_add(huge as usize, std::sync::atomic::Ordering::Relaxed);
        (g, if huge { Order::Descending } else { Order::Ascending })
    }

    fn lock(&self, b: usize) -> MutexGuard<'_, &'a mut [T]> {
        let chunks: &[Mutex<&'a mut [T]>] = match &self.chunks {
            Chunks::One(c) => c,
            Chunks::Many(c) => c,
        };
        chunks[b].lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How many blocks [`Split::get_ordered`] has chosen to write descending:
/// tests check that a case meant to take that path does.
#[cfg(test)]
pub(crate) static DESCENDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether a block of `T` on fresh huge pages is written descending: bf16
/// where the explicit kernels round it in registers (AVX-512 with
/// AVX512-BF16), so that each row is stored as one falling stream. Not f16
/// nor bf16 on AVX2, whose rows go through blocks of f32 (each block's
/// values narrowed in ascending order): gated backward f16 took 1.35-1.49x
/// as long descending, and the f16 forwards gained nothing (rms_norm 0.98,
/// layer_norm 1.05, silu_and_mul 1.04; see [`Order`]).
fn descends<T: 'static>() -> bool {
    crate::wide::is::<T, half::bf16>() && crate::simd::has_v4_bf16()
}

/// The order in which a kernel stores a block's rows, and each row's
/// values: the values are the same either way (only the order of the
/// stores changes, never that of a sum).
///
/// Fresh huge pages can go faster from the top down. Linux zeroes a huge
/// page at its first store, mostly in ascending order (Linux 6.x: the few
/// pages about the faulting address last), so its top lines are the ones
/// most likely still in cache: written from the bottom up, the stores meet
/// the lines zeroed first; from the top down, those zeroed last. In a plain
/// loop on the 2-core Zen 4 VM (Linux 6.18), `y = x * c` over 64 MiB of
/// fresh huge pages from two threads took 5.5-6.8 ms upwards and 3.8-5.1
/// ms downwards, as fast as glibc's `memcpy` there (3.7-5.3 ms; it copies
/// downwards when source and destination share page offsets).
///
/// Through torch with `THP_MEM_ALLOC_ENABLE=1`, both orders in one process,
/// interleaved (4096 rows, two rounds, time descending over ascending):
/// rms_norm bf16 0.88-0.89, layer_norm bf16 0.92-0.95, silu_and_mul bf16
/// 0.89, gelu_and_mul tanh bf16 0.90-0.92, QK-norm bf16 (strided rows)
/// 1.00. f32 did not gain: rms_norm 0.98, layer_norm 1.01, silu_and_mul
/// 1.03 (a gated row is one pass, which then also reads its inputs
/// downwards, and f32 is bound by memory). Without huge pages, where
/// [`prefault`] populates a block before it is written, nothing gained
/// (bf16 1.00-1.01) and QK-norm lost (1.09). Memory already there goes a
/// little faster ascending (the hardware prefetchers). The gated backward
/// (bf16, 4096 rows of 8192, `dx` twice that) gained the same: silu
/// 0.86-0.88, gelu tanh 0.88-0.89. f16, whose rows go through blocks of
/// f32 narrowed in ascending order, gained nothing in the forwards
/// (rms_norm 0.98, layer_norm 1.05, silu_and_mul 1.04) and lost in the
/// gated backward (1.35-1.49), whose blocks also read ascending. So a
/// kernel writes a block descending only where it holds bf16 on fresh huge
/// pages and rounds it in registers ([`Split::get_ordered`]). Rotary's
/// tiles of a transposed q are the exception: they gain in every type
/// ([`Split::get_descending_on_huge`]; f32 0.87-0.91, f16 0.91).
///
/// Measured again (session 69, the same kind of Zen 4 VM, a Rust harness:
/// 4096 rows, two threads, fresh huge pages, the order switched at run time,
/// interleaved, medians of 31), with and without the write-ahead prefetch:
/// ascending took 1.13-1.22x as long for rms_norm bf16, 1.09-1.13x for
/// layer_norm, 1.11-1.17x for silu_and_mul and 1.16-1.21x for its backward;
/// fused_add_rms_norm 0.99-1.01. On the Xeon VM ascending was 1-6% faster
/// (BENCHMARKS.md, sessions 62-63). Descending costs the Xeon that much,
/// ascending would cost the Zen 4 several times more: one order for every
/// CPU, descending.
///
/// The norms' backwards stay ascending. rms_norm's bf16 backward, tried
/// descending on the Zen 4 (session 72, the same kind of harness, 4096 rows
/// of 4096), was slower in every variant and every kind of output: rows and
/// their parts descending 1.27-1.33x the time on fresh huge pages and 1.7x
/// into reused memory, rows alone 1.09-1.11x. Its rows are read twice (sums,
/// then the write pass) beside the weight and an f32 `dw` partial, more
/// than L1 holds, and those reads lose more going down than the stores gain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// From the first row (and value) up.
    Ascending,
    /// From the last row (and value) down.
    Descending,
}

impl Order {
    /// Calls `f` on each of `0..n` in this order. Plain loops calling `f`
    /// itself: through `for_each(&mut f)` the call went through `&mut F`'s
    /// `FnMut` shim, which LLVM left out of line (compiled without the
    /// kernel's target features, every intrinsic a call: layer_norm 7x
    /// slower).
    #[inline(always)]
    pub(crate) fn each(self, n: usize, mut f: impl FnMut(usize)) {
        match self {
            Order::Ascending => {
                for i in 0..n {
                    f(i);
                }
            }
            Order::Descending => {
                for i in (0..n).rev() {
                    f(i);
                }
            }
        }
    }
}

/// Row `r` of `s` (rows of `cols`) and the row the kernel takes after it in
/// `order` (empty after the last): a row and what its kernel prefetches
/// while it works on it.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn row_and_after<T>(s: &[T], r: usize, cols: usize, order: Order) -> (&[T], &[T]) {
    match order {
        Order::Ascending => row_and_next(s, r, cols),
        Order::Descending => (&s[r * cols..][..cols], if r > 0 { &s[(r - 1) * cols..][..cols] } else { &[] }),
    }
}

/// Both orders, for tests that run a kernel each way.
#[cfg(test)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const ORDERS: [Order; 2] = [Order::Ascending, Order::Descending];

/// The next row, from the rest of a block after a row (empty after the last):
/// what the row kernels prefetch while they work on the current row.
#[inline(always)]
pub(crate) fn next_row<T>(rest: &[T], cols: usize) -> &[T] {
    &rest[..rest.len().min(cols)]
}

/// Row `r` of `s` (rows of `cols`) and the row after it (empty after the
/// last): a row and what its kernel prefetches while it works on it.
#[inline(always)]
pub(crate) fn row_and_next<T>(s: &[T], r: usize, cols: usize) -> (&[T], &[T]) {
    let (row, rest) = s[r * cols..].split_at(cols);
    (row, next_row(rest, cols))
}

/// `out[j] = sum over blocks b of partial[b * cols + j]`, in block order
/// (deterministic for a given block count); zeros when there are no blocks.
///
/// Columns go in groups of [`SUM_GROUP`], each summed over the blocks in a
/// local array: a loop over the blocks for each column went down a column
/// with a stride, one scalar add at a time, and divided to count the blocks
/// every time (perf: 8% of layer_norm's backward of 128 rows of 4096).
pub(crate) fn sum_partials<T: Element>(partial: &[T::Acc], out: &mut [T], cols: usize) {
    dispatch(
        #[inline(always)]
        || {
            for (g, out) in out.chunks_mut(SUM_GROUP).enumerate() {
                let (at, n) = (g * SUM_GROUP, out.len());
                let mut s = [T::Acc::ZERO; SUM_GROUP];
                for p in partial.chunks_exact(cols) {
                    for (s, v) in s[..n].iter_mut().zip(&p[at..][..n]) {
                        *s = *s + *v;
                    }
                }
                for (o, s) in out.iter_mut().zip(&s[..n]) {
                    *o = T::from_acc(*s);
                }
            }
        },
    );
}

/// Columns summed together by [`sum_partials`].
const SUM_GROUP: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_all_rows_once() {
        for rows in [0usize, 1, 5, 1000] {
            let b = Blocks::new(&Par::Rayon, rows, 4096);
            let covered: Vec<usize> = (0..b.count).flat_map(|i| b.rows(i)).collect();
            assert_eq!(covered, (0..rows).collect::<Vec<_>>());
        }
    }

    /// The grouped sums are the column-by-column ones, bit for bit, in f32
    /// and through bf16's rounding, for 0 to 3 blocks and widths around the
    /// group size (and none).
    #[test]
    fn partials_sum_in_block_order() {
        for cols in [0usize, 1, 63, 64, 65, 200] {
            for blocks in 0..4 {
                let partial: Vec<f32> =
                    (0..blocks * cols).map(|i| ((i * 31 % 17) as f32 - 8.0) / 3.0 + 1e7 * (i % 2) as f32).collect();
                let want: Vec<f32> =
                    (0..cols).map(|j| partial.chunks_exact(cols.max(1)).fold(0.0f32, |s, p| s + p[j])).collect();
                let mut out = vec![f32::NAN; cols];
                sum_partials::<f32>(&partial, &mut out, cols);
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&want), "cols={cols} blocks={blocks}");
                let mut out16 = vec![half::bf16::NAN; cols];
                sum_partials::<half::bf16>(&partial, &mut out16, cols);
                assert!(out16.iter().zip(&want).all(|(o, w)| *o == half::bf16::from_f32(*w)), "bf16 cols={cols}");
            }
        }
    }
}
