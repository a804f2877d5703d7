//! [`Lanes`] on 16-lane AVX-512 vectors, with lane masks for the parts.
use super::super::is;
use super::{Kernel, Lanes, Width};
use crate::simd::has_v4_bf16;
use half::{bf16, f16};
use std::arch::x86_64::*;

/// The token of AVX512F, BW, VL and FMA (as part of
/// [`has_v4_bf16`]'s set): exists only on CPUs that have them.
#[derive(Clone, Copy)]
pub(crate) struct V16(());

impl V16 {
    /// The token, if this CPU has [`has_v4_bf16`]'s features.
    #[inline(always)]
    pub(crate) fn try_new() -> Option<Self> {
        has_v4_bf16().then_some(Self(()))
    }
}

/// The mask of the first `n` lanes (all 16 when `n >= 16`).
#[inline(always)]
fn first(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        (1u16 << n) - 1
    }
}

/// Calls `k` from code compiled for [`has_v4_bf16`]'s whole set (the same
/// list as `simd::v4_bf16`), which the token guarantees.
///
/// A narrower set (AVX512F, BW, VL, FMA, as before) left `narrow`'s
/// `bf16_x32` (compiled for AVX512-BF16 and DQ too) out of line: a call,
/// spilled registers and a `vzeroupper` for every 32 bf16 values written.
/// perf put 27% of layer_norm bf16 forward in that call.
///
/// # Safety
/// The CPU has those features.
#[target_feature(
    enable = "avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx512bf16,avx2,fma,bmi1,bmi2,lzcnt,popcnt,f16c"
)]
unsafe fn enter<K: Kernel>(l: V16, k: K) -> K::Output {
    k.run(l)
}

impl Width for V16 {
    #[inline(always)]
    fn enter<K: Kernel>(self, k: K) -> K::Output {
        // SAFETY: the token exists only on a CPU with those features.
        unsafe { enter(self, k) }
    }
}

// SAFETY (every intrinsic below): the token exists only on a CPU with
// AVX512F, BW, VL and FMA; pointers are the callers' to make valid, as each
// method says.
impl Lanes for V16 {
    const N: usize = 16;
    const REGS: usize = 32;
    const ROUNDS_BF16: bool = true;
    const WRITES_AHEAD: bool = true;
    type V = __m512;

    #[inline(always)]
    fn splat(self, v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load<T: 'static>(self, p: *const T) -> __m512 {
        // SAFETY: the caller's.
        unsafe { self.load_part(p, 16) }
    }
    #[inline(always)]
    unsafe fn load_part<T: 'static>(self, p: *const T, n: usize) -> __m512 {
        // SAFETY: the masked loads read only the first `n` lanes, which the
        // caller makes readable.
        unsafe {
            if is::<T, bf16>() {
                // bf16 to f32: the 16 bits become the high half of each lane.
                let h = _mm256_maskz_loadu_epi16(first(n), p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else if is::<T, f16>() {
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p.cast()))
            } else {
                _mm512_maskz_loadu_ps(first(n), p.cast())
            }
        }
    }
    #[inline(always)]
    unsafe fn load_pair_unordered<T: 'static>(self, p: *const T) -> (__m512, __m512) {
        // SAFETY: the caller makes `p..p + 32` readable.
        unsafe {
            if is::<T, bf16>() {
                // Each 32-bit lane holds two bf16: the low one (shifted up)
                // and the high one (the low half cleared) are both f32.
                let v = _mm512_loadu_si512(p.cast());
                let even = _mm512_slli_epi32::<16>(v);
                let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000_u32 as i32));
                (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
            } else {
                (self.load(p), self.load(p.add(16)))
            }
        }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m512) {
        // SAFETY: the caller's.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, v: __m512, n: usize) {
        // SAFETY: the masked store writes only the first `n` lanes.
        unsafe { _mm512_mask_storeu_ps(p, first(n), v) }
    }

    #[inline(always)]
    unsafe fn store_bf16_pair(self, p: *mut bf16, lo: __m512, hi: __m512) -> bool {
        // SAFETY: the token guarantees AVX512-BF16 and DQ (`has_v4_bf16`);
        // the caller makes the 32 values (64 bytes) at `p` writable.
        unsafe { crate::narrow::x86::bf16_pair(p, lo, hi) }
    }
    #[inline(always)]
    unsafe fn store_bf16_pair_normal(self, p: *mut bf16, lo: __m512, hi: __m512) {
        // SAFETY: as `store_bf16_pair`.
        unsafe { crate::narrow::x86::bf16_pair_unchecked(p, lo, hi) };
    }

    #[inline(always)]
    fn round_to<T: 'static>(self, v: __m512) -> __m512 {
        unsafe {
            if is::<T, bf16>() {
                // The integer round to nearest even (exact for subnormals,
                // which `vcvtneps2bf16` flushes), a NaN made quiet and cut
                // as `half` cuts it.
                let b = _mm512_castps_si512(v);
                let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
                let rounded = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
                let quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
                let high = _mm512_mask_blend_epi32(nan, rounded, quiet);
                _mm512_castsi512_ps(_mm512_and_si512(high, _mm512_set1_epi32(0xffff_0000_u32 as i32)))
            } else if is::<T, f16>() {
                _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
            } else {
                v
            }
        }
    }
    #[inline(always)]
    fn round_bf16_pair(self, a: __m512, b: __m512) -> (__m512, __m512) {
        // Word `2 i` of a 32-bit lane pair takes word `i` (`a`'s lane `i`)
        // of the packed conversion, word `2 i + 1` word `16 + i` (`b`'s).
        const INTERLEAVE: [u16; 32] = {
            let mut idx = [0u16; 32];
            let mut i = 0;
            while i < 16 {
                idx[2 * i] = i as u16;
                idx[2 * i + 1] = 16 + i as u16;
                i += 1;
            }
            idx
        };
        // SAFETY: the token guarantees AVX512-BF16, BW and DQ; `INTERLEAVE`
        // holds 64 bytes; `__m512bh` and `__m512i` are both 512 bits.
        unsafe {
            if crate::narrow::x86::has_subnormal(a, b) {
                return (self.round_to::<bf16>(a), self.round_to::<bf16>(b));
            }
            // `vcvtne2ps2bf16` rounds to nearest even and quiets a NaN as
            // `half` does; it differs only on subnormals, checked above.
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
            let lanes = _mm512_permutexvar_epi16(_mm512_loadu_si512(INTERLEAVE.as_ptr().cast()), packed);
            let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
            (_mm512_castsi512_ps(_mm512_slli_epi32::<16>(lanes)), _mm512_castsi512_ps(_mm512_and_si512(lanes, high)))
        }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn fmadd(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn fnmadd(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn min(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn abs(self, v: __m512) -> __m512 {
        unsafe { _mm512_abs_ps(v) }
    }
    #[inline(always)]
    fn copysign(self, mag: __m512, sign: __m512) -> __m512 {
        unsafe {
            // Bits of `sign` where the mask is set (the sign bit), of `mag` elsewhere.
            let bit = _mm512_set1_epi32(i32::MIN);
            let (m, s) = (_mm512_castps_si512(mag), _mm512_castps_si512(sign));
            _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(bit, m), _mm512_and_si512(bit, s)))
        }
    }
    #[inline(always)]
    fn select_ge(self, a: __m512, b: __m512, then: __m512, other: __m512) -> __m512 {
        // Ordered: false where either is NaN.
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, b), other, then) }
    }
    #[inline(always)]
    fn max_part(self, acc: __m512, v: __m512, n: usize) -> __m512 {
        unsafe { _mm512_mask_max_ps(acc, first(n), v, acc) }
    }
    #[inline(always)]
    fn add_part(self, acc: __m512, v: __m512, n: usize) -> __m512 {
        unsafe { _mm512_mask_add_ps(acc, first(n), acc, v) }
    }
    #[inline(always)]
    fn shl23(self, v: __m512) -> __m512 {
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_castps_si512(v))) }
    }
    #[inline(always)]
    fn mul_pow2(self, y: __m512, n: __m512, _pow2: __m512) -> __m512 {
        // One instruction where AVX2 needs the shift (and often an add)
        // that makes `pow2`, then the multiply.
        unsafe { _mm512_scalef_ps(y, n) }
    }
    #[inline(always)]
    fn zero_below(self, x: __m512, cutoff: __m512, v: __m512) -> __m512 {
        // "Not less than", unordered: true for NaN, which keeps its lane.
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, cutoff), v) }
    }
    #[inline(always)]
    fn frac_floor(self, t: __m512) -> __m512 {
        // Not `vreduceps` (one instruction): its difference came out a unit
        // in the last place below AVX2's and the scalar `t - t.floor()` (it
        // is rounded in the imm8's direction, down, not to nearest).
        unsafe { _mm512_sub_ps(t, _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t)) }
    }
    #[inline(always)]
    fn mul_pow2_floor(self, y: __m512, t: __m512) -> __m512 {
        // `vscalefps` scales by `2^floor(t)`: no rounding of `t` needed.
        unsafe { _mm512_scalef_ps(y, t) }
    }
    #[inline(always)]
    fn reduce_add(self, v: __m512) -> f32 {
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    fn reduce_max(self, v: __m512) -> f32 {
        unsafe { _mm512_reduce_max_ps(v) }
    }
}
