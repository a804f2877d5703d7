//! CUDA context for an op: device guard, torch's current stream, Keel's GPU.
use keel::cuda::{CudaStream, Gpu};
use keel_abi::{current_cuda_stream, Device, DeviceGuard, Error};
use std::sync::Arc;

/// Everything a CUDA launch needs; the guard restores the previous device on drop.
pub(crate) struct CudaCall {
    pub gpu: Arc<Gpu>,
    pub stream: Arc<CudaStream>,
    _guard: DeviceGuard,
}

impl CudaCall {
    pub(crate) fn new(op: &str, device: Device) -> keel_abi::Result<CudaCall> {
        let guard = DeviceGuard::new(device.index)?;
        let raw = current_cuda_stream(device.index)?;
        let gpu = keel::cuda::gpu(device.index.max(0) as usize).map_err(|e| Error::Invalid(format!("{op}: {e}")))?;
        // SAFETY: `raw` is torch's current stream on this device, alive for the
        // whole op call; work is queued on it in torch's order.
        let stream = unsafe { gpu.borrowed_stream(raw) };
        Ok(CudaCall { gpu, stream, _guard: guard })
    }
}

/// Device address of a tensor's data, as the kernels take it (0 for none).
pub(crate) fn ptr(t: Option<&keel_abi::Tensor>) -> keel_abi::Result<u64> {
    Ok(match t {
        Some(t) => t.data_ptr()? as usize as u64,
        None => 0,
    })
}

/// Maps a CPU-kernel check (shared by every device, e.g. of an option) to an
/// error raised in Python.
pub(crate) fn check_err(e: keel::cpu::Error) -> Error {
    kernel_err(e.into())
}

/// [`kernel_err`] naming the registered op `op` in argument errors: for a
/// kernel that serves several ops and names the one it was written for
/// (`cross_entropy_with_lse` runs `cross_entropy`'s).
pub(crate) fn kernel_err_as(op: &'static str) -> impl Fn(keel::Error) -> Error {
    move |e| {
        kernel_err(match e {
            keel::Error::Cpu(c) => keel::Error::Cpu(c.renamed(op)),
            keel::Error::Invalid { arg, msg, .. } => keel::Error::Invalid { op, arg, msg },
            other => other,
        })
    }
}

/// Maps a kernel-layer error to an error raised in Python. Argument errors
/// read like the ops' own checks (`keel::op: argument 'arg' ...`).
pub(crate) fn kernel_err(e: keel::Error) -> Error {
    match e {
        keel::Error::Cpu(keel::cpu::Error::Shape { op, arg, msg }) => {
            Error::Invalid(format!("keel::{op}: argument '{arg}' {msg}"))
        }
        keel::Error::Invalid { op, arg, msg } => Error::Invalid(format!("keel::{op}: argument '{arg}' {msg}")),
        other => Error::Invalid(format!("keel: {other}")),
    }
}
