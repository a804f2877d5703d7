//! Keel's CPU kernels over plain slices.
//!
//! Every kernel takes `&[T]` inputs, `&mut [T]` outputs (`T` in `f32`, `f64`,
//! [`struct@half::f16`], [`half::bf16`]) and an explicit [`Par`]: the caller decides
//! whether work runs on the calling thread, on rayon's pool, or on a pool the
//! caller owns (torch's intra-op pool when called from the torch operators).
//! No kernel starts threads of its own or hides where its parallelism comes from.
//!
//! SIMD is chosen at run time ([`pulp::Arch`]): one binary uses AVX-512, AVX2+FMA
//! or SSE, whichever the machine has, or a lower level that the environment
//! variable `KEEL_CPU_CAPABILITY` names ([`capability`]). Each kernel sits
//! beside a plain scalar reference with f64 accumulation (`*_ref`), which the
//! property tests compare against.
#![warn(missing_docs)]

mod capability;
pub mod cross_entropy;
pub mod cross_entropy_probs;
mod element;
mod error;
pub mod fused_add_rms_norm;
pub mod gated;
pub mod layer_norm;
mod layout;
mod math;
mod narrow;
mod par;
mod prefault;
pub mod rms_norm;
pub mod rotary;
mod rows;
mod simd;
pub mod softmax;
mod sum_squares;
#[cfg(test)]
mod testing;
mod wide;
mod widen;

pub use capability::{capability, Capability, CAPABILITY_VAR};
pub use element::{Acc, Element};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use layout::{Offsets, RowLayout};
pub use par::{Par, ParallelFor, OUTSIDE_POOL_MIN_ELEMS};
