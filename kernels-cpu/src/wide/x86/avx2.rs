//! [`Lanes`] on 8-lane AVX2 vectors (with FMA, and F16C for f16).
//!
//! AVX2 has no lane masks: a part vector is loaded from and stored to a
//! zeroed stack copy (once per row, at its end), and the part operations
//! blend through a lane-index compare.
use super::super::is;
use super::{Kernel, Lanes, Width};
use crate::math::ROUND_MAGIC_BIASED;
use half::{bf16, f16};
use std::arch::x86_64::*;

/// The token of AVX2 + FMA + F16C: exists only on CPUs that have them.
#[derive(Clone, Copy)]
pub(crate) struct V8(());

impl V8 {
    /// The token, if this CPU has AVX2, FMA and F16C and
    /// `KEEL_CPU_CAPABILITY` allows `avx2` (detected once).
    #[inline(always)]
    pub(crate) fn try_new() -> Option<Self> {
        use std::sync::atomic::{AtomicU8, Ordering};
        // A relaxed atomic, as `has_v4_bf16`: this is read once per row.
        static HAS: AtomicU8 = AtomicU8::new(2);
        let has = match HAS.load(Ordering::Relaxed) {
            2 => {
                let has = crate::capability::cap() >= crate::capability::Capability::Avx2
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c");
                HAS.store(has as u8, Ordering::Relaxed);
                has
            }
            v => v == 1,
        };
        has.then_some(Self(()))
    }

    /// Lanes `< n` all ones, the others zero.
    #[inline(always)]
    fn first(self, n: usize) -> __m256 {
        // SAFETY (all intrinsics in this impl): the token exists only on a
        // CPU with AVX2, FMA and F16C.
        unsafe {
            let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx))
        }
    }
}

/// Calls `k` from code compiled for AVX2, FMA and F16C.
///
/// # Safety
/// The CPU has those features.
#[target_feature(enable = "avx,avx2,fma,f16c")]
unsafe fn enter<K: Kernel>(l: V8, k: K) -> K::Output {
    k.run(l)
}

impl Width for V8 {
    #[inline(always)]
    fn enter<K: Kernel>(self, k: K) -> K::Output {
        // SAFETY: the token exists only on a CPU with those features.
        unsafe { enter(self, k) }
    }
}

/// Each lane rounded to bf16, round to nearest even, in its low 16 bits:
/// `(b + 0x7fff + (b >> 16 & 1)) >> 16` (NaN not fixed up). A function, not
/// a closure, so that it is always inlined into the caller compiled for
/// AVX2.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn bf16_bits(v: __m256) -> __m256i {
    // SAFETY: the caller's.
    unsafe { _mm256_srli_epi32::<16>(bf16_bits_high(v)) }
}

/// [`bf16_bits`] before its shift: each lane's bf16 in its high 16 bits,
/// the low 16 bits left over from the rounding.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn bf16_bits_high(v: __m256) -> __m256i {
    // SAFETY: the caller's.
    unsafe {
        let b = _mm256_castps_si256(v);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb)
    }
}

// SAFETY (every intrinsic below): the token exists only on a CPU with AVX2,
// FMA and F16C; pointers are the callers' to make valid, as each method says.
impl Lanes for V8 {
    const N: usize = 8;
    const REGS: usize = 16;
    const ROUNDS_BF16: bool = false;
    const WRITES_AHEAD: bool = false;
    type V = __m256;

    #[inline(always)]
    fn splat(self, v: f32) -> __m256 {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load<T: 'static>(self, p: *const T) -> __m256 {
        // SAFETY: the caller's: `p..p + 8` readable, `T` one of the three.
        unsafe {
            if is::<T, bf16>() {
                // bf16 to f32: the 16 bits become the high half of each lane.
                let h = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else if is::<T, f16>() {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            } else {
                _mm256_loadu_ps(p.cast())
            }
        }
    }
    #[inline(always)]
    unsafe fn load_part<T: 'static>(self, p: *const T, n: usize) -> __m256 {
        // Zero bytes are 0.0 in each of the three types.
        let mut buf = [0f32; 8];
        // SAFETY: `n < 8` values of at most 4 bytes fit in `buf`; the caller
        // makes `p..p + n` readable.
        unsafe {
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), buf.as_mut_ptr().cast::<u8>(), n * size_of::<T>());
            self.load(buf.as_ptr().cast::<T>())
        }
    }
    #[inline(always)]
    unsafe fn load_pair_unordered<T: 'static>(self, p: *const T) -> (__m256, __m256) {
        // SAFETY: the caller makes `p..p + 16` readable.
        unsafe {
            if is::<T, bf16>() {
                // As AVX-512's: the low bf16 of each lane shifted up, the
                // high one with the low half cleared.
                let v = _mm256_loadu_si256(p.cast());
                let even = _mm256_slli_epi32::<16>(v);
                let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000_u32 as i32));
                (_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd))
            } else {
                (self.load(p), self.load(p.add(8)))
            }
        }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m256) {
        // SAFETY: the caller's.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn store_part(self, p: *mut f32, v: __m256, n: usize) {
        let mut buf = [0f32; 8];
        // SAFETY: `buf` holds 8; the caller makes `p..p + n` writable.
        unsafe {
            _mm256_storeu_ps(buf.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(buf.as_ptr(), p, n);
        }
    }
    #[inline(always)]
    unsafe fn store_bf16_pair(self, _: *mut half::bf16, _: __m256, _: __m256) -> bool {
        // AVX2 has no bf16 conversion; the callers round in software.
        false
    }
    #[inline(always)]
    unsafe fn store_bf16_pair_normal(self, p: *mut half::bf16, lo: __m256, hi: __m256) {
        // Six integer instructions per 8 values and a pack and a permute
        // per 16, where LLVM's vectorised `from_acc` adds the NaN fix-up
        // (a compare, an or and a blend) and packs 8 at a time.
        // SAFETY: the caller makes `p..p + 16` writable.
        unsafe {
            // Each 128-bit half packs four of `lo` then four of `hi` (the
            // values fit: 0..=0xffff); the permute puts `lo`'s first.
            let packed = _mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi));
            _mm256_storeu_si256(p.cast(), _mm256_permute4x64_epi64::<0b11_01_10_00>(packed));
        }
    }
    #[inline(always)]
    unsafe fn store_bf16_pair_normal_even_odd(self, p: *mut half::bf16, even: __m256, odd: __m256) {
        // The rounding of `store_bf16_pair_normal`, less `odd`'s last
        // shift, and one blend per 16 values in place of its pack and
        // permute: each 32-bit lane takes `even`'s bf16 in its low half and
        // `odd`'s in its high half, where the rounding leaves it.
        // SAFETY: the caller makes `p..p + 16` writable.
        unsafe {
            let pairs = _mm256_blend_epi16::<0b1010_1010>(bf16_bits(even), bf16_bits_high(odd));
            _mm256_storeu_si256(p.cast(), pairs);
        }
    }

    #[inline(always)]
    fn round_to<T: 'static>(self, v: __m256) -> __m256 {
        unsafe {
            if is::<T, bf16>() {
                // As `V16::round_to`: the integer round, NaN made quiet.
                let b = _mm256_castps_si256(v);
                let quiet = _mm256_castsi256_ps(_mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000)));
                let rounded = _mm256_castsi256_ps(bf16_bits_high(v));
                let high = _mm256_blendv_ps(rounded, quiet, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                _mm256_and_ps(high, _mm256_castsi256_ps(_mm256_set1_epi32(0xffff_0000_u32 as i32)))
            } else if is::<T, f16>() {
                _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
            } else {
                v
            }
        }
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn fmadd(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn fnmadd(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    fn min(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    fn abs(self, v: __m256) -> __m256 {
        unsafe { _mm256_andnot_ps(_mm256_set1_ps(-0.0), v) }
    }
    #[inline(always)]
    fn copysign(self, mag: __m256, sign: __m256) -> __m256 {
        unsafe {
            let bit = _mm256_set1_ps(-0.0);
            _mm256_or_ps(_mm256_andnot_ps(bit, mag), _mm256_and_ps(bit, sign))
        }
    }
    #[inline(always)]
    fn select_ge(self, a: __m256, b: __m256, then: __m256, other: __m256) -> __m256 {
        // Ordered: false where either is NaN.
        unsafe { _mm256_blendv_ps(other, then, _mm256_cmp_ps::<_CMP_GE_OQ>(a, b)) }
    }
    #[inline(always)]
    fn max_part(self, acc: __m256, v: __m256, n: usize) -> __m256 {
        unsafe { _mm256_blendv_ps(acc, _mm256_max_ps(v, acc), self.first(n)) }
    }
    #[inline(always)]
    fn add_part(self, acc: __m256, v: __m256, n: usize) -> __m256 {
        unsafe { _mm256_blendv_ps(acc, _mm256_add_ps(acc, v), self.first(n)) }
    }
    #[inline(always)]
    fn shl23(self, v: __m256) -> __m256 {
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_castps_si256(v))) }
    }
    #[inline(always)]
    fn mul_pow2(self, y: __m256, _n: __m256, pow2: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(y, pow2) }
    }
    #[inline(always)]
    fn zero_below(self, x: __m256, cutoff: __m256, v: __m256) -> __m256 {
        // "Not less than", unordered: true for NaN, which keeps its lane.
        unsafe { _mm256_and_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(x, cutoff), v) }
    }
    #[inline(always)]
    fn frac_floor(self, t: __m256) -> __m256 {
        unsafe { _mm256_sub_ps(t, _mm256_floor_ps(t)) }
    }
    #[inline(always)]
    fn mul_pow2_floor(self, y: __m256, t: __m256) -> __m256 {
        // `floor(t) + 1.5 * 2^23 + 127` is exact, with `floor(t) + 127` in
        // its low mantissa bits: shifted up, the bits of `2^floor(t)`. (The
        // `vroundps` is the one of `frac_floor`, which LLVM shares.)
        unsafe {
            let k = _mm256_add_ps(_mm256_floor_ps(t), _mm256_set1_ps(ROUND_MAGIC_BIASED));
            _mm256_mul_ps(y, self.shl23(k))
        }
    }
    #[inline(always)]
    fn reduce_add(self, v: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }
    }
    #[inline(always)]
    fn reduce_max(self, v: __m256) -> f32 {
        unsafe {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
        }
    }
}
