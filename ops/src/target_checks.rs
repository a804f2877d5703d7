//! `keel_set_cuda_target_checks` and `keel_cuda_target_checks`: plain C
//! functions, so that Python can turn cross_entropy's CUDA target check off
//! and on and ask which it is (`keel.set_cuda_target_checks`,
//! `keel.cuda_target_checks`, through ctypes) without an op: an op needs a
//! tensor to dispatch on.
use keel::ops::cross_entropy::{cuda_target_checks, set_cuda_target_checks};
use std::ffi::c_int;

/// [`set_cuda_target_checks`]: `on` non-zero turns the check on, zero off,
/// for the whole process. Returns 1 where it was on, 0 where it was off, -1
/// if that panicked (it has no reason to).
#[no_mangle]
pub extern "C-unwind" fn keel_set_cuda_target_checks(on: c_int) -> c_int {
    std::panic::catch_unwind(|| set_cuda_target_checks(on != 0) as c_int).unwrap_or(-1)
}

/// [`cuda_target_checks`]: 1 where the check is on, 0 where it is off, -1 if
/// that panicked (it has no reason to).
#[no_mangle]
pub extern "C-unwind" fn keel_cuda_target_checks() -> c_int {
    std::panic::catch_unwind(|| cuda_target_checks() as c_int).unwrap_or(-1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exports_set_the_check_and_tell_what_it_is() {
        assert_eq!(keel_cuda_target_checks(), 1, "on by default");
        assert_eq!(keel_set_cuda_target_checks(0), 1);
        assert_eq!(keel_cuda_target_checks(), 0);
        assert_eq!(keel_set_cuda_target_checks(0), 0);
        assert_eq!(keel_set_cuda_target_checks(7), 0);
        assert_eq!(keel_cuda_target_checks(), 1);
        assert_eq!(keel_set_cuda_target_checks(1), 1);
    }
}
