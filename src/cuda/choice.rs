//! Launch choices that a GPU session can switch for an A/B, from the
//! environment, read once per process.
//!
//! A kernel variant that has not been timed on a GPU yet lives on main behind
//! one of these, off by default, so that it survives until a session with a
//! GPU can measure it against the default on the same inputs (docs/GPU.md,
//! "The next run"). Tests force each choice through the CPU emulation's
//! [`Target`](super::Target) instead of the environment.
use crate::error::{Error, Result};
use std::sync::OnceLock;

/// The environment variable that picks the norms' backward kernel:
/// `held` for the `*_bwd2h_*` kernels, `reload` (or unset) for the default.
pub(crate) const NORM_BWD_VAR: &str = "KEEL_NORM_BWD";

/// Whether the norms' backward runs its held kernels (`rms_norm_bwd2h_*`,
/// `layer_norm_bwd2h_*`) where a row fits two vectors a thread: the
/// [`NORM_BWD_VAR`] environment variable, read at the first launch. An `Err`
/// naming `op` and the variable where it holds anything else.
pub(crate) fn held_norm_backward(op: &'static str) -> Result<bool> {
    static CHOICE: OnceLock<std::result::Result<bool, String>> = OnceLock::new();
    let choice = CHOICE.get_or_init(|| parse_norm_bwd(std::env::var_os(NORM_BWD_VAR).as_deref()));
    choice.clone().map_err(|msg| Error::Invalid { op, arg: NORM_BWD_VAR, msg })
}

/// [`held_norm_backward`]'s reading of the variable's value.
fn parse_norm_bwd(value: Option<&std::ffi::OsStr>) -> std::result::Result<bool, String> {
    match value.map(|v| v.to_str()) {
        None => Ok(false),
        Some(Some("reload")) => Ok(false),
        Some(Some("held")) => Ok(true),
        Some(v) => Err(format!("must be \"held\" or \"reload\", got {v:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_norm_bwd;
    use std::ffi::OsStr;

    #[test]
    fn norm_bwd_takes_held_or_reload_and_refuses_anything_else() {
        assert_eq!(parse_norm_bwd(None), Ok(false));
        assert_eq!(parse_norm_bwd(Some(OsStr::new("reload"))), Ok(false));
        assert_eq!(parse_norm_bwd(Some(OsStr::new("held"))), Ok(true));
        for bad in ["", "HELD", "held "] {
            let err = parse_norm_bwd(Some(OsStr::new(bad))).unwrap_err();
            assert!(err.contains("\"held\" or \"reload\""), "{bad:?}: {err}");
        }
    }
}
