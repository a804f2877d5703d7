//! Safe Rust binding of the LibTorch **stable C ABI** (torch >= 2.10).
//!
//! Nothing of libtorch is needed at build time: every C function is resolved
//! when the library is first used, from the `libtorch_cpu.so` (and, where
//! present, `libtorch_cuda.so`) that the running Python process already loaded
//! (see [`sys`]). Functions newer than 2.10 are optional and used when present,
//! so one build serves every torch from 2.10 on.
//!
//! What it offers:
//! - [`Tensor`]: an owning tensor handle (sizes, strides, dtype, device, data,
//!   allocation of new tensors);
//! - [`FromStack`] / [`IntoStack`]: unboxing and boxing of op arguments and
//!   results on torch's `StableIValue` stack;
//! - [`BoxedOp`] and [`boxed`]: the one generic `extern "C-unwind"` entry
//!   point every op is registered through (panics caught, errors raised as a
//!   Python `RuntimeError`);
//! - [`Library`]: schema definitions and per-dispatch-key implementations;
//! - [`refuse`]: the kernel an op has for sparse, quantized and nested
//!   tensors, raising an error that names the argument;
//! - [`DeviceGuard`], [`current_cuda_stream`], [`parallel_for`].
//!
//! It knows nothing of kernels or op names.
#![warn(missing_docs)]

mod boxed;
mod cuda;
mod error;
mod library;
mod parallel;
mod refuse;
mod stack;
pub mod sys;
mod tensor;
mod types;

pub use boxed::{boxed, BoxedOp};
pub use cuda::{current_cuda_stream, DeviceGuard};
pub use error::{raise, Error, Result};
pub use library::{DispatchKey, Library, Tag};
pub use parallel::{get_num_threads, parallel_for};
pub use refuse::{refuse, OpSchema, REFUSED_KEYS};
pub use stack::{FromStack, IntoStack, StableIValue};
pub use tensor::Tensor;
pub use types::{Device, DeviceType, Layout, ScalarType};

/// The stable-ABI version this crate is built against: torch 2.10.
pub const EXTENSION_BUILD_VERSION: u64 = (2 << 56) | (10 << 48);
