use crate::error::{Error, Result};
use crate::sys::{api, check, DeviceGuardHandle};
use std::ffi::c_void;

/// Makes a device current for its lifetime and restores the previous one on
/// drop (torch's `DeviceGuard`).
pub struct DeviceGuard {
    handle: DeviceGuardHandle,
}

impl DeviceGuard {
    /// Switches to device `index` of the current accelerator type.
    pub fn new(index: i32) -> Result<DeviceGuard> {
        let mut h = std::ptr::null_mut();
        // SAFETY: writes a new owning guard handle on success.
        check("aoti_torch_create_device_guard", unsafe { (api()?.aoti_torch_create_device_guard)(index, &mut h) })?;
        Ok(DeviceGuard { handle: h })
    }
}

impl Drop for DeviceGuard {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: owned handle, deleted once.
            let _ = unsafe { (a.aoti_torch_delete_device_guard)(self.handle) };
        }
    }
}

/// torch's current CUDA stream on device `index` (a `cudaStream_t`, borrowed:
/// torch owns it). Errors where this torch has no CUDA support.
pub fn current_cuda_stream(index: i32) -> Result<*mut c_void> {
    let f = api()?
        .aoti_torch_get_current_cuda_stream
        .ok_or_else(|| Error::Load("this torch has no CUDA support (libtorch_cuda.so not loaded)".into()))?;
    let mut s = std::ptr::null_mut();
    // SAFETY: writes the borrowed stream pointer.
    check("aoti_torch_get_current_cuda_stream", unsafe { f(index, &mut s) })?;
    Ok(s)
}
