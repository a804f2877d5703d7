//! One module per operator, each with CPU entry points (over slices) and CUDA
//! entry points (over `cudarc` buffers, or raw device pointers for callers that
//! own their memory, such as the torch operators).
pub mod rms_norm;
