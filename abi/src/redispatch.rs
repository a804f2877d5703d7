//! An op's autograd kernel in Rust: it forwards the call, stack as it is, to
//! one of two twin ops through torch's dispatcher.
//!
//! The stable ABI can register a kernel for the `Autograd` key but cannot
//! build a graph node, nor redispatch below autograd. What it can do is call
//! another op by name (`torch_call_dispatcher`) and read grad mode. So an op
//! `keel::f` with autograd has two twins of the same schema and kernels:
//! `keel::_f_autograd`, whose autograd formula is registered in Python, and
//! `keel::_f_nograd`, which has none (torch's own C++ fallback passes it
//! through). `f`'s autograd kernel calls the first where grad mode is on and
//! the second where it is off, so that a call under `torch.no_grad()` never
//! enters Python (measured: see `docs/BENCHMARKS.md`, session 20).
//!
//! Only where the dispatcher call, grad mode and the text of a failed call's
//! exception (torch 2.13+) are all available ([`can_forward`]): before 2.13
//! a failure inside the twin would reach Python without its message (torch
//! printed it to stderr), and bad input must raise a message naming the op
//! and the argument. There the op keeps its Python autograd kernel alone.
use crate::error::{raise, take_last_raised};
use crate::stack::StableIValue;
use crate::sys::{api, last_error_message};
use crate::EXTENSION_BUILD_VERSION;
use std::ffi::CStr;

/// An op whose autograd kernel is [`forward`]: its name and its twins'.
pub trait Forwarded {
    /// The op's name, for messages.
    const NAME: &'static str;
    /// The twin called where grad mode is on (`"keel::_f_autograd"`).
    const AUTOGRAD: &'static CStr;
    /// The twin called where grad mode is off (`"keel::_f_nograd"`).
    const NOGRAD: &'static CStr;
}

/// Whether this torch has what [`forward`] needs (see the module's text).
pub fn can_forward() -> bool {
    api().is_ok_and(|a| {
        a.torch_call_dispatcher.is_some()
            && a.aoti_torch_grad_mode_is_enabled.is_some()
            && a.torch_exception_get_what_without_backtrace.is_some()
    })
}

/// The autograd kernel of `F`: calls `F::AUTOGRAD` with the stack as torch
/// gave it where grad mode is on, else `F::NOGRAD`; their returns are left
/// on the stack as this op's. Register it only where [`can_forward`].
///
/// The stack's ownership passes whole: the dispatcher takes the arguments
/// (as a kernel does) and writes new owning returns. A failure of the twin
/// is raised again with its own message (its kernels are this op's, so the
/// message names this op and the argument).
///
/// # Safety
/// Only torch's dispatcher calls this, with a stack laid out for the schema
/// that `F`'s twins share with the op.
pub unsafe extern "C-unwind" fn forward<F: Forwarded>(stack: *mut StableIValue, _num_args: u64, _num_outputs: u64) {
    let Some((call, grad_mode)) =
        api().ok().and_then(|a| Some((a.torch_call_dispatcher?, a.aoti_torch_grad_mode_is_enabled?)))
    else {
        raise(&format!("keel::{}: internal error: autograd kernel registered without torch_call_dispatcher", F::NAME))
    };
    take_last_raised();
    // SAFETY: plain C functions; the stack is the one torch passed us, laid
    // out for the twins' schema (the same as this op's).
    let code = unsafe {
        let target = if grad_mode() { F::AUTOGRAD } else { F::NOGRAD };
        call(target.as_ptr(), c"".as_ptr(), stack, EXTENSION_BUILD_VERSION)
    };
    if code != 0 {
        let msg = failure_message(take_last_raised(), last_error_message().as_deref())
            .unwrap_or_else(|| format!("keel::{}: failed in torch (its message was printed above)", F::NAME));
        raise(&msg)
    }
}

/// What a failed twin is raised again with: the message Keel raised in it,
/// word for word, where torch's text of the failure carries it (or torch
/// has none); else torch's text without its Python frames. A message of
/// ours raised and caught inside the call (by Python code on the way) is
/// still stashed when another error ends it: that error is the one to
/// report, not the stale message.
fn failure_message(ours: Option<String>, torch: Option<&str>) -> Option<String> {
    match (ours, torch) {
        (Some(ours), Some(torch)) if !torch.contains(ours.as_str()) => Some(without_python_frames(torch).to_string()),
        (Some(ours), _) => Some(ours),
        (None, torch) => torch.map(|t| without_python_frames(t).to_string()),
    }
}

/// torch's text of an exception raised in Python (a fake kernel's, an
/// autograd formula's) without what torch adds to it: the `RuntimeError: `
/// before (the error is raised again as one) and the Python frames after
/// (`\n\nAt:\n  file(line): function ...`).
fn without_python_frames(what: &str) -> &str {
    let what = what.split_once("\n\nAt:\n").map_or(what, |(msg, _)| msg);
    what.strip_prefix("RuntimeError: ").unwrap_or(what)
}

#[cfg(test)]
mod tests {
    use super::{failure_message, without_python_frames};

    #[test]
    fn a_stale_message_of_ours_gives_way_to_the_error_that_ended_the_call() {
        let ours = || Some("keel::f: argument 'x' is bad".to_string());
        // Ours, carried by torch's text (with Python frames): ours, word for word.
        let torch = "RuntimeError: keel::f: argument 'x' is bad\n\nAt:\n  /a.py(3): g\n";
        assert_eq!(failure_message(ours(), Some(torch)), ours());
        // No text from torch: ours.
        assert_eq!(failure_message(ours(), None), ours());
        // Another error ended the call: torch's, whatever was stashed.
        let other = "RuntimeError: shape mismatch\n\nAt:\n  /a.py(3): g\n";
        assert_eq!(failure_message(ours(), Some(other)).as_deref(), Some("shape mismatch"));
        assert_eq!(failure_message(None, Some(other)).as_deref(), Some("shape mismatch"));
        assert_eq!(failure_message(None, None), None);
    }

    #[test]
    fn python_frames_and_runtime_error_prefix_are_dropped() {
        let what = "RuntimeError: keel::f: argument 'x' is bad\n\nAt:\n  /a.py(3): g\n  /b.py(9): h\n";
        assert_eq!(without_python_frames(what), "keel::f: argument 'x' is bad");
        assert_eq!(without_python_frames("keel::f: plain"), "keel::f: plain");
        // Another exception type keeps its name: it is raised again as a RuntimeError.
        assert_eq!(without_python_frames("ValueError: v\n\nAt:\n  x"), "ValueError: v");
    }
}
