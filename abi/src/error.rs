use std::ffi::CString;
use thiserror::Error;

/// An error from the binding or from an op, raised in Python as `RuntimeError`.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// libtorch is not loaded, or lacks a function this crate needs.
    #[error("keel: {0}")]
    Load(String),
    /// A stable-ABI call returned an error code.
    #[error("keel: torch call {call} failed{detail}")]
    Torch {
        /// The C function.
        call: &'static str,
        /// torch's message (": ..."), where this torch can report it (2.13+).
        detail: String,
    },
    /// The caller's arguments are wrong; the message names the op and argument.
    #[error("{0}")]
    Invalid(String),
}

/// Result of the binding.
pub type Result<T> = std::result::Result<T, Error>;

/// Raises `msg` as a C++ `c10::Error`, which torch turns into a Python
/// `RuntimeError`. Never returns.
///
/// Call it only from a frame that C++ may unwind through (an
/// `extern "C-unwind"` entry point, outside any `catch_unwind`) after every
/// resource of the call has been released; [`crate::boxed`] does this.
pub fn raise(msg: &str) -> ! {
    let msg = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    match crate::sys::api() {
        Ok(api) => {
            // SAFETY: `aoti_torch_check` is declared `C-unwind`; with cond = false
            // it throws, and the exception unwinds out through our caller.
            unsafe { (api.aoti_torch_check)(false, c"keel".as_ptr(), c"keel-abi".as_ptr(), 0, msg.as_ptr()) };
        }
        Err(e) => eprintln!("{e}"),
    }
    // Only reached if torch is missing or aoti_torch_check returned.
    eprintln!("keel: could not raise to torch: {}", msg.to_string_lossy());
    std::process::abort()
}

/// A C string from `s`, or an error if it holds a NUL byte.
pub(crate) fn invalid_cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Invalid(format!("string {s:?} contains a NUL byte")))
}
