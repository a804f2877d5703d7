//! Whether the CUDA entry points check class targets: a process-wide switch,
//! on unless the environment or [`set_cuda_target_checks`] turns it off.
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU8, Ordering};

/// The environment variable that sets the check's starting state: `0` turns
/// it off, `1` (or unset, or blank) leaves it on. Read at the first call that
/// asks (a launch, [`cuda_target_checks`] or [`set_cuda_target_checks`]).
pub const TARGET_CHECKS_VAR: &str = "KEEL_CUDA_TARGET_CHECKS";

const OFF: u8 = 0;
const ON: u8 = 1;
/// Not read from the environment yet.
const UNREAD: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNREAD);

/// Turns the CUDA entry points' check of class targets on or off for the
/// whole process, and returns whether it was on.
///
/// The check reads a count back from the device, so each forward (and each
/// backward not given the forward's `lse`) waits for the work queued on its
/// stream: the host cannot run ahead of the GPU past a loss. Off, nothing
/// is read back and nothing waits; a target out of range that is not
/// `ignore_index` then gives its row a NaN loss (so a `"mean"` or `"sum"` is
/// NaN) and a NaN gradient instead of an error, as during CUDA graph
/// capture. The CPU entry points check targets either way (that costs no
/// wait); probability targets have nothing to check. On by default;
/// [`TARGET_CHECKS_VAR`]` = 0` starts it off.
pub fn set_cuda_target_checks(on: bool) -> bool {
    cuda_target_checks(); // the environment read first: it cannot undo this call later
    STATE.swap(if on { ON } else { OFF }, Ordering::Relaxed) == ON
}

/// Whether the CUDA entry points check class targets
/// ([`set_cuda_target_checks`]).
pub fn cuda_target_checks() -> bool {
    match STATE.load(Ordering::Relaxed) {
        UNREAD => {
            let (on, warning) = from_env(std::env::var_os(TARGET_CHECKS_VAR).as_deref());
            // Only the first reader sets it (and warns): a set_cuda_target_checks
            // that came between wins.
            if STATE.compare_exchange(UNREAD, on as u8, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                if let Some(w) = warning {
                    eprintln!("{w}");
                }
            }
            STATE.load(Ordering::Relaxed) == ON
        }
        s => s == ON,
    }
}

/// The starting state a value of [`TARGET_CHECKS_VAR`] gives (`None`: unset;
/// blank counts as unset), and the warning to print for a value that is
/// neither `0` nor `1` (the check is then on).
fn from_env(value: Option<&OsStr>) -> (bool, Option<String>) {
    match value.map(|v| v.to_string_lossy().trim().to_string()).as_deref() {
        None | Some("") | Some("1") => (true, None),
        Some("0") => (false, None),
        Some(v) => {
            (true, Some(format!("keel: {TARGET_CHECKS_VAR}={v} is neither 0 nor 1; ignored (targets are checked)")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::from_env;
    use std::ffi::OsStr;

    #[test]
    fn the_variable_turns_the_check_off_with_0_alone() {
        assert_eq!(from_env(None), (true, None));
        assert_eq!(from_env(Some(OsStr::new(""))), (true, None));
        assert_eq!(from_env(Some(OsStr::new("1"))), (true, None));
        assert_eq!(from_env(Some(OsStr::new("0"))), (false, None));
        assert_eq!(from_env(Some(OsStr::new(" 0 "))), (false, None));
        for bad in ["off", "false", "2", "00"] {
            let (on, w) = from_env(Some(OsStr::new(bad)));
            assert!(on, "{bad}");
            assert!(w.unwrap().contains("is neither 0 nor 1; ignored"), "{bad}");
        }
    }
}
