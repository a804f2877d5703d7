use crate::error::{driver, Error, Result};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::catch_unwind;
use std::sync::{Arc, Mutex, OnceLock};

/// Number of CUDA devices; an error when there is no driver.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::NoCuda("no CUDA driver (libcuda.so) on this machine".into()));
    }
    // cudarc panics on some missing-driver paths: never let that reach a caller.
    let n = catch_unwind(CudaContext::device_count)
        .map_err(|_| Error::NoCuda("the CUDA driver failed to initialise".into()))?
        .map_err(driver("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

/// Whether at least one CUDA device can be used.
pub fn is_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// One GPU: its primary context and the kernels loaded on it.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    sm_count: u32,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

/// The GPU of this ordinal, created once per process.
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let mut gpus = GPUS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(g.clone());
    }
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::NoCuda(format!("device {ordinal} requested, {count} present")));
    }
    let ctx = catch_unwind(|| CudaContext::new(ordinal))
        .map_err(|_| Error::NoCuda(format!("creating a context on device {ordinal} panicked")))?
        .map_err(driver(format!("creating the context of device {ordinal}")))?;
    let sm_count = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(driver("reading the SM count"))? as u32;
    let g = Arc::new(Gpu { ctx, sm_count, modules: Default::default(), functions: Default::default() });
    gpus.insert(ordinal, g.clone());
    Ok(g)
}

impl Gpu {
    /// The device's primary context (shared with torch and other runtime users).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// A new stream owned by Keel.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(driver("creating a stream"))
    }

    /// Wraps a stream that someone else owns (e.g. torch's current stream).
    ///
    /// # Safety
    /// `raw` must be a valid `CUstream` of this device, kept alive by its owner
    /// while the returned stream (or anything launched through it) is in use.
    pub unsafe fn borrowed_stream(&self, raw: *mut c_void) -> Arc<CudaStream> {
        // SAFETY: per this function's contract.
        unsafe { self.ctx.wrap_borrowed_stream(raw as cudarc::driver::sys::CUstream) }
    }

    /// Kernel `name` of the PTX module `module` (`(name, ptx source)`), loaded once.
    pub(crate) fn function(&self, module: (&'static str, &'static str), name: &str) -> Result<CudaFunction> {
        let mut fns = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = fns.get(name) {
            return Ok(f.clone());
        }
        let m = {
            let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match mods.get(module.0) {
                Some(m) => m.clone(),
                None => {
                    let m = self.ctx.load_module(Ptx::from_src(module.1)).map_err(driver(format!(
                        "loading the PTX of {} (PTX ISA {}: does the driver predate it?)",
                        module.0,
                        crate::ptx::ISA
                    )))?;
                    mods.insert(module.0, m.clone());
                    m
                }
            }
        };
        let f = m.load_function(name).map_err(driver(format!("looking up kernel {name}")))?;
        fns.insert(name.to_string(), f.clone());
        Ok(f)
    }
}
