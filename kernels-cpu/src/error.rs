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

/// For `len` elements in rows of `cols`: the row count, after checking that
/// `len` is a whole number of rows and that `eps` is finite and >= 0.
pub(crate) fn check_rows(op: &'static str, len: usize, cols: usize, eps: f64) -> Result<usize> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::Shape { op, arg: "eps", msg: format!("must be finite and >= 0, got {eps}") });
    }
    if cols == 0 {
        return if len == 0 {
            Ok(0)
        } else {
            Err(Error::Shape { op, arg: "cols", msg: "is 0 but the input is not empty".into() })
        };
    }
    if !len.is_multiple_of(cols) {
        return Err(Error::Shape { op, arg: "input", msg: format!("length {len} is not a multiple of cols {cols}") });
    }
    Ok(len / cols)
}

impl Error {
    /// The same error reported for the op `op` (a kernel that runs another's
    /// checks, or serves another op).
    pub fn renamed(self, op: &'static str) -> Self {
        match self {
            Error::Length { arg, got, expected, .. } => Error::Length { op, arg, got, expected },
            Error::Shape { arg, msg, .. } => Error::Shape { op, arg, msg },
        }
    }
}
