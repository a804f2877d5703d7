//! The one place kernels are launched: NVTX range (feature `nvtx`), argument
//! packing, and the error mapping.
use super::{DType, Gpu};
use crate::error::{driver, Result};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

/// A kernel argument: device pointers are passed as `u64`.
pub(crate) enum Arg {
    /// A device pointer (0 for "none").
    Ptr(u64),
    /// `int64_t`
    I64(i64),
    /// `int`
    I32(i32),
    /// `float`
    F32(f32),
}

/// Launches `func` on `stream` with `args` in order.
///
/// # Safety
/// `args` must match the kernel's parameter list, and every pointer must be
/// valid for what the kernel reads and writes under `cfg`, on `stream`'s device.
pub(crate) unsafe fn launch(
    name: &str,
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    #[cfg(feature = "nvtx")]
    let _range = nvtx::Range::new(nvtx::Str::from_str_lossy(name));
    let mut b = stream.launch_builder(func);
    for a in args {
        match a {
            Arg::Ptr(v) => b.arg(v),
            Arg::I64(v) => b.arg(v),
            Arg::I32(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
        };
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { b.launch(cfg) }.map_err(driver(format!("launching {name}")))?;
    Ok(())
}

/// Launches the row kernel `{name}_{dtype}` of `module` over `rows` rows of
/// `cols`: the [`rows_config`] shape, at most 16 blocks per SM.
///
/// # Safety
/// As [`launch`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_rows(
    gpu: &Gpu,
    stream: &CudaStream,
    module: (&'static str, &'static str),
    name: &str,
    dtype: DType,
    rows: usize,
    cols: usize,
    args: &[Arg],
) -> Result<()> {
    let f = gpu.function(module, &format!("{name}_{}", dtype.suffix()))?;
    let cfg = rows_config(rows, cols, dtype.size(), gpu.sm_count() * 16);
    // SAFETY: forwarded from this function's contract.
    unsafe { launch(&format!("keel::{name}"), stream, &f, cfg, args) }
}

/// One block per row (grid-stride), about four 16-byte vectors per thread.
pub(crate) fn rows_config(rows: usize, cols: usize, elem_bytes: usize, max_blocks: u32) -> LaunchConfig {
    let vecs = cols.div_ceil(16 / elem_bytes);
    let threads = (vecs.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
    let blocks = (rows as u64).clamp(1, max_blocks as u64) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}
