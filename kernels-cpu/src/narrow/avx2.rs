//! Narrowing f32 values to f16 with F16C's `vcvtps2ph` beside AVX2: exactly
//! what [`Element::from_acc`](crate::Element::from_acc) gives, value by
//! value. (bf16 stays with the scalar rounding on these CPUs: see
//! `bf16_slice`.)
//!
//! [`f16_slice`] is the one function compiled for AVX2 (called once per
//! block of [`super::BLOCK`] values); the group function and its intrinsics
//! inline into it.
use half::f16;
use std::arch::x86_64::*;

/// f32 values to f16 (`src` and `dst` of one length), mapped to
/// `v * scale - shift` first when `AFFINE`: 32 at a time with `vcvtps2ph`,
/// the rest with `sw` (which must apply the map itself).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx,avx2,fma,f16c")]
pub(super) unsafe fn f16_slice<const AFFINE: bool>(
    src: &[f32],
    map: (f32, f32),
    dst: &mut [f16],
    sw: impl Fn(f32) -> f16,
) {
    let whole = src.len().min(dst.len()) / 32 * 32;
    let ((s32, s_rest), (d32, d_rest)) = (src.split_at(whole), dst.split_at_mut(whole));
    for (s, d) in s32.chunks_exact(32).zip(d32.chunks_exact_mut(32)) {
        let (s, d): (&[f32; 32], &mut [f16; 32]) = (s.try_into().expect("32"), d.try_into().expect("32"));
        // SAFETY: this function's features.
        unsafe { f16_x32::<AFFINE>(s, map, d) };
    }
    for (d, s) in d_rest.iter_mut().zip(s_rest) {
        *d = sw(*s);
    }
}

/// Eight values, mapped to `v * scale - shift` when `AFFINE` (`vmulps` then
/// `vsubps`, as the scalar expression: no fused multiply-add).
///
/// # Safety
/// AVX; `p..p + 8` readable.
#[inline(always)]
unsafe fn load8<const AFFINE: bool>(p: *const f32, (scale, shift): (f32, f32)) -> __m256 {
    // SAFETY: the caller's.
    unsafe {
        let v = _mm256_loadu_ps(p);
        if AFFINE {
            _mm256_sub_ps(_mm256_mul_ps(v, _mm256_set1_ps(scale)), _mm256_set1_ps(shift))
        } else {
            v
        }
    }
}

/// Narrows 32 values (mapped when `AFFINE`) to f16 with `vcvtps2ph`, round
/// to nearest even, subnormals included.
///
/// # Safety
/// The CPU must have AVX and F16C.
#[inline(always)]
unsafe fn f16_x32<const AFFINE: bool>(src: &[f32; 32], map: (f32, f32), dst: &mut [f16; 32]) {
    // F16C's immediate has 3 bits (no "no exceptions" flag): round to
    // nearest even.
    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;
    let (p, q) = (src.as_ptr(), dst.as_mut_ptr().cast::<__m128i>());
    for k in 0..4 {
        // SAFETY: `src` holds 32 f32 and `dst` 32 f16; 8 per step.
        unsafe { _mm_storeu_si128(q.add(k), _mm256_cvtps_ph::<RNE>(load8::<AFFINE>(p.add(8 * k), map))) };
    }
}
