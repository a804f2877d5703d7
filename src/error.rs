use thiserror::Error;

/// Errors of Keel's Rust API.
#[derive(Debug, Error)]
pub enum Error {
    /// A CPU kernel refused its arguments.
    #[error(transparent)]
    Cpu(#[from] keel_cpu::Error),
    /// Bad arguments to a CUDA entry point.
    #[error("{op}: argument '{arg}': {msg}")]
    Invalid {
        /// The op.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// No usable CUDA driver or device.
    #[error("CUDA unavailable: {0}")]
    NoCuda(String),
    /// A CUDA driver call failed.
    #[error("CUDA error in {what}: {err}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        err: cudarc::driver::DriverError,
    },
    /// A launch on the tests' CPU emulation of the kernels failed.
    #[cfg(test)]
    #[error("emulating {kernel}: {msg}")]
    Emu {
        /// The kernel.
        kernel: String,
        /// What went wrong.
        msg: String,
    },
}

/// Result of Keel's Rust API.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn driver(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    let what = what.into();
    move |err| Error::Driver { what, err }
}
