use half::{bf16, f16};

/// Element types of the CUDA kernels (f64 runs on the CPU only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// float32
    F32,
    /// float16
    F16,
    /// bfloat16
    BF16,
}

impl DType {
    /// Suffix of the kernel symbols (`rms_norm_fwd_bf16`).
    pub fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// A Rust element type with a CUDA kernel.
pub trait CudaElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy {
    /// Its [`DType`].
    const DTYPE: DType;
}

impl CudaElement for f32 {
    const DTYPE: DType = DType::F32;
}
impl CudaElement for f16 {
    const DTYPE: DType = DType::F16;
}
impl CudaElement for bf16 {
    const DTYPE: DType = DType::BF16;
}
