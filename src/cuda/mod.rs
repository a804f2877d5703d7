//! CUDA devices, the PTX module cache, and typed launches.
//!
//! Everything here works on any `cudarc` stream: one the caller created, or
//! one that wraps a stream owned by someone else (torch's current stream, via
//! [`Gpu::borrowed_stream`]). The driver library is loaded at run time: on a
//! machine without CUDA, [`is_available`] is false and every entry point
//! returns [`crate::Error::NoCuda`] instead of panicking.
//!
//! Inside the crate, each op's launch code runs on a `Target`: a GPU and a
//! stream for the public entry points, or in tests a CPU emulation of the
//! kernels (`emu`, see the README's "Testing the CUDA path without a GPU").
mod choice;
mod device;
mod dtype;
mod launch;

pub(crate) use choice::NormKeep;
pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
pub use device::{device_count, gpu, is_available, Gpu};
pub use dtype::{CudaElement, DType};
pub(crate) use launch::{launch_rows, rows_config, rows_config_packs, Arg, Module, Stream, Target};

#[cfg(test)]
pub(crate) mod emu;
