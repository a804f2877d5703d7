//! Launch choices that a GPU session can switch for an A/B, from the
//! environment, read once per process.
//!
//! A kernel variant that has not been timed on a GPU yet lives on main behind
//! one of these, off by default, so that it survives until a session with a
//! GPU can measure it against the default on the same inputs (docs/GPU.md,
//! "The next run"); the one measured faster becomes the default, and the
//! others stay for the next A/B. Tests force each choice through the CPU
//! emulation's [`Target`](super::Target) instead of the environment.
use crate::error::{Error, Result};
use std::sync::OnceLock;

/// The environment variable that picks the norms' backward kernel
/// ([`NormKeep`]): `held` (or unset), `reload` or `smem`.
pub(crate) const NORM_BWD_VAR: &str = "KEEL_NORM_BWD";

/// How the norms' backward kernels keep a row that their threads hold (the
/// kernels' `Keep` in kernels-cuda/common.cuh); rows of other sizes take the
/// default kernels under every choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NormKeep {
    /// `*_bwd2_*`: each row read twice (the sums, then dx); the default
    /// until session 90 timed the held kernels.
    Reload,
    /// `*_bwd2h_*` (and `*_bwd4h_f32` for f32 rows of up to 1024 vectors),
    /// the default: each row held in registers as loaded and read once, `w`
    /// loaded once a block, the parameter gradients' sums in registers. On an
    /// H200, 4096x4096 (docs/GPU.md, run 20), the backward kernel takes
    /// 0.65-0.68x Reload's time in f32 and 0.85-0.99x in bf16.
    Held,
    /// `*_bwd2s_*`: each row held as loaded, the sums in shared memory, at
    /// the default kernels' occupancy.
    HeldShared,
}

/// How the norms' backward keeps its rows: the [`NORM_BWD_VAR`] environment
/// variable, read at the first launch. An `Err` naming `op` and the variable
/// where it holds anything but `reload`, `held` or `smem`.
pub(crate) fn norm_keep(op: &'static str) -> Result<NormKeep> {
    static CHOICE: OnceLock<std::result::Result<NormKeep, String>> = OnceLock::new();
    let choice = CHOICE.get_or_init(|| parse_norm_keep(std::env::var_os(NORM_BWD_VAR).as_deref()));
    choice.clone().map_err(|msg| Error::Invalid { op, arg: NORM_BWD_VAR, msg })
}

/// [`norm_keep`]'s reading of the variable's value.
fn parse_norm_keep(value: Option<&std::ffi::OsStr>) -> std::result::Result<NormKeep, String> {
    match value.map(|v| v.to_str()) {
        Some(Some("reload")) => Ok(NormKeep::Reload),
        None | Some(Some("held")) => Ok(NormKeep::Held),
        Some(Some("smem")) => Ok(NormKeep::HeldShared),
        Some(v) => Err(format!("must be \"held\", \"reload\" or \"smem\", got {v:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_norm_keep, NormKeep};
    use std::ffi::OsStr;

    #[test]
    fn norm_bwd_takes_reload_held_or_smem_and_refuses_anything_else() {
        assert_eq!(parse_norm_keep(None), Ok(NormKeep::Held));
        assert_eq!(parse_norm_keep(Some(OsStr::new("reload"))), Ok(NormKeep::Reload));
        assert_eq!(parse_norm_keep(Some(OsStr::new("held"))), Ok(NormKeep::Held));
        assert_eq!(parse_norm_keep(Some(OsStr::new("smem"))), Ok(NormKeep::HeldShared));
        for bad in ["", "HELD", "held ", "shared"] {
            let err = parse_norm_keep(Some(OsStr::new(bad))).unwrap_err();
            assert!(err.contains("\"held\", \"reload\" or \"smem\""), "{bad:?}: {err}");
        }
    }
}
