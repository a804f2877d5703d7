//! torch's intra-op thread pool (`at::parallel_for`), so that Keel's CPU
//! kernels respect `torch.set_num_threads` and never compete with a second pool.
use crate::error::Result;
use crate::sys::{api, check};
use std::ffi::c_void;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// Number of threads of torch's intra-op pool.
pub fn get_num_threads() -> Result<usize> {
    let mut n = 0u32;
    // SAFETY: writes one u32.
    check("torch_get_num_threads", unsafe { (api()?.torch_get_num_threads)(&mut n) })?;
    Ok(n.max(1) as usize)
}

struct Ctx<'a> {
    f: &'a (dyn Fn(Range<usize>) + Sync),
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

unsafe extern "C" fn trampoline(begin: i64, end: i64, ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Ctx` that `parallel_for` passed, alive for the whole call.
    let ctx = unsafe { &*(ctx as *const Ctx<'_>) };
    // A panic must not cross this `extern "C"` frame into torch: keep it and
    // resume it on the calling thread once torch's loop has returned.
    if let Err(p) = catch_unwind(AssertUnwindSafe(|| (ctx.f)(begin as usize..end as usize))) {
        ctx.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
    }
}

/// Runs `f` over disjoint ranges covering `0..n` on torch's intra-op pool,
/// each at least `grain` long. A panic in `f` is re-raised here, after the loop.
pub fn parallel_for(n: usize, grain: usize, f: &(dyn Fn(Range<usize>) + Sync)) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let ctx = Ctx { f, panic: Mutex::new(None) };
    // SAFETY: `trampoline` matches ParallelFunc and `ctx` outlives the call
    // (torch_parallel_for returns only after every chunk ran).
    let code = unsafe {
        (api()?.torch_parallel_for)(0, n as i64, grain.max(1) as i64, trampoline, &ctx as *const Ctx<'_> as *mut c_void)
    };
    if let Some(p) = ctx.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        std::panic::resume_unwind(p);
    }
    check("torch_parallel_for", code)
}
