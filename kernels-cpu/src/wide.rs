//! Explicit SIMD written once for every x86 vector width: what those kernels
//! share (telling which element type a generic `T` is, the [`x86::Lanes`]
//! vector operations, and running a kernel at the CPU's best width).
//!
//! Most loops leave vectorisation to LLVM (lane arrays, see [`crate::simd`]).
//! Where that proved unstable or wasteful (the vector code changing from one
//! build to the next; the ten constants of `exp` broadcast from memory again
//! on every step and the accumulators spilled to the stack), a kernel has
//! explicit code instead. It is written once, generic over [`x86::Lanes`],
//! and runs with 16-lane AVX-512 vectors ([`x86::V16`]) on CPUs that have
//! [`crate::simd::has_v4_bf16`]'s features, or 8-lane AVX2 vectors
//! ([`x86::V8`], with FMA and F16C) on the others that have those; it runs
//! for f32, bf16 and f16, and the lane loop stays the fallback (f64, other
//! CPUs). So the loop logic (steps, tails, accumulators) that runs on an
//! AVX-512 machine is the code that the tests also run on an AVX2-only one.
use half::{bf16, f16};
use std::any::TypeId;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// Whether `T` is `U` (a constant once monomorphised).
#[inline(always)]
pub(crate) fn is<T: 'static, U: 'static>() -> bool {
    TypeId::of::<T>() == TypeId::of::<U>()
}

/// Whether `T` is one of the types with explicit code: f32, bf16, f16.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn has_lanes<T: 'static>() -> bool {
    is::<T, f32>() || is::<T, bf16>() || is::<T, f16>()
}

/// `x` as a slice of `U`.
///
/// # Panics
/// Unless `T` is `U`.
#[inline(always)]
pub(crate) fn cast<T: 'static, U: 'static>(x: &[T]) -> &[U] {
    assert!(is::<T, U>(), "cast: not the same type");
    // SAFETY: `T` and `U` are the same type.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<U>(), x.len()) }
}

/// `x` as a slice of `U`, when `T` is `U`.
#[inline(always)]
pub(crate) fn cast_mut<T: 'static, U: 'static>(x: &mut [T]) -> Option<&mut [U]> {
    if !is::<T, U>() {
        return None;
    }
    // SAFETY: `T` and `U` are the same type.
    Some(unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<U>(), x.len()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_told_apart() {
        assert!(is::<f32, f32>() && !is::<f32, f64>() && !is::<bf16, f16>());
        assert!(has_lanes::<f32>() && has_lanes::<bf16>() && has_lanes::<f16>());
        assert!(!has_lanes::<f64>() && !has_lanes::<u16>());
        let mut v = [1.0f32, 2.0];
        assert_eq!(cast_mut::<f32, f32>(&mut v).map(|s| s.len()), Some(2));
        assert!(cast_mut::<f32, u32>(&mut v).is_none());
    }
}
