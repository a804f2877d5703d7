//! Writing f32 results as bf16 or f16: blocks of [`BLOCK`] values computed
//! into a scratch block, then narrowed with the CPU's conversion instruction
//! where it has one.
//!
//! Rounding f32 to bf16 in software takes about a dozen vector instructions
//! per 16 values (round to nearest even, a NaN fix-up, then packing), which
//! made the bf16 kernels compute-bound. AVX512-BF16's `vcvtne2ps2bf16` does
//! the rounding and the packing of 32 values in one instruction. It flushes
//! f32 subnormals to zero, though, where torch (and `half`) round them to bf16
//! subnormals; so a block holding any subnormal (one `vfpclassps` per 16
//! values finds it) takes the software path instead. The results are
//! bit-identical to [`Element::from_acc`](crate::Element::from_acc) either way;
//! the tests sweep f32 bit patterns through both paths.
//!
//! f16 uses `vcvtps2ph` (AVX-512's, or F16C's beside AVX2 in
//! `narrow/avx2.rs`), which rounds like IEEE (subnormals included). bf16 on
//! AVX2 CPUs keeps the scalar rounding that LLVM vectorises: an explicit
//! AVX2 version (8 lanes of add, shift, NaN blend, then a pack) measured
//! 10-20% slower in rms_norm and silu_and_mul bf16, and one that packs 16
//! at a time and sends a group holding NaN (one compare per 16) to the
//! scalar rounding was up to 8% faster in the best times but 1-12% slower
//! in the median (session 53, a Zen 3). Most passes are now the
//! exceptions, rounding in registers with no NaN check at all
//! (`Lanes::store_bf16_pair_normal`): softmax's last pass and
//! cross_entropy's backward, whose values hold no NaN where the row's sum is
//! finite (`softmax::affine_bf16`); and the forwards of the norms and the
//! gated ops, the gated backward, and the `dx` of the norms' explicit
//! backwards, whose NaNs (quiet, with their low 16 bits zero) that rounding
//! keeps as `from_acc` does (`RowValues::ARITHMETIC` in
//! `wide/x86/write_row.rs`).
use crate::element::Acc;
use half::{bf16, f16};

/// Values narrowed per block: a multiple of 32 (two AVX-512 registers of
/// f32). 128 measured best: blocks of 32 cost more per value than the
/// software rounding in the norm backwards, and blocks of 512 were slower
/// everywhere (the block is zeroed on each call).
pub(crate) const BLOCK: usize = 128;

/// Writes `out` block by block: `fill(start, buf)` computes the values of
/// `out[start..start + buf.len()]` into `buf` (length [`BLOCK`], shorter for
/// the last block), which `narrow` then rounds into `out`.
#[inline(always)]
pub(crate) fn write_blocks<T, A: Acc>(
    out: &mut [T],
    mut fill: impl FnMut(usize, &mut [A]),
    narrow: impl Fn(&[A], &mut [T]),
) {
    let mut buf = [A::ZERO; BLOCK];
    let mut blocks = out.chunks_exact_mut(BLOCK);
    let mut start = 0;
    for o in &mut blocks {
        fill(start, &mut buf);
        narrow(&buf, o);
        start += BLOCK;
    }
    let rest = blocks.into_remainder();
    if !rest.is_empty() {
        let b = &mut buf[..rest.len()];
        fill(start, b);
        narrow(b, rest);
    }
}

/// Rewrites `out` in place block by block: `buf` holds a block's current
/// values widened by `widen`, `update(start, buf)` changes them, and
/// `narrow` rounds them back into `out[start..start + buf.len()]`. The
/// in-place counterpart of [`write_blocks`].
#[inline(always)]
pub(crate) fn update_blocks<T: Copy, A: Acc>(
    out: &mut [T],
    mut update: impl FnMut(usize, &mut [A]),
    widen: impl Fn(T) -> A,
    narrow: impl Fn(&[A], &mut [T]),
) {
    let mut buf = [A::ZERO; BLOCK];
    for (i, o) in out.chunks_mut(BLOCK).enumerate() {
        let b = &mut buf[..o.len()];
        for (b, o) in b.iter_mut().zip(o.iter()) {
            *b = widen(*o);
        }
        update(i * BLOCK, b);
        narrow(b, o);
    }
}

/// f32 values to bf16 (`src` and `dst` of one length), each first mapped to
/// `v * scale - shift` when `AFFINE`: 32 at a time with the AVX512-BF16 instruction
/// when this code runs under [`crate::simd::dispatch`] on a CPU that has it,
/// the rest with `sw` (which must apply the map itself).
#[inline(always)]
pub(crate) fn bf16_slice<const AFFINE: bool>(src: &[f32], map: (f32, f32), dst: &mut [bf16], sw: impl Fn(f32) -> bf16) {
    // SAFETY: `narrow_slice` calls `hw` only where `has_v4_bf16` found every
    // feature `x86::bf16_x32` is compiled for.
    #[cfg(target_arch = "x86_64")]
    narrow_slice(
        src,
        dst,
        #[inline(always)]
        |s, d| unsafe { x86::bf16_x32::<AFFINE>(s, map, d) },
        sw,
    );
    // No conversion instruction here: `sw` applies the map to every value.
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = map;
        narrow_slice(src, dst, |_, _| false, sw);
    }
}

/// f32 values to f16, as [`bf16_slice`], with `vcvtps2ph`: AVX-512's, or
/// F16C's on CPUs with AVX2 but not [`crate::simd::has_v4_bf16`]'s set.
#[inline(always)]
pub(crate) fn f16_slice<const AFFINE: bool>(src: &[f32], map: (f32, f32), dst: &mut [f16], sw: impl Fn(f32) -> f16) {
    #[cfg(target_arch = "x86_64")]
    if !crate::simd::has_v4_bf16() && crate::wide::x86::V8::try_new().is_some() {
        // SAFETY: `V8::try_new` found AVX2, FMA and F16C.
        return unsafe { avx2::f16_slice::<AFFINE>(src, map, dst, sw) };
    }
    // SAFETY: as above (AVX512F is one of the features checked).
    #[cfg(target_arch = "x86_64")]
    narrow_slice(
        src,
        dst,
        #[inline(always)]
        |s, d| unsafe { x86::f16_x32::<AFFINE>(s, map, d) },
        sw,
    );
    // No conversion instruction here: `sw` applies the map to every value.
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = map;
        narrow_slice(src, dst, |_, _| false, sw);
    }
}

/// The loop of both: `hw` on each whole group of 32 (where it returns false,
/// `sw` redoes the group), then `sw` on the rest. `hw` runs only where
/// [`crate::simd::has_v4_bf16`] holds.
#[inline(always)]
fn narrow_slice<T>(src: &[f32], dst: &mut [T], hw: impl Fn(&[f32; 32], &mut [T; 32]) -> bool, sw: impl Fn(f32) -> T) {
    let (mut src, mut dst) = (src, dst);
    if crate::simd::has_v4_bf16() {
        let whole = src.len().min(dst.len()) / 32 * 32;
        let ((s32, s_rest), (d32, d_rest)) = (src.split_at(whole), dst.split_at_mut(whole));
        for (s, d) in s32.chunks_exact(32).zip(d32.chunks_exact_mut(32)) {
            let (s, d): (&[f32; 32], &mut [T; 32]) = (s.try_into().expect("32"), d.try_into().expect("32"));
            if !hw(s, &mut *d) {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = sw(*s);
                }
            }
        }
        (src, dst) = (s_rest, d_rest);
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = sw(*s);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// The 32 values, mapped to `v * scale - shift` when `AFFINE` (`vmulps`
    /// then `vsubps`, rounded as the scalar expression is: no fused
    /// multiply-add).
    ///
    /// # Safety
    /// The CPU must have AVX512F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_x32<const AFFINE: bool>(src: &[f32; 32], (scale, shift): (f32, f32)) -> (__m512, __m512) {
        // SAFETY: `src` holds 32 f32; unaligned loads.
        let (lo, hi) = unsafe { (_mm512_loadu_ps(src.as_ptr()), _mm512_loadu_ps(src.as_ptr().add(16))) };
        if AFFINE {
            let (s, t) = (_mm512_set1_ps(scale), _mm512_set1_ps(shift));
            (_mm512_sub_ps(_mm512_mul_ps(lo, s), t), _mm512_sub_ps(_mm512_mul_ps(hi, s), t))
        } else {
            (lo, hi)
        }
    }

    /// Whether a lane of `lo` or `hi` is an f32 subnormal, which AVX512-BF16's
    /// conversions flush to zero where `from_acc` rounds it (one `vfpclassps`
    /// per 16 values).
    #[target_feature(enable = "avx512f,avx512dq")]
    #[inline]
    pub(crate) fn has_subnormal(lo: __m512, hi: __m512) -> bool {
        const SUBNORMAL: i32 = 0x20;
        _mm512_fpclass_ps_mask::<SUBNORMAL>(lo) | _mm512_fpclass_ps_mask::<SUBNORMAL>(hi) != 0
    }

    /// Rounds `lo` then `hi` to 32 bf16 at `p` with `vcvtne2ps2bf16` and
    /// returns true, unless a lane is an f32 subnormal ([`has_subnormal`]):
    /// then it returns false and writes nothing.
    ///
    /// # Safety
    /// The CPU must have AVX512F, AVX512BW, AVX512DQ and AVX512-BF16;
    /// `p..p + 32` is writable (unaligned).
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    #[inline]
    pub(crate) unsafe fn bf16_pair(p: *mut bf16, lo: __m512, hi: __m512) -> bool {
        if has_subnormal(lo, hi) {
            return false;
        }
        // SAFETY: the caller's.
        unsafe { bf16_pair_unchecked(p, lo, hi) };
        true
    }

    /// [`bf16_pair`] without the check, for values the caller knows hold no
    /// f32 subnormal (one would be flushed to zero: a wrong rounding, not
    /// undefined behaviour).
    ///
    /// # Safety
    /// As [`bf16_pair`].
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    #[inline]
    pub(crate) unsafe fn bf16_pair_unchecked(p: *mut bf16, lo: __m512, hi: __m512) {
        // SAFETY: the caller makes the 64 bytes at `p` writable; `__m512bh`
        // and `__m512i` are both 512 bits.
        unsafe {
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(p.cast(), packed);
        }
    }

    /// Narrows (the values mapped when `AFFINE`) with [`bf16_pair`]: false,
    /// writing nothing, where the block holds an f32 subnormal.
    ///
    /// # Safety
    /// The CPU must have AVX512F, AVX512BW, AVX512DQ and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    #[inline]
    pub(super) unsafe fn bf16_x32<const AFFINE: bool>(src: &[f32; 32], map: (f32, f32), dst: &mut [bf16; 32]) -> bool {
        // SAFETY: `src` holds 32 f32 and `dst` 32 bf16 (64 bytes).
        unsafe {
            let (lo, hi) = load_x32::<AFFINE>(src, map);
            bf16_pair(dst.as_mut_ptr(), lo, hi)
        }
    }

    /// Narrows (the values mapped when `AFFINE`) with `vcvtps2ph`, round to nearest even (always succeeds:
    /// returns true).
    ///
    /// # Safety
    /// The CPU must have AVX512F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn f16_x32<const AFFINE: bool>(src: &[f32; 32], map: (f32, f32), dst: &mut [f16; 32]) -> bool {
        const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        // SAFETY: `src` holds 32 f32 and `dst` 32 f16 (64 bytes).
        unsafe {
            let (lo, hi) = load_x32::<AFFINE>(src, map);
            let (lo, hi) = (_mm512_cvtps_ph::<RNE>(lo), _mm512_cvtps_ph::<RNE>(hi));
            _mm256_storeu_si256(dst.as_mut_ptr().cast(), lo);
            _mm256_storeu_si256(dst.as_mut_ptr().add(16).cast(), hi);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use crate::element::Element;
    use crate::simd::dispatch;
    use half::{bf16, f16};

    /// f32 bit patterns that cover every exponent with mixed low bits, the
    /// subnormals, the values halfway between two bf16 or f16 values, and the
    /// specials.
    fn samples() -> Vec<f32> {
        let mut v: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
        v.extend((0..=u16::MAX).flat_map(|h| {
            let b = (h as u32) << 16;
            [b, b | 0x8000, b | 0x7fff, b | 0x8001].map(f32::from_bits)
        }));
        v.extend((0..=u16::MAX).map(|h| f32::from_bits(f16::from_bits(h).to_f32().to_bits() + (1 << 12))));
        v.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, 1e-40, -1e-45]);
        v
    }

    fn same<T: Element + PartialEq>(a: T, b: T, is_nan: impl Fn(T) -> bool) -> bool {
        a == b || (is_nan(a) && is_nan(b))
    }

    fn check<T: Element<Acc = f32> + PartialEq + std::fmt::Debug>(is_nan: impl Fn(T) -> bool, bits: impl Fn(T) -> u16) {
        let src = samples();
        // Offsets 0..3 move subnormals and specials across block boundaries;
        // the odd lengths leave a partial last block.
        for off in 0..3 {
            let src = &src[off..];
            let mut out = vec![T::default(); src.len()];
            dispatch(
                #[inline(always)]
                || {
                    T::write_acc(
                        &mut out,
                        #[inline(always)]
                        |at, b| b.copy_from_slice(&src[at..][..b.len()]),
                    )
                },
            );
            expect(&out, src, (1.0, 0.0), &is_nan, &bits);
            // The mapped narrowing of softmax's and cross_entropy's last
            // passes; a scale of 1e-30 turns most values into subnormals,
            // 3 many into infinities.
            for map in [(1.0 / 3.0, 0.0), (3.0, 0.0), (1e-30, 0.0), (0.7, 1e-3), (1.0, -2.5)] {
                dispatch(
                    #[inline(always)]
                    || T::from_acc_slice_affine(src, map, &mut out),
                );
                expect(&out, src, map, &is_nan, &bits);
            }
        }
    }

    /// Asserts `out[i] == from_acc(src[i] * scale - shift)`, bit for bit.
    fn expect<T: Element<Acc = f32> + PartialEq>(
        out: &[T],
        src: &[f32],
        (scale, shift): (f32, f32),
        is_nan: impl Fn(T) -> bool,
        bits: impl Fn(T) -> u16,
    ) {
        for (o, s) in out.iter().zip(src) {
            let want = T::from_acc(*s * scale - shift);
            assert!(
                same(*o, want, &is_nan),
                "{} of {s:e} ({:#x}) x {scale:e} - {shift:e}: {:#x}, want {:#x}",
                T::NAME,
                s.to_bits(),
                bits(*o),
                bits(want)
            );
        }
    }

    #[test]
    fn bf16_blocks_match_the_scalar_rounding() {
        check::<bf16>(|v| v.is_nan(), |v| v.to_bits());
    }

    #[test]
    fn f16_blocks_match_the_scalar_rounding() {
        check::<f16>(|v| v.is_nan(), |v| v.to_bits());
    }

    /// The AVX2 f16 path itself (the sweep above runs the best path only),
    /// plain and mapped, from offsets that leave a part group.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_f16_matches_the_scalar_rounding() {
        if crate::wide::x86::V8::try_new().is_none() {
            println!("skipped: this CPU lacks AVX2, FMA or F16C, or KEEL_CPU_CAPABILITY is below avx2");
            return;
        }
        let src = samples();
        for off in 0..3 {
            let src = &src[off..];
            let mut out = vec![f16::ZERO; src.len()];
            for map in [(1.0, 0.0), (1e-30, 0.0), (0.7, 1e-3)] {
                // SAFETY: V8 was found: AVX2, FMA and F16C.
                unsafe {
                    if map == (1.0, 0.0) {
                        super::avx2::f16_slice::<false>(src, map, &mut out, f16::from_acc)
                    } else {
                        super::avx2::f16_slice::<true>(src, map, &mut out, |v| f16::from_acc(v * map.0 - map.1))
                    }
                };
                expect(&out, src, map, |v: f16| v.is_nan(), |v| v.to_bits());
            }
        }
    }

    #[test]
    fn fill_sees_every_index_once() {
        for n in [0, 1, 31, 32, 33, 100, 127, 128, 129, 300] {
            let mut out = vec![bf16::ZERO; n];
            let mut seen = vec![0u32; n];
            dispatch(
                #[inline(always)]
                || {
                    bf16::write_acc(&mut out, |at, b| {
                        for (i, v) in b.iter_mut().enumerate() {
                            seen[at + i] += 1;
                            *v = ((at + i) % 256) as f32; // exact in bf16
                        }
                    })
                },
            );
            assert!(seen.iter().all(|&k| k == 1), "n {n}");
            assert!(out.iter().enumerate().all(|(i, v)| v.to_f32() == (i % 256) as f32), "n {n}");
        }
    }
}
