//! `keel_cpu_capability`: a plain C function this library exports, so
//! that Python can tell which SIMD level Keel's CPU kernels run at
//! (`keel.cpu_capability()`, through ctypes) without an op: an op needs a
//! tensor to dispatch on.
use std::ffi::c_char;

/// The SIMD level Keel's CPU kernels run at in this process
/// ([`keel_cpu::capability`]: the CPU's best, lowered to what
/// `KEEL_CPU_CAPABILITY` names): `"default"`, `"avx2"` or `"avx512"`, a
/// static NUL-terminated string; null if that panicked (it has no reason to).
#[no_mangle]
pub extern "C-unwind" fn keel_cpu_capability() -> *const c_char {
    std::panic::catch_unwind(|| keel_cpu::capability().c_name().as_ptr()).unwrap_or(std::ptr::null())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn the_export_names_the_level_in_use() {
        let p = keel_cpu_capability();
        assert!(!p.is_null());
        // SAFETY: a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(p) }.to_str().unwrap();
        assert_eq!(name, keel_cpu::capability().name());
    }
}
