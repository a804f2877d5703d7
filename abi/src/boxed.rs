//! The one boxed entry point every op goes through.
use crate::error::{raise, Error, Result};
use crate::refuse::{arg_names, OpSchema};
use crate::stack::{FromStack, IntoStack, StableIValue};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// An operator body: typed arguments in, typed results out.
///
/// `Args` and `Out` are tuples whose element types follow the op's schema.
pub trait BoxedOp {
    /// The op's name, for messages.
    const NAME: &'static str;
    /// Arguments, in schema order.
    type Args: FromStack;
    /// Returns, in schema order.
    type Out: IntoStack;
    /// Runs the op. Errors become a Python `RuntimeError` with their message.
    fn run(args: Self::Args) -> Result<Self::Out>;
}

/// The boxed kernel of op `K`, to register with [`crate::Library::impl_kernel`].
///
/// Unboxes the arguments, runs `K::run` under `catch_unwind`, boxes the
/// results. On an error or a panic, every argument and temporary has been
/// dropped by the time the error is raised: the C++ exception then unwinds
/// only through this frame, into torch's dispatcher.
///
/// Every error names the op: a tensor argument given None (torch passes an
/// undefined tensor for a `Tensor` argument) is refused before the op runs,
/// naming the argument, and a failed torch call inside the op is prefixed
/// with the op's name.
///
/// # Safety
/// Only torch's dispatcher calls this, with a stack laid out for `K`'s schema.
pub unsafe extern "C-unwind" fn boxed<K: OpSchema>(stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    let n = (num_args.max(num_outputs) as usize).max(K::Args::SLOTS).max(K::Out::SLOTS);
    let result = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
        // SAFETY: torch passes a stack of max(num_args, num_outputs) slots.
        let slots = unsafe { std::slice::from_raw_parts_mut(stack, n) };
        // SAFETY: the slots hold K's arguments as torch boxed them.
        let args = unsafe { K::Args::take(slots) }?;
        undefined_tensor::<K>(&args)?;
        K::run(args)?.put(slots);
        Ok(())
    }));
    let msg = match result {
        Ok(Ok(())) => return,
        Ok(Err(e @ (Error::Torch { .. } | Error::Load(_)))) => format!("keel::{}: {e}", K::NAME),
        Ok(Err(e)) => e.to_string(),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            format!("keel::{}: internal error (panic): {what}", K::NAME)
        }
    };
    raise(&msg)
}

/// The error for a tensor argument of `args` that is undefined (given None
/// where the schema says `Tensor`), naming it; `Ok` where all are defined.
fn undefined_tensor<K: OpSchema>(args: &K::Args) -> Result<()> {
    let mut found: Option<Result<usize>> = None;
    args.each_tensor(0, &mut |i, t| {
        if found.is_none() {
            found = match t.is_defined() {
                Ok(true) => None,
                Ok(false) => Some(Ok(i)),
                Err(e) => Some(Err(e)),
            };
        }
    });
    match found {
        None => Ok(()),
        Some(Err(e)) => Err(e),
        Some(Ok(i)) => {
            let names = arg_names(K::SCHEMA);
            let name = names.get(i).copied().unwrap_or("?");
            Err(Error::Invalid(format!("keel::{}: argument '{name}' is None, where the op takes a tensor", K::NAME)))
        }
    }
}
