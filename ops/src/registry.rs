//! The list of ops and their registration with torch.
use keel_abi::{boxed, refuse, DispatchKey, Library, OpSchema, Result, Tag, REFUSED_KEYS};
use std::sync::OnceLock;

/// One op: its name, schema, boxed kernel (served for CPU, CUDA and Meta) and
/// refusal of the tensors it does not take (see [`keel_abi::refuse`]).
struct OpDef {
    schema: &'static str,
    name: &'static str,
    kernel: keel_abi::sys::BoxedKernel,
    refuse: keel_abi::sys::BoxedKernel,
}

const fn op<K: OpSchema>() -> OpDef {
    OpDef { schema: K::SCHEMA, name: K::NAME, kernel: boxed::<K>, refuse: refuse::<K> }
}

/// Gives each op its schema ([`OpSchema`]) and lists them all in `OPS`.
macro_rules! ops {
    ($($op:path => $schema:expr,)*) => {
        $(impl OpSchema for $op {
            const SCHEMA: &'static str = $schema;
        })*
        const OPS: &[OpDef] = &[$(op::<$op>()),*];
    };
}

ops! {
    crate::abi_selftest::AbiSelfTest =>
        "_abi_selftest(Tensor anchor, Tensor? t, int i, float f, bool b, str s, int[] l, ScalarType dtype) -> (Tensor, Tensor)",
    crate::rms_norm::RmsNorm => "rms_norm(Tensor input, Tensor? weight=None, float eps=1e-06, bool round_before_weight=False) -> Tensor",
    crate::rms_norm::RmsNormBackward =>
        "rms_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, float eps) -> (Tensor, Tensor)",
    crate::layer_norm::LayerNorm =>
        "layer_norm(Tensor input, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor",
    crate::layer_norm::LayerNormBackward =>
        "layer_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
    crate::fused_add_rms_norm::FusedAddRmsNorm =>
        "fused_add_rms_norm(Tensor input, Tensor residual, Tensor? weight=None, float eps=1e-06, bool round_before_weight=False) -> (Tensor, Tensor)",
    crate::fused_add_rms_norm::FusedAddRmsNormInplace =>
        "fused_add_rms_norm_(Tensor(a!) input, Tensor(b!) residual, Tensor? weight=None, float eps=1e-06, bool round_before_weight=False) -> ()",
    crate::fused_add_rms_norm::FusedAddRmsNormBackward =>
        "fused_add_rms_norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor sum, Tensor? weight, float eps) -> (Tensor, Tensor)",
    crate::gated::SiluAndMul => "silu_and_mul(Tensor input) -> Tensor",
    crate::gated::SiluAndMulBackward => "silu_and_mul_backward(Tensor grad_out, Tensor input) -> Tensor",
    crate::gated::GeluAndMul => "gelu_and_mul(Tensor input, str approximate=\"none\") -> Tensor",
    crate::gated::GeluAndMulBackward =>
        "gelu_and_mul_backward(Tensor grad_out, Tensor input, str approximate=\"none\") -> Tensor",
    crate::softmax::Softmax => "softmax(Tensor input, float scale=1.0) -> Tensor",
    crate::softmax::SoftmaxBackward => "softmax_backward(Tensor grad_out, Tensor output, float scale) -> Tensor",
    crate::cross_entropy::CrossEntropy =>
        "cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, str reduction=\"mean\", Tensor? weight=None) -> Tensor",
    crate::cross_entropy::CrossEntropyWithLse =>
        "cross_entropy_with_lse(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, str reduction=\"mean\", Tensor? weight=None) -> (Tensor, Tensor)",
    crate::cross_entropy::CrossEntropyBackward =>
        "cross_entropy_backward(Tensor grad, Tensor logits, Tensor target, int ignore_index, float label_smoothing, str reduction, Tensor? lse=None, Tensor? weight=None) -> Tensor",
    crate::rotary::RotaryEmbedding =>
        "rotary_embedding(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor",
    crate::rotary::RotaryEmbeddingInplace =>
        "rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False) -> ()",
    crate::rotary::RotaryEmbeddingBackward =>
        "rotary_embedding_backward(Tensor grad_out, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
}

/// The ops with autograd: `python/keel/_autograd.py` registers each one's
/// formula as its Python `Autograd` kernel (the backward ops' in
/// `python/keel/_backward_grad.py`: their own derivatives, for a backward op
/// called directly on inputs that need a gradient). Each has a twin,
/// `_{name}_nograd`: its schema and kernels under another name, with no
/// autograd kernel, which the formulas and the typed API call where no
/// gradient is needed.
///
/// (torch 2.13-2.15 had a Rust autograd kernel here instead, forwarding each
/// call through `torch_call_dispatcher` to a twin by grad mode. That call
/// re-raises a Python exception from the formula as a RuntimeError, which
/// broke non-reentrant activation checkpointing: it stops its recomputation
/// with an exception that it catches by type. See `test_checkpoint.py`.)
const WITH_AUTOGRAD: &[&str] = &[
    "rms_norm",
    "layer_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "softmax",
    "cross_entropy",
    "cross_entropy_with_lse",
    "rotary_embedding",
    "rms_norm_backward",
    "layer_norm_backward",
    "fused_add_rms_norm_backward",
    "silu_and_mul_backward",
    "gelu_and_mul_backward",
    "softmax_backward",
    "cross_entropy_backward",
    "rotary_embedding_backward",
];

/// An op to define: one of [`OPS`] under its own name and schema, or under
/// its twin's (`_{name}_nograd`, the same arguments).
struct Defined {
    schema: String,
    name: String,
    op: &'static OpDef,
}

/// The ops to define: [`OPS`], then the `_nograd` twin of each
/// [`WITH_AUTOGRAD`] op (its schema and kernels under the twin's name).
fn all_ops() -> Vec<Defined> {
    let mut all: Vec<_> =
        OPS.iter().map(|op| Defined { schema: op.schema.to_string(), name: op.name.to_string(), op }).collect();
    for &name in WITH_AUTOGRAD {
        let op = OPS.iter().find(|op| op.name == name).expect("every op with autograd is in OPS");
        let args = op.schema.strip_prefix(op.name).filter(|a| a.starts_with('(')).expect("schema starts with the name");
        let twin = format!("_{name}_nograd");
        all.push(Defined { schema: format!("{twin}{args}"), name: twin, op });
    }
    all
}

impl Defined {
    /// The op's tags: `pt2_compliant_tag` for every op but the ABI self-test,
    /// which is Keel's test of its own binding, not an op for models. Each
    /// has its `torch.library.opcheck` test in python/tests (the twins' in
    /// test_tags.py), which is what the tag claims.
    fn tags(&self) -> &'static [Tag] {
        if self.name == "_abi_selftest" {
            &[]
        } else {
            &[Tag::Pt2Compliant]
        }
    }
}

/// Keeps the library fragments alive for the life of the process (dropping
/// one would unregister its kernels).
static LIBRARIES: OnceLock<Vec<Library>> = OnceLock::new();

pub(crate) fn register_all() -> Result<()> {
    let ops = all_ops();
    let def = Library::define_namespace("keel")?;
    for op in &ops {
        def.def_with_tags(&op.schema, op.tags())?;
    }
    let mut libs = vec![def];
    for key in [DispatchKey::Cpu, DispatchKey::Cuda, DispatchKey::Meta] {
        let lib = Library::implement("keel", key)?;
        for op in &ops {
            lib.impl_kernel(&op.name, op.op.kernel)?;
        }
        libs.push(lib);
    }
    // Last, and each key on its own: a key that a later torch no longer
    // parses loses only its clearer error (torch's own is left), not the ops.
    for &key in REFUSED_KEYS {
        let Ok(lib) = Library::implement("keel", DispatchKey::Named(key)) else { continue };
        if ops.iter().all(|op| lib.impl_kernel(&op.name, op.op.refuse).is_ok()) {
            libs.push(lib);
        }
    }
    let _ = LIBRARIES.set(libs);
    Ok(())
}
