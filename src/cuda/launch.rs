//! The one place kernels are launched: where launches go ([`Target`]), NVTX
//! ranges (feature `nvtx`), argument packing, and the error mapping.
use super::{DType, Gpu, NormKeep};
use crate::error::{driver, Result};
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

/// A kernel argument: device pointers are passed as `u64`.
#[derive(Debug, Clone, Copy)]
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

/// A PTX module: `(name, PTX source)`, the name being the stem of its
/// `kernels-cuda/*.cu` file.
pub(crate) type Module = (&'static str, &'static str);

/// Where the entry points' kernels run, in the order they are launched: a
/// CUDA stream ([`Stream`]), or in tests the CPU emulation of the kernels.
pub(crate) trait Target {
    /// Streaming multiprocessors (grids are sized by it).
    fn sm_count(&self) -> u32;

    /// Launches kernel `kernel` of `module` after the work launched before it.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every pointer must be
    /// valid for what the kernel reads and writes under `cfg`, on this target.
    unsafe fn launch(&self, module: Module, kernel: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()>;

    /// Whether the stream is being captured into a CUDA graph: then nothing
    /// may wait for its work (a synchronising read would end the capture with
    /// an error), so [`Target::read_i32s`] must not be called.
    fn capturing(&self) -> Result<bool>;

    /// Copies `dst.len()` i32s from the device address `src` once the work
    /// launched so far is done; `what` names the read in a driver error.
    ///
    /// # Safety
    /// `src` must hold `dst.len()` i32s on this target.
    unsafe fn read_i32s(&self, what: &str, src: u64, dst: &mut [i32]) -> Result<()>;

    /// Whether cross_entropy reads its bad-target count back (and waits for
    /// it): on a GPU, [`set_cuda_target_checks`]'s process-wide setting; the
    /// tests' emulation sets it per target.
    ///
    /// [`set_cuda_target_checks`]: crate::ops::cross_entropy::set_cuda_target_checks
    fn checks_targets(&self) -> bool {
        crate::ops::cross_entropy::cuda_target_checks()
    }

    /// How the norms' two-vector backward kernels keep a row (the held
    /// ones not yet timed on a GPU): on a GPU, the `KEEL_NORM_BWD`
    /// environment variable ([`norm_keep`](super::choice::norm_keep)); `op`
    /// names the caller in an error. The tests' emulation sets it per target.
    fn norm_keep(&self, op: &'static str) -> Result<NormKeep> {
        super::choice::norm_keep(op)
    }
}

/// A GPU and one of its streams: what the public `*_cuda_raw` entry points
/// launch on.
pub(crate) struct Stream<'a> {
    pub(crate) gpu: &'a Gpu,
    pub(crate) stream: &'a CudaStream,
}

impl Target for Stream<'_> {
    fn sm_count(&self) -> u32 {
        self.gpu.sm_count()
    }

    unsafe fn launch(&self, module: Module, kernel: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let f = self.gpu.function(module, kernel)?;
        #[cfg(feature = "nvtx")]
        let _range = nvtx::Range::new(nvtx::Str::from_str_lossy(&format!("keel::{kernel}")));
        let mut b = self.stream.launch_builder(&f);
        for a in args {
            match a {
                Arg::Ptr(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { b.launch(cfg) }.map_err(driver(format!("launching {kernel}")))?;
        Ok(())
    }

    fn capturing(&self) -> Result<bool> {
        let status = self.stream.capture_status().map_err(driver("asking whether the stream is being captured"))?;
        Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    unsafe fn read_i32s(&self, what: &str, src: u64, dst: &mut [i32]) -> Result<()> {
        // SAFETY: `src` holds `dst.len()` i32s on this stream's device (our contract).
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(driver(format!("reading {what}")))?;
        self.stream.synchronize().map_err(driver(format!("synchronising before {what}")))
    }
}

/// Launches the row kernel `{name}_{dtype}` of `module` over `rows` rows of
/// `cols`: the [`rows_config`] shape, at most 16 blocks per SM.
///
/// # Safety
/// As [`Target::launch`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_rows(
    t: &dyn Target,
    module: Module,
    name: &str,
    dtype: DType,
    rows: usize,
    cols: usize,
    args: &[Arg],
) -> Result<()> {
    let cfg = rows_config(rows, cols, dtype.size(), t.sm_count() * 16);
    // SAFETY: forwarded from this function's contract.
    unsafe { t.launch(module, &format!("{name}_{}", dtype.suffix()), cfg, args) }
}

/// One block per row (grid-stride), about four 16-byte vectors per thread.
pub(crate) fn rows_config(rows: usize, cols: usize, elem_bytes: usize, max_blocks: u32) -> LaunchConfig {
    rows_config_packs(rows, cols, elem_bytes, max_blocks, 4)
}

/// [`rows_config`] with about `packs` 16-byte vectors per thread.
pub(crate) fn rows_config_packs(
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    max_blocks: u32,
    packs: usize,
) -> LaunchConfig {
    let vecs = cols.div_ceil(16 / elem_bytes);
    let threads = (vecs.div_ceil(packs).div_ceil(32) * 32).clamp(32, 1024) as u32;
    let blocks = (rows as u64).clamp(1, max_blocks as u64) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}
