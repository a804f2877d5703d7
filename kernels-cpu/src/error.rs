use thiserror::Error;

/// Why a CPU kernel refused its arguments.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// A slice has the wrong length for the shape it was described with.
    #[error("{op}: argument '{arg}' has length {got}, expected {expected}")]
    Length {
        /// The kernel.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// Its length.
        got: usize,
        /// The length the shape implies.
        expected: usize,
    },
    /// A shape argument is out of range.
    #[error("{op}: argument '{arg}': {msg}")]
    Shape {
        /// The kernel.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// What is wrong.
        msg: String,
    },
}

/// Result of a CPU kernel.
pub type Result<T> = std::result::Result<T, Error>;

/// Checks that `got == expected`, naming the op and argument otherwise.
pub(crate) fn check_len(op: &'static str, arg: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Length { op, arg, got, expected })
    }
}
