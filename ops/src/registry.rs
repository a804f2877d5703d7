//! The list of ops and their registration with torch.
use keel_abi::{boxed, BoxedOp, DispatchKey, Library, Result};
use std::sync::OnceLock;

/// One op: its schema and its boxed kernel (served for CPU, CUDA and Meta).
struct OpDef {
    schema: &'static str,
    name: &'static str,
    kernel: keel_abi::sys::BoxedKernel,
}

const fn op<K: BoxedOp>(schema: &'static str) -> OpDef {
    OpDef { schema, name: K::NAME, kernel: boxed::<K> }
}

const OPS: &[OpDef] = &[
    op::<crate::abi_selftest::AbiSelfTest>(
        "_abi_selftest(Tensor anchor, Tensor? t, int i, float f, bool b, str s, int[] l, ScalarType dtype) -> (Tensor, Tensor)",
    ),
    op::<crate::rms_norm::RmsNorm>("rms_norm(Tensor input, Tensor? weight=None, float eps=1e-06) -> Tensor"),
    op::<crate::rms_norm::RmsNormBackward>(
        "rms_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, float eps) -> (Tensor, Tensor)",
    ),
    op::<crate::layer_norm::LayerNorm>(
        "layer_norm(Tensor input, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor",
    ),
    op::<crate::layer_norm::LayerNormBackward>(
        "layer_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
    ),
    op::<crate::fused_add_rms_norm::FusedAddRmsNorm>(
        "fused_add_rms_norm(Tensor input, Tensor residual, Tensor? weight=None, float eps=1e-06) -> (Tensor, Tensor)",
    ),
    op::<crate::fused_add_rms_norm::FusedAddRmsNormInplace>(
        "fused_add_rms_norm_(Tensor(a!) input, Tensor(b!) residual, Tensor? weight=None, float eps=1e-06) -> ()",
    ),
    op::<crate::fused_add_rms_norm::FusedAddRmsNormBackward>(
        "fused_add_rms_norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor sum, Tensor? weight, float eps) -> (Tensor, Tensor)",
    ),
    op::<crate::gated::SiluAndMul>("silu_and_mul(Tensor input) -> Tensor"),
    op::<crate::gated::SiluAndMulBackward>("silu_and_mul_backward(Tensor grad_out, Tensor input) -> Tensor"),
    op::<crate::gated::GeluAndMul>("gelu_and_mul(Tensor input, str approximate=\"none\") -> Tensor"),
    op::<crate::gated::GeluAndMulBackward>(
        "gelu_and_mul_backward(Tensor grad_out, Tensor input, str approximate=\"none\") -> Tensor",
    ),
    op::<crate::softmax::Softmax>("softmax(Tensor input, float scale=1.0) -> Tensor"),
    op::<crate::softmax::SoftmaxBackward>("softmax_backward(Tensor grad_out, Tensor output, float scale) -> Tensor"),
    op::<crate::cross_entropy::CrossEntropy>(
        "cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, str reduction=\"mean\") -> Tensor",
    ),
    op::<crate::cross_entropy::CrossEntropyWithLse>(
        "cross_entropy_with_lse(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, str reduction=\"mean\") -> (Tensor, Tensor)",
    ),
    op::<crate::cross_entropy::CrossEntropyBackward>(
        "cross_entropy_backward(Tensor grad, Tensor logits, Tensor target, int ignore_index, float label_smoothing, str reduction, Tensor? lse=None) -> Tensor",
    ),
    op::<crate::rotary::RotaryEmbedding>(
        "rotary_embedding(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor",
    ),
    op::<crate::rotary::RotaryEmbeddingInplace>(
        "rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False) -> ()",
    ),
    op::<crate::rotary::RotaryEmbeddingBackward>(
        "rotary_embedding_backward(Tensor grad_out, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
    ),
];

/// Keeps the library fragments alive for the life of the process (dropping
/// one would unregister its kernels).
static LIBRARIES: OnceLock<Vec<Library>> = OnceLock::new();

pub(crate) fn register_all() -> Result<()> {
    let def = Library::define_namespace("keel")?;
    for op in OPS {
        def.def(op.schema)?;
    }
    let mut libs = vec![def];
    for key in [DispatchKey::Cpu, DispatchKey::Cuda, DispatchKey::Meta] {
        let lib = Library::implement("keel", key)?;
        for op in OPS {
            lib.impl_kernel(op.name, op.kernel)?;
        }
        libs.push(lib);
    }
    let _ = LIBRARIES.set(libs);
    Ok(())
}
