//! One module per operator, each with CPU entry points (over slices) and CUDA
//! entry points (over `cudarc` buffers, or raw device pointers for callers that
//! own their memory, such as the torch operators).
pub mod cross_entropy;
pub mod fused_add_rms_norm;
pub mod gated;
pub mod layer_norm;
pub mod rms_norm;
pub mod rotary;
pub mod softmax;

#[cfg(test)]
mod emu_tests;

use crate::cuda::{rows_config_packs, Arg, Module, NormKeep, Target};
use crate::error::{Error, Result};
use cudarc::driver::LaunchConfig;

/// The row kernels take `cols` as a C `int`.
pub(crate) fn check_cols(op: &'static str, rows: usize, cols: usize) -> Result<()> {
    if cols > i32::MAX as usize {
        return Err(Error::Invalid { op, arg: "cols", msg: format!("{cols} exceeds the kernel's limit of 2^31-1") });
    }
    if cols == 0 && rows != 0 {
        return Err(Error::Invalid { op, arg: "cols", msg: "is 0 but rows is not".into() });
    }
    Ok(())
}

/// `Err` naming `arg` of `op` unless a buffer's length `got` is `want`.
pub(crate) fn check_len(op: &'static str, arg: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(Error::Invalid { op, arg, msg: format!("has length {got}, expected {want}") })
}

/// Most blocks an SM of a backward that sums a parameter gradient over rows.
const REDUCE_BLOCKS_PER_SM: u32 = 4;

/// Blocks (and rows of f32 partial sums) of a backward that reduces a
/// parameter gradient over rows, at most: [`REDUCE_BLOCKS_PER_SM`] per SM, at
/// most one per row. Sizes the scratch; [`reduce_config`] picks the number.
pub(crate) fn reduce_parts(sm_count: u32, rows: usize) -> usize {
    rows.min((sm_count * REDUCE_BLOCKS_PER_SM) as usize)
}

/// Most threads in a block of a backward that sums a parameter gradient
/// (the `__launch_bounds__` of those kernels in kernels-cuda/).
const REDUCE_THREADS: u32 = 512;

/// The launch of a backward that sums a parameter gradient over rows, and its
/// number of parts (blocks, and rows of f32 partial sums):
/// [`rows_config`](crate::cuda::rows_config)'s block, at most
/// [`REDUCE_THREADS`] threads, and as many blocks as stay resident together
/// (512 threads' worth an SM, at most [`REDUCE_BLOCKS_PER_SM`]), so that each
/// keeps its partial sums in registers through all its rows. The parts are
/// at most [`reduce_parts`], which sizes the scratch.
fn reduce_config(sm_count: u32, rows: usize, cols: usize, elem_bytes: usize) -> (LaunchConfig, usize) {
    reduce_launch(sm_count, rows, cols, elem_bytes, 4, REDUCE_THREADS, REDUCE_THREADS)
}

/// The launch of a backward kernel that keeps its partial sums across its
/// rows, and its number of parts: about `packs` 16-byte vectors a thread, at
/// most `block_threads` threads a block, and as many blocks as `sm_threads`
/// threads an SM hold (at most [`REDUCE_BLOCKS_PER_SM`], which the scratch
/// of [`reduce_parts`] holds), so that every block is resident at once.
fn reduce_launch(
    sm_count: u32,
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    packs: usize,
    block_threads: u32,
    sm_threads: u32,
) -> (LaunchConfig, usize) {
    let mut cfg = rows_config_packs(rows, cols, elem_bytes, 1, packs);
    cfg.block_dim.0 = cfg.block_dim.0.min(block_threads);
    let per_sm = (sm_threads / cfg.block_dim.0).clamp(1, REDUCE_BLOCKS_PER_SM);
    let parts = rows.min((sm_count * per_sm) as usize);
    cfg.grid_dim.0 = parts.max(1) as u32;
    (cfg, parts)
}

/// Most 16-byte vectors in a row that the four-vector held backward kernels
/// (`*_bwd4h_f32`) take: 256 threads of four (their `__launch_bounds__(256, 2)`).
const FOUR_HELD_VECS: usize = 1024;

/// Most 16-byte vectors in a row that the two-vector backward kernels
/// (`layer_norm_bwd2_*`, `rms_norm_bwd2_*`) take: 256 threads of two (their
/// `__launch_bounds__`).
const TWO_PACK_VECS: usize = 512;

/// Which kernel runs a norm's backward that sums a parameter gradient over
/// rows (`{op}_{stem}_{dtype}`, the stem from [`NormBackward::stem`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NormBackward {
    /// `*_bwd_*`: about four vectors a thread, up to 512 threads a block.
    Four,
    /// `*_bwd2_*`: rows of at most [`TWO_PACK_VECS`] vectors, about two a
    /// thread, three blocks of 256 an SM; each row read twice (the sums,
    /// then the write of dx).
    Two,
    /// `*_bwd2h_*`: as [`NormBackward::Two`], each row held in registers as
    /// loaded and read once, `w` loaded once a block; 118-128 registers a
    /// thread, so two blocks of 256 an SM. The default ([`Target::norm_keep`];
    /// docs/GPU.md, run 20).
    TwoHeld,
    /// `*_bwd2s_*`: each row held as loaded, the parameter gradients' sums in
    /// shared memory (16 KB a block for rms_norm, 32 KB for layer_norm), `w`
    /// read where used: 72-80 registers, three blocks of 256 an SM as
    /// [`NormBackward::Two`]; on an H200, 0.95-0.99x the time of
    /// [`NormBackward::Two`] in bf16, where [`NormBackward::TwoHeld`] took 0.85-0.99x.
    TwoHeldShared,
    /// `*_bwd4h_f32`, f32 alone: as [`NormBackward::TwoHeld`] with up to four
    /// vectors a thread (rows of at most [`FOUR_HELD_VECS`] vectors: 4096
    /// f32), 122-127 registers, at most 256 threads a block and 512 an SM.
    /// Not yet timed on a GPU.
    FourHeld,
}

impl NormBackward {
    /// The kernel's name between the op's and the dtype's: `bwd`, `bwd2`,
    /// `bwd2h`, `bwd2s`, `bwd4h`.
    pub(crate) fn stem(self) -> &'static str {
        match self {
            NormBackward::Four => "bwd",
            NormBackward::Two => "bwd2",
            NormBackward::TwoHeld => "bwd2h",
            NormBackward::TwoHeldShared => "bwd2s",
            NormBackward::FourHeld => "bwd4h",
        }
    }
}

/// The launch of a norm's backward that sums a parameter gradient over rows:
/// its config, its number of parts, and its kernel: the two-vector one for
/// rows of at most [`TWO_PACK_VECS`] vectors, keeping them as `keep` says
/// (through [`reduce_config_two_packs`], or [`reduce_config_held`] for
/// [`NormKeep::Held`]), else the four-vector one ([`reduce_config`]; for
/// [`NormKeep::Held`], f32 rows of at most [`FOUR_HELD_VECS`] vectors take
/// [`NormBackward::FourHeld`], two or more blocks an SM). On
/// an H100 the two-vector kernels took bf16 4096x4096 in 81.0 us
/// (layer_norm) and 54.9 (rms_norm), against 92.8 and 57.7 (docs/GPU.md,
/// run 17).
pub(crate) fn norm_backward_config(
    sm_count: u32,
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    keep: NormKeep,
) -> (LaunchConfig, usize, NormBackward) {
    let vecs = cols.div_ceil(16 / elem_bytes);
    if vecs > TWO_PACK_VECS {
        if keep == NormKeep::Held && elem_bytes == 4 && vecs <= FOUR_HELD_VECS {
            let (cfg, parts) = reduce_config_four_held(sm_count, rows, cols, elem_bytes);
            return (cfg, parts, NormBackward::FourHeld);
        }
        let (cfg, parts) = reduce_config(sm_count, rows, cols, elem_bytes);
        return (cfg, parts, NormBackward::Four);
    }
    let ((cfg, parts), kernel) = match keep {
        NormKeep::Reload => (reduce_config_two_packs(sm_count, rows, cols, elem_bytes), NormBackward::Two),
        NormKeep::Held => (reduce_config_held(sm_count, rows, cols, elem_bytes), NormBackward::TwoHeld),
        NormKeep::HeldShared => {
            (reduce_config_two_packs(sm_count, rows, cols, elem_bytes), NormBackward::TwoHeldShared)
        }
    };
    (cfg, parts, kernel)
}

/// The launch of a held four-vector backward kernel (`*_bwd4h_f32`), and its
/// number of parts: about four vectors a thread, at most 256 threads a block
/// and 512 an SM (their `__launch_bounds__(256, 2)`), so that every block is
/// resident at once.
fn reduce_config_four_held(sm_count: u32, rows: usize, cols: usize, elem_bytes: usize) -> (LaunchConfig, usize) {
    reduce_launch(sm_count, rows, cols, elem_bytes, 4, 256, 512)
}

/// The launch of a held two-vector backward kernel (`*_bwd2h_*`), and its
/// number of parts: as [`reduce_config_two_packs`], two blocks of 256 an SM
/// (512 threads: their `__launch_bounds__(256, 2)`), so that every block is
/// resident at once.
fn reduce_config_held(sm_count: u32, rows: usize, cols: usize, elem_bytes: usize) -> (LaunchConfig, usize) {
    reduce_launch(sm_count, rows, cols, elem_bytes, 2, 256, 512)
}

/// The launch of a two-vector backward kernel (`layer_norm_bwd2_*`, rows of at
/// most [`TWO_PACK_VECS`] vectors), and its number of parts: about two
/// vectors a thread, so half the partial sums a thread of [`reduce_config`]'s
/// holds, and three blocks of 256 an SM (768 threads, 512 in
/// [`reduce_config`]); at most [`REDUCE_BLOCKS_PER_SM`] an SM, which the
/// scratch of [`reduce_parts`] holds.
fn reduce_config_two_packs(sm_count: u32, rows: usize, cols: usize, elem_bytes: usize) -> (LaunchConfig, usize) {
    reduce_launch(sm_count, rows, cols, elem_bytes, 2, 256, 768)
}

/// Launches the `sum_parts` kernel `kernel` of `module`:
/// `out[j] = sum_p partial[p * cols + j]`.
///
/// # Safety
/// `partial` must hold `parts * cols` f32s and `out` `cols` elements of the
/// kernel's type, on `t`.
pub(crate) unsafe fn sum_parts(
    t: &dyn Target,
    module: Module,
    kernel: &str,
    partial: u64,
    out: u64,
    parts: usize,
    cols: usize,
) -> Result<()> {
    // 32 columns a block, its 8 warps over the parts (common.cuh's sum_parts).
    let cfg = LaunchConfig { grid_dim: (cols.div_ceil(32) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let args = [Arg::Ptr(partial), Arg::Ptr(out), Arg::I32(parts as i32), Arg::I32(cols as i32)];
    // SAFETY: matches the sum_parts kernels; sizes per this function's contract.
    unsafe { t.launch(module, kernel, cfg, &args) }
}

#[cfg(test)]
mod tests {
    use super::{
        norm_backward_config, reduce_config, reduce_config_four_held, reduce_config_held, reduce_config_two_packs,
        reduce_parts, NormBackward, NormKeep, FOUR_HELD_VECS, REDUCE_THREADS, TWO_PACK_VECS,
    };

    /// The norms' backward takes the two-vector kernel up to
    /// [`TWO_PACK_VECS`] vectors a row (keeping rows as asked) and the four-vector
    /// one beyond: bf16 rows of 4096 and f32 rows of 2048 are two-vector, f32
    /// 4096 is not.
    #[test]
    fn norm_backward_config_picks_by_row_vectors() {
        for elem in [2usize, 4] {
            let per = 16 / elem;
            for (cols, two) in [(1, true), (TWO_PACK_VECS * per, true), (TWO_PACK_VECS * per + 1, false)] {
                for keep in [NormKeep::Reload, NormKeep::Held, NormKeep::HeldShared] {
                    let (cfg, parts, got) = norm_backward_config(132, 4096, cols, elem, keep);
                    let (kernel, want) = match (two, keep) {
                        (false, NormKeep::Held) if elem == 4 => {
                            (NormBackward::FourHeld, reduce_config_four_held(132, 4096, cols, elem))
                        }
                        (false, _) => (NormBackward::Four, reduce_config(132, 4096, cols, elem)),
                        (true, NormKeep::Reload) => (NormBackward::Two, reduce_config_two_packs(132, 4096, cols, elem)),
                        (true, NormKeep::Held) => (NormBackward::TwoHeld, reduce_config_held(132, 4096, cols, elem)),
                        (true, NormKeep::HeldShared) => {
                            (NormBackward::TwoHeldShared, reduce_config_two_packs(132, 4096, cols, elem))
                        }
                    };
                    assert_eq!(got, kernel, "{cols} cols of {elem} bytes, {keep:?}");
                    assert_eq!((cfg.block_dim, cfg.grid_dim, parts), (want.0.block_dim, want.0.grid_dim, want.1));
                }
            }
        }
        assert_eq!(norm_backward_config(132, 8, 4096, 2, NormKeep::Reload).2, NormBackward::Two);
        assert_eq!(norm_backward_config(132, 8, 2048, 4, NormKeep::Held).2, NormBackward::TwoHeld);
        assert_eq!(norm_backward_config(132, 8, 4096, 4, NormKeep::HeldShared).2, NormBackward::Four);
        // The four-vector held kernel: f32 rows of 513 to 1024 vectors, and no 16-bit ones.
        assert_eq!(norm_backward_config(132, 8, 4096, 4, NormKeep::Held).2, NormBackward::FourHeld);
        assert_eq!(norm_backward_config(132, 8, 4100, 4, NormKeep::Held).2, NormBackward::Four);
        assert_eq!(norm_backward_config(132, 8, 8192, 2, NormKeep::Held).2, NormBackward::Four);
        let kernels = [
            NormBackward::Four,
            NormBackward::Two,
            NormBackward::TwoHeld,
            NormBackward::TwoHeldShared,
            NormBackward::FourHeld,
        ];
        assert_eq!(kernels.map(NormBackward::stem), ["bwd", "bwd2", "bwd2h", "bwd2s", "bwd4h"]);
    }

    /// The four-vector held launch (f32 rows of more than [`TWO_PACK_VECS`]
    /// and at most [`FOUR_HELD_VECS`] vectors) stays within its kernels'
    /// `__launch_bounds__(256, 2)` (at most 512 threads an SM, so that every
    /// block is resident) and the scratch, each thread holding at most four
    /// vectors of a row.
    #[test]
    fn four_held_launch_fits_its_bounds_and_scratch() {
        for sm in [1u32, 8, 132] {
            for rows in [0usize, 1, 7, 100, 4096, 1 << 20] {
                for vecs in [TWO_PACK_VECS + 1, 600, 640, 1000, FOUR_HELD_VECS] {
                    let (cfg, parts, kernel) = norm_backward_config(sm, rows, vecs * 4, 4, NormKeep::Held);
                    assert_eq!(kernel, NormBackward::FourHeld);
                    let threads = cfg.block_dim.0 as usize;
                    assert!(threads <= 256 && threads.is_multiple_of(32), "{threads} threads");
                    assert!(vecs <= 4 * threads, "{vecs} vectors over {threads} threads");
                    assert!(parts <= reduce_parts(sm, rows) && parts <= rows, "{parts} parts");
                    assert_eq!(cfg.grid_dim.0 as usize, parts.max(1));
                    let per_sm = parts.div_ceil(sm as usize);
                    assert!(per_sm * threads <= 512 || per_sm == 1, "{per_sm} blocks of {threads}");
                }
            }
        }
    }

    /// The held launch: the two-vector kernel's blocks, two of them an SM
    /// (its `__launch_bounds__(256, 2)`), within the scratch, each thread
    /// holding at most two vectors of a row.
    #[test]
    fn reduce_config_held_fits_its_bounds_and_scratch() {
        for sm in [1u32, 8, 132] {
            for rows in [0usize, 1, 7, 100, 4096, 1 << 20] {
                for elem in [2usize, 4] {
                    for vecs in [1usize, 31, 64, 300, TWO_PACK_VECS] {
                        let cols = vecs * (16 / elem);
                        let (cfg, parts) = reduce_config_held(sm, rows, cols, elem);
                        let two = reduce_config_two_packs(sm, rows, cols, elem).0;
                        let threads = cfg.block_dim.0 as usize;
                        assert_eq!(cfg.block_dim, two.block_dim);
                        assert!(vecs <= 2 * threads, "{vecs} vectors over {threads} threads");
                        assert!(parts <= reduce_parts(sm, rows) && parts <= rows, "{parts} parts");
                        assert_eq!(cfg.grid_dim.0 as usize, parts.max(1));
                        let per_sm = parts.div_ceil(sm as usize);
                        assert!(per_sm * threads <= 512 || per_sm == 1, "{per_sm} blocks of {threads}");
                    }
                }
            }
        }
    }

    /// The two-vector launch stays within its kernels' `__launch_bounds__(256,
    /// 3)` and the scratch, and gives each thread at most two vectors of
    /// every row it takes ([`TWO_PACK_VECS`]), so that the kernel keeps its
    /// partial sums in registers.
    #[test]
    fn reduce_config_two_packs_fits_its_bounds_and_scratch() {
        for sm in [1u32, 8, 132] {
            for rows in [0usize, 1, 7, 100, 4096, 1 << 20] {
                for elem in [2usize, 4] {
                    for vecs in [1usize, 31, 64, 300, TWO_PACK_VECS] {
                        let cols = vecs * (16 / elem);
                        let (cfg, parts) = reduce_config_two_packs(sm, rows, cols, elem);
                        let threads = cfg.block_dim.0 as usize;
                        assert!(threads <= 256 && threads.is_multiple_of(32), "{threads} threads");
                        assert!(vecs <= 2 * threads, "{vecs} vectors over {threads} threads");
                        assert!(parts <= reduce_parts(sm, rows) && parts <= rows, "{parts} parts");
                        assert_eq!(cfg.grid_dim.0 as usize, parts.max(1));
                        let per_sm = parts.div_ceil(sm as usize);
                        assert!(per_sm * threads <= 768 || per_sm == 1, "{per_sm} blocks of {threads}");
                    }
                }
            }
        }
    }

    /// The backward launch stays within its kernels' `__launch_bounds__`, its
    /// parts within the scratch that `reduce_parts` sizes, and its blocks
    /// within what an SM holds at once (512 threads' worth, at most four).
    #[test]
    fn reduce_config_fits_its_bounds_and_scratch() {
        for sm in [1u32, 8, 132] {
            for rows in [0usize, 1, 7, 100, 4096, 1 << 20] {
                for cols in [1usize, 64, 300, 4096, 8192, 20000, 65536] {
                    for elem in [2usize, 4] {
                        let (cfg, parts) = reduce_config(sm, rows, cols, elem);
                        let threads = cfg.block_dim.0;
                        assert!(threads <= REDUCE_THREADS && threads % 32 == 0, "{threads} threads");
                        assert!(parts <= reduce_parts(sm, rows) && parts <= rows, "{parts} parts");
                        assert_eq!(cfg.grid_dim.0 as usize, parts.max(1));
                        let per_sm = parts.div_ceil(sm as usize);
                        assert!(per_sm * threads as usize <= 512 || per_sm == 1, "{per_sm} blocks of {threads}");
                        if rows > 0 {
                            assert!(parts >= 1);
                        }
                    }
                }
            }
        }
    }
}
