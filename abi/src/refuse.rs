//! The kernel an op has for the tensors it does not take: sparse, MKL-DNN,
//! quantized and nested ones.
//!
//! Keel's kernels read dense memory through sizes and strides. A call with
//! another kind of tensor dispatches to that kind's key (`SparseCPU`,
//! `QuantizedCUDA`, ...), where an op without a kernel gets torch's
//! `NotImplementedError` naming the backend, and, where the call reached it
//! through the op's twin, the twin's internal name. [`refuse`], registered at
//! each of [`REFUSED_KEYS`], raises instead a message naming the op, the
//! argument and what to do. It reads no data.
use crate::boxed::BoxedOp;
use crate::error::raise;
use crate::stack::{FromStack, StableIValue};
use crate::tensor::Tensor;
use crate::types::Layout;
use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// An op's schema, whose argument names [`refuse`]'s message uses.
pub trait OpSchema: BoxedOp {
    /// The schema as defined (`"softmax(Tensor input, float scale=1.0) -> Tensor"`).
    const SCHEMA: &'static str;
}

/// The dispatch keys of the tensors Keel's ops do not take: each parses in
/// torch 2.10 to 2.15 (`QuantizedMeta` does not).
pub const REFUSED_KEYS: &[&CStr] = &[
    c"SparseCPU",
    c"SparseCUDA",
    c"SparseMeta",
    c"SparseCsrCPU",
    c"SparseCsrCUDA",
    c"SparseCsrMeta",
    c"MkldnnCPU",
    c"QuantizedCPU",
    c"QuantizedCUDA",
    c"NestedTensorCPU",
    c"NestedTensorCUDA",
    c"NestedTensorMeta",
    // Nested tensors' autograd key: not one of the `Autograd` alias's, so a
    // call outside inference mode stops here first.
    c"AutogradNestedTensor",
];

/// The kernel of op `K` at [`REFUSED_KEYS`]: takes the arguments (as any
/// kernel does, so they are released) and raises a `RuntimeError` naming the
/// op and the argument that is not a dense tensor.
///
/// # Safety
/// Only torch's dispatcher calls this, with a stack laid out for `K`'s schema.
pub unsafe extern "C-unwind" fn refuse<K: OpSchema>(stack: *mut StableIValue, num_args: u64, num_outputs: u64) {
    let n = (num_args.max(num_outputs) as usize).max(K::Args::SLOTS);
    let msg = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: torch passes a stack of max(num_args, num_outputs) slots.
        let slots = unsafe { std::slice::from_raw_parts_mut(stack, n) };
        // SAFETY: the slots hold K's arguments as torch boxed them.
        match unsafe { K::Args::take(slots) } {
            Ok(args) => refusal(K::NAME, K::SCHEMA, &args),
            Err(e) => e.to_string(),
        }
    }))
    .unwrap_or_else(|_| format!("keel::{}: internal error (panic) while refusing an argument", K::NAME));
    raise(&msg)
}

/// The message for a call of `op` with `args` (laid out by `schema`).
fn refusal(op: &str, schema: &str, args: &impl FromStack) -> String {
    let names = arg_names(schema);
    let name = |i: usize| names.get(i).copied().unwrap_or("?");
    let (mut tensors, mut found) = (Vec::new(), None);
    args.each_tensor(0, &mut |i, t| {
        tensors.push(name(i));
        if found.is_none() {
            found = not_dense(t).map(|what| (i, what));
        }
    });
    match found {
        Some((i, what)) => format!("keel::{op}: argument '{}' is {what}", name(i)),
        // Sparse, MKL-DNN and quantized tensors are told by their layout and
        // dtype. What is left at these keys is a nested tensor, which the shim
        // cannot tell from a dense one (its layout is strided too).
        None => {
            let which = match tensors.as_slice() {
                [one] => format!("argument '{one}' is"),
                all => format!("one of the arguments '{}' is", all.join("', '")),
            };
            format!("keel::{op}: {which} a nested tensor; {DENSE}: {NESTED_FIX}")
        }
    }
}

const DENSE: &str = "Keel's ops take dense tensors (layout torch.strided)";
const NESTED_FIX: &str = "call the op on each component (.unbind()) or on .to_padded_tensor(0.0)";

/// What `t` is, where it is not a dense tensor that the shim can tell apart.
fn not_dense(t: &Tensor) -> Option<String> {
    match t.layout() {
        Ok(Some(Layout::Other(Some("torch.jagged"), _))) => {
            return Some(format!("a nested tensor (layout torch.jagged); {DENSE}: {NESTED_FIX}"))
        }
        Ok(Some(layout @ Layout::Other(..))) => {
            return Some(format!("a {layout} tensor; {DENSE}: call .to_dense() first"))
        }
        _ => {}
    }
    match t.dtype() {
        Ok(dtype) if dtype.is_quantized() => {
            Some(format!("a quantized tensor ({dtype}); {DENSE} of floating point: call .dequantize() first"))
        }
        _ => None,
    }
}

/// The argument names of `schema`, in order (`"f(Tensor x, int[] l=[1, 2]) -> T"`
/// gives `["x", "l"]`).
pub(crate) fn arg_names(schema: &str) -> Vec<&str> {
    let Some(args) = schema.split_once('(').and_then(|(_, rest)| rest.rsplit_once(") ->")).map(|(a, _)| a) else {
        return Vec::new();
    };
    let (mut names, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in args.char_indices().chain([(args.len(), ',')]) {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                let arg = args[start..i].split('=').next().unwrap_or("").trim();
                if let Some(name) = arg.rsplit(' ').next().filter(|n| !n.is_empty()) {
                    names.push(name);
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::arg_names;

    #[test]
    fn argument_names_come_from_the_schema_in_order() {
        assert_eq!(arg_names("softmax(Tensor input, float scale=1.0) -> Tensor"), ["input", "scale"]);
        assert_eq!(
            arg_names("f_(Tensor(a!) input, Tensor(b!) residual, Tensor? weight=None, float eps=1e-06) -> ()"),
            ["input", "residual", "weight", "eps"]
        );
        assert_eq!(arg_names("g(int[] l=[1, 2], str s=\"a\") -> (Tensor, Tensor)"), ["l", "s"]);
        assert_eq!(arg_names("h() -> Tensor"), Vec::<&str>::new());
        assert_eq!(arg_names("not a schema"), Vec::<&str>::new());
    }
}
