//! The SIMD level the kernels may use: the CPU's best, or a lower one that
//! the environment variable `KEEL_CPU_CAPABILITY` names, as torch's
//! `ATEN_CPU_CAPABILITY` does for torch's own kernels (with the same names:
//! `default`, `avx2`, `avx512`).
//!
//! A lower level serves to reproduce what another CPU runs (the AVX2 kernels
//! of a Zen 3 on an AVX-512 machine; the portable loops of a CPU with
//! neither), to tell whether a result depends on the level, and to test
//! every level on one machine. The variable is read once, at the first
//! kernel call of the process, and only lowers the level: `avx512` on a CPU
//! without AVX-512 runs what that CPU has. An unknown value is reported once
//! on stderr and changes nothing. It applies to Keel's own kernels on
//! x86-64; other architectures always run their portable loops.
use std::ffi::{CStr, OsStr};
use std::sync::OnceLock;

/// The environment variable that caps the level.
pub const CAPABILITY_VAR: &str = "KEEL_CPU_CAPABILITY";

/// A SIMD level of the x86-64 kernels, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Capability {
    /// No explicit SIMD: the portable lane loops, compiled for the target's
    /// baseline (SSE2 on x86-64), as on a CPU without AVX2.
    Default,
    /// 8-lane AVX2 vectors with FMA and F16C. As a cap, it also holds the
    /// lane loops to pulp's x86-64-v3.
    Avx2,
    /// 16-lane AVX-512 vectors with AVX512-BF16 and F16C.
    Avx512,
}

impl Capability {
    /// Every level, lowest first.
    pub const ALL: [Capability; 3] = [Capability::Default, Capability::Avx2, Capability::Avx512];

    /// The level's name in `KEEL_CPU_CAPABILITY` (and in torch's
    /// `ATEN_CPU_CAPABILITY`): `default`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        // ASCII, so never the default.
        self.c_name().to_str().unwrap_or_default()
    }

    /// [`Capability::name`] as a C string (for a C caller).
    pub fn c_name(self) -> &'static CStr {
        match self {
            Capability::Default => c"default",
            Capability::Avx2 => c"avx2",
            Capability::Avx512 => c"avx512",
        }
    }

    /// The level `name` names (ASCII case and surrounding blanks ignored).
    pub fn from_name(name: &str) -> Option<Capability> {
        let name = name.trim();
        Capability::ALL.into_iter().find(|c| c.name().eq_ignore_ascii_case(name))
    }
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The highest level the kernels may use: what `KEEL_CPU_CAPABILITY` names,
/// or [`Capability::Avx512`] (no cap) where it is unset, blank or unknown. Read
/// once; the first read of an unknown value says so on stderr.
pub(crate) fn cap() -> Capability {
    static CAP: OnceLock<Capability> = OnceLock::new();
    *CAP.get_or_init(|| {
        let (cap, warning) = cap_from(std::env::var_os(CAPABILITY_VAR).as_deref());
        if let Some(w) = warning {
            eprintln!("{w}");
        }
        cap
    })
}

/// The cap a value of `KEEL_CPU_CAPABILITY` sets (`None`: unset; blank
/// counts as unset), and the warning to print for a value that names no
/// level (the cap is then none).
fn cap_from(value: Option<&OsStr>) -> (Capability, Option<String>) {
    let Some(value) = value.filter(|v| !v.to_string_lossy().trim().is_empty()) else {
        return (Capability::Avx512, None);
    };
    match value.to_str().and_then(Capability::from_name) {
        Some(c) => (c, None),
        None => {
            let names: Vec<_> = Capability::ALL.iter().map(|c| c.name()).collect();
            let w = format!(
                "keel: {CAPABILITY_VAR}={} is not one of {}; ignored (the CPU's best level runs)",
                value.to_string_lossy(),
                names.join(", ")
            );
            (Capability::Avx512, Some(w))
        }
    }
}

/// The level the kernels run at in this process: the CPU's best, lowered
/// to the cap that `KEEL_CPU_CAPABILITY` sets. [`Capability::Default`] on
/// other architectures than x86-64.
pub fn capability() -> Capability {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::has_v4_bf16() {
            return Capability::Avx512;
        }
        if crate::wide::x86::V8::try_new().is_some() {
            return Capability::Avx2;
        }
    }
    // Read on every architecture, so that an unknown value is reported.
    let _ = cap();
    Capability::Default
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order_levels() {
        for c in Capability::ALL {
            assert_eq!(Capability::from_name(c.name()), Some(c));
            assert_eq!(c.to_string(), c.name());
        }
        assert_eq!(Capability::from_name(" AVX2\n"), Some(Capability::Avx2));
        assert_eq!(Capability::from_name("avx512_vnni"), None);
        assert_eq!(Capability::from_name(""), None);
        assert!(Capability::Default < Capability::Avx2 && Capability::Avx2 < Capability::Avx512);
    }

    #[test]
    fn the_variable_only_caps_and_unknown_values_warn() {
        assert_eq!(cap_from(None), (Capability::Avx512, None));
        assert_eq!(cap_from(Some(OsStr::new(" "))), (Capability::Avx512, None));
        assert_eq!(cap_from(Some(OsStr::new("default"))), (Capability::Default, None));
        assert_eq!(cap_from(Some(OsStr::new("Avx2"))), (Capability::Avx2, None));
        let (c, w) = cap_from(Some(OsStr::new("sse4")));
        assert_eq!(c, Capability::Avx512);
        let w = w.expect("an unknown value warns");
        assert!(w.contains("KEEL_CPU_CAPABILITY=sse4") && w.contains("default, avx2, avx512"), "{w}");
    }

    #[test]
    fn the_level_in_use_is_under_the_cap() {
        let (level, cap) = (capability(), cap());
        assert!(level <= cap, "{level} above the cap {cap}");
        // The two explicit widths agree with the level.
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(crate::simd::has_v4_bf16(), level == Capability::Avx512);
            assert_eq!(crate::wide::x86::V8::try_new().is_some(), level >= Capability::Avx2);
            // And the lane loops' level (pulp's) stays under the cap too.
            let arch = crate::simd::arch();
            match cap {
                Capability::Default => assert!(matches!(arch, pulp::Arch::Scalar), "{arch:?}"),
                Capability::Avx2 => assert!(!matches!(arch, pulp::Arch::V4(_)), "{arch:?}"),
                Capability::Avx512 => {}
            }
        }
    }
}
