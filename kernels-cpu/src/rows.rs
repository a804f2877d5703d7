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

impl<'a, T> Split<'a, T> {
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
        let chunks: &[Mutex<&'a mut [T]>] = match &self.chunks {
            Chunks::One(c) => c,
            Chunks::Many(c) => c,
        };
        let mut g = chunks[b].lock().unwrap_or_else(|e| e.into_inner());
        if self.fresh {
            prefault::prefault(&mut g);
        }
        g
    }
}

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
