//! f16 and bf16 rows of rotary in explicit SIMD, both layouts: NeoX
//! ([`row_halves`], 16 pairs at a time with AVX-512, f16 also as two halves
//! of 8 with AVX2 and F16C) and GPT-J ([`row_pairs`]): f16 widened by
//! `vcvtph2ps`, rotated in f32, rounded by `vcvtps2ph`; bf16 below.
//!
//! On an AVX2 CPU without this path the generic loop's software f16
//! conversions took 48.7 ms for the 4x1024x32x128 NeoX benchmark, against
//! 2.6 ms for bf16 (criterion); with it, 2.6 ms. GPT-J f16 took 7.6 ms
//! before its AVX2 path.
//!
//! The generic loop converts f16 in software both ways, which held f16
//! rotary to about 33 GiB/s in criterion (4x1024x32x128, NeoX), against
//! 60-90 for bf16 and f32 on the same bytes; this path measured 60-70.
//! The products and the sum are the generic loop's, in the same order (no
//! fused multiply-add), and `vcvtps2ph` rounds to nearest even like
//! [`Element::from_acc`]: the results are bit-identical.
//!
//! bf16 takes the same path on CPUs with AVX512-BF16, rounded by
//! `vcvtneps2bf16`, except where a result is an f32 subnormal (which that
//! instruction flushes to zero): such a group of 16 pairs is redone by the
//! generic loop. An earlier session measured it no faster than LLVM's
//! vectorised software rounding with two threads, where the benchmark is
//! bound by memory; on one thread the software rounding is the bound (15
//! GiB/s), and on the Xeon (Emerald Rapids) criterion NeoX 4x1024x32x128
//! went 4.44 -> 3.69 ms on one thread and 2.34-2.36 -> 1.98-2.03 ms on two.
//! Writing the f32 values to a scratch block and narrowing it with
//! [`crate::narrow`] was 2-4x slower: the block was written with 256-bit
//! stores and read back with 512-bit loads, which cannot take their data
//! from the store buffer.
//!
//! [`row_halves`] takes a whole row, with its cos and sin already widened to
//! f32 (once per position, where each head used to widen them again) and
//! its per-group checks hoisted out; the fallback for refused groups is out
//! of line, so the loop keeps its registers (inlined, its bookkeeping was
//! spilled to the stack and bf16 ran 1.35x slower than before). Criterion
//! NeoX 4x1024x32x128 on two threads: bf16 2.06-2.24 -> 1.53-1.55 ms, f16
//! 2.13-2.21 -> 1.63-1.70 ms; one thread: bf16 3.58-3.74 -> 3.22-3.28 ms.
//! GPT-J bf16, which rounded in software (LLVM's vectorised loop), now
//! rounds 32 values at a time with `vcvtne2ps2bf16`: 2.28-2.47 -> 1.69-1.76
//! ms on two threads, 4.03-4.17 -> 3.07-3.11 ms on one.
use crate::element::{Acc, Element};

/// Pairs per explicit group of [`row_halves`].
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) const N: usize = 16;

/// Whether [`row_halves`] runs explicit code for `T` on this CPU: f16 on a CPU with
/// [`crate::simd::has_v4_bf16`]'s features (AVX-512 among them) or with
/// AVX2 and F16C; bf16 on a CPU with `has_v4_bf16`'s (AVX512-BF16).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(clippy::extra_unused_type_parameters))]
pub(super) fn applies<T: Element>() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::wide::is;
        (is::<T, half::f16>() && (crate::simd::has_v4_bf16() || crate::wide::x86::V8::try_new().is_some()))
            || (is::<T, half::bf16>() && crate::simd::has_v4_bf16())
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The explicit code a row of `T` takes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Path {
    /// AVX512-BF16 ([`crate::simd::has_v4_bf16`]'s features).
    Bf16,
    /// f16 with AVX-512 (the same features).
    F16,
    /// f16 with AVX2 and F16C.
    F16Avx2,
}

/// Which explicit code runs for `T` on this CPU (`None`: none, see
/// [`applies`]); with `AVX2`, f16 takes the AVX2 code wherever the CPU has
/// it, also on AVX-512 CPUs (for the tests, which would never run it there).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn path<T: Element, const AVX2: bool>() -> Option<Path> {
    use crate::wide::is;
    if !applies::<T>() {
        return None;
    }
    // `applies`: bf16 with `has_v4_bf16`'s features; f16 with those or
    // else AVX2 and F16C (`V8`).
    if is::<T, half::bf16>() {
        Some(Path::Bf16)
    } else if !AVX2 && crate::simd::has_v4_bf16() {
        Some(Path::F16)
    } else {
        crate::wide::x86::V8::try_new().map(|_| Path::F16Avx2)
    }
}

/// Rotates one row of the NeoX layout: pairs `(x[i], x[i + h])` for
/// `i < h = c.len()`, `y1 = a c - b s` and `y2 = b c + a s`, with `c` and
/// `s` the row's cos and sin (times the sign of the angle) already in f32
/// (`Widened` in the parent makes them once per position, not once per
/// head). Whole groups of [`N`] pairs run in explicit SIMD where [`applies`]
/// holds, the rest (a bf16 group with an f32 subnormal result too) in
/// scalar code with the same operations: the same bits either way, those
/// of the generic loop, for `T` whose `Acc` is f32 (f32, bf16, f16).
///
/// # Panics
/// If `T::Acc` is not f32, `s` is not as long as `c`, or `x` or `y` is not
/// `2 c.len()` long.
#[inline(always)]
pub(super) fn row_halves<T: Element>(x: &[T], y: &mut [T], c: &[f32], s: &[f32]) {
    row_halves_at::<T, false>(x, y, c, s);
}

/// [`row_halves`], with `AVX2` as in [`path`].
#[inline(always)]
fn row_halves_at<T: Element, const AVX2: bool>(x: &[T], y: &mut [T], c: &[f32], s: &[f32]) {
    assert!(crate::wide::is::<T::Acc, f32>(), "rotary row_halves: {} does not accumulate in f32", T::NAME);
    let h = c.len();
    assert!(s.len() == h && x.len() == 2 * h && y.len() == 2 * h, "rotary row_halves: lengths differ");
    // Only the x86 code below moves it.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if let Some(path) = path::<T, AVX2>() {
        let (px, py, pc, ps) = (x.as_ptr().cast::<u16>(), y.as_mut_ptr().cast::<u16>(), c.as_ptr(), s.as_ptr());
        while i + N <= h {
            // SAFETY: `path` checked T (2 bytes, bits as u16) and the CPU's
            // features for each code; `i + N <= h`, `x` and `y` hold `2 h`
            // values and `c` and `s` `h` (asserted), read and written
            // unaligned.
            let done = unsafe {
                let ins = (px.add(i), px.add(h + i), pc.add(i), ps.add(i));
                let outs = (py.add(i), py.add(h + i));
                match path {
                    Path::Bf16 => x86::halves_bf16(ins, outs),
                    Path::F16 => {
                        x86::halves_f16(ins, outs);
                        true
                    }
                    Path::F16Avx2 => {
                        x86::halves_f16_avx2(ins, outs);
                        true
                    }
                }
            };
            if !done {
                scalar_halves(x, y, c, s, i..i + N);
            }
            i += N;
        }
    }
    if i < h {
        scalar_halves(x, y, c, s, i..h);
    }
}

/// Pairs `range` of [`row_halves`] in scalar code: the generic loop's
/// expression on the widened values (`to_acc` is f32 there, and the round
/// trips through f64 change no value). Out of line, so that the explicit
/// loop keeps its registers: a bf16 group with an f32 subnormal result and a
/// row's last pairs (none for head sizes that are multiples of 32).
#[cold]
#[inline(never)]
fn scalar_halves<T: Element>(x: &[T], y: &mut [T], c: &[f32], s: &[f32], range: std::ops::Range<usize>) {
    let h = c.len();
    let (x1, x2) = x.split_at(h);
    let (y1, y2) = y.split_at_mut(h);
    let f = |v: T| v.to_acc().to_f64() as f32;
    for i in range {
        let (a, b, c, s) = (f(x1[i]), f(x2[i]), c[i], s[i]);
        y1[i] = T::from_acc(T::Acc::from_f64(f64::from(a * c - b * s)));
        y2[i] = T::from_acc(T::Acc::from_f64(f64::from(b * c + a * s)));
    }
}

/// Rotates one row of the GPT-J layout: pairs `(x[2i], x[2i + 1])`, with
/// `cd` and `sd` the row's cos and sin (times the sign of the angle) in f32
/// laid out per value: `cd = [c0, c0, c1, c1, ..]`, `sd = [-s0, s0, -s1,
/// s1, ..]` (`Widened` in the parent makes them). Each value is then `x cd +
/// swap(x) sd`, `swap` exchanging the two values of each pair: `a c + b (-s)`
/// is `a c - b s`, and `b c + a s`, the generic loop's products and sums in
/// its order. Whole groups of 32 values (bf16), 16 (f16 with AVX-512) or 8
/// (f16 with AVX2) run in
/// explicit SIMD where [`applies`] holds, the rest (a bf16 group with an f32
/// subnormal result too) in scalar code: the same bits either way.
///
/// # Panics
/// As [`row_halves`]: `T::Acc` not f32, or `x`, `y`, `cd` and `sd` of
/// different (or odd) lengths.
#[inline(always)]
pub(super) fn row_pairs<T: Element>(x: &[T], y: &mut [T], cd: &[f32], sd: &[f32]) {
    row_pairs_at::<T, false>(x, y, cd, sd);
}

/// [`row_pairs`], with `AVX2` as in [`path`].
#[inline(always)]
fn row_pairs_at<T: Element, const AVX2: bool>(x: &[T], y: &mut [T], cd: &[f32], sd: &[f32]) {
    assert!(crate::wide::is::<T::Acc, f32>(), "rotary row_pairs: {} does not accumulate in f32", T::NAME);
    let n = cd.len();
    assert!(sd.len() == n && x.len() == n && y.len() == n && n.is_multiple_of(2), "rotary row_pairs: lengths differ");
    // Only the x86 code below moves it.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if let Some(path) = path::<T, AVX2>() {
        let (px, py, pc, ps) = (x.as_ptr().cast::<u16>(), y.as_mut_ptr().cast::<u16>(), cd.as_ptr(), sd.as_ptr());
        // Values per group: bf16 rounds two vectors at once.
        let step = match path {
            Path::Bf16 => 32,
            Path::F16 => 16,
            Path::F16Avx2 => 8,
        };
        while i + step <= n {
            // SAFETY: as in `row_halves_at`; `i + step <= n`, the length of
            // all four slices.
            let done = unsafe {
                let (ins, out) = ((px.add(i), pc.add(i), ps.add(i)), py.add(i));
                match path {
                    Path::Bf16 => x86::pairs_bf16(ins, out),
                    Path::F16 => {
                        x86::pairs_f16(ins, out);
                        true
                    }
                    Path::F16Avx2 => {
                        x86::pairs_f16_avx2(ins, out);
                        true
                    }
                }
            };
            if !done {
                scalar_pairs(x, y, cd, sd, i / 2..(i + step) / 2);
            }
            i += step;
        }
    }
    if i < n {
        scalar_pairs(x, y, cd, sd, i / 2..n / 2);
    }
}

/// Pairs `range` of [`row_pairs`] in scalar code, as [`scalar_halves`].
#[cold]
#[inline(never)]
fn scalar_pairs<T: Element>(x: &[T], y: &mut [T], cd: &[f32], sd: &[f32], range: std::ops::Range<usize>) {
    let f = |v: T| v.to_acc().to_f64() as f32;
    for j in range {
        let (a, b, c, s) = (f(x[2 * j]), f(x[2 * j + 1]), cd[2 * j], sd[2 * j + 1]);
        y[2 * j] = T::from_acc(T::Acc::from_f64(f64::from(a * c - b * s)));
        y[2 * j + 1] = T::from_acc(T::Acc::from_f64(f64::from(b * c + a * s)));
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Pointers to 16 values each: `x1`, `x2` (`u16`), `cos`, `sin` (f32).
    type Ins = (*const u16, *const u16, *const f32, *const f32);

    /// `(a c - b s, b c + a s)`: the generic loop's operations in its order.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn rotate(a: __m512, b: __m512, c: __m512, s: __m512) -> (__m512, __m512) {
        (
            _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)),
            _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)),
        )
    }

    /// One group of [`super::row_halves`] for f16.
    ///
    /// # Safety
    /// The CPU has AVX512F; each pointer reaches 16 values.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn halves_f16((x1, x2, c, s): Ins, (y1, y2): (*mut u16, *mut u16)) {
        const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        // SAFETY: (caller) 16 values behind each pointer.
        let widen = |p: *const u16| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) };
        // SAFETY: as above.
        let (c, s) = unsafe { (_mm512_loadu_ps(c), _mm512_loadu_ps(s)) };
        let (lo, hi) = rotate(widen(x1), widen(x2), c, s);
        // SAFETY: as above, 32 bytes stored behind each output pointer.
        unsafe {
            _mm256_storeu_si256(y1.cast(), _mm512_cvtps_ph::<RNE>(lo));
            _mm256_storeu_si256(y2.cast(), _mm512_cvtps_ph::<RNE>(hi));
        }
    }

    /// [`halves_f16`] for bf16: widened by a shift, rounded by
    /// `vcvtneps2bf16`, which rounds to nearest even like
    /// [`crate::Element::from_acc`] but flushes f32 subnormals to zero; where
    /// a result is one, nothing is written and it returns false.
    ///
    /// # Safety
    /// The CPU has [`crate::simd::has_v4_bf16`]'s features; each pointer
    /// reaches 16 values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    #[inline]
    pub(super) unsafe fn halves_bf16((x1, x2, c, s): Ins, (y1, y2): (*mut u16, *mut u16)) -> bool {
        // SAFETY: (caller) 16 values behind each pointer.
        let widen = |p: *const u16| unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
        };
        // SAFETY: as above.
        let (c, s) = unsafe { (_mm512_loadu_ps(c), _mm512_loadu_ps(s)) };
        let (lo, hi) = rotate(widen(x1), widen(x2), c, s);
        if crate::narrow::x86::has_subnormal(lo, hi) {
            return false;
        }
        // SAFETY: as above, 32 bytes stored behind each output pointer;
        // `__m256bh` and `__m256i` are both 256 bits.
        unsafe {
            _mm256_storeu_si256(y1.cast(), std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(lo)));
            _mm256_storeu_si256(y2.cast(), std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(hi)));
        }
        true
    }

    /// [`halves_f16`] as two 8-lane halves, with AVX2's F16C conversions:
    /// the same operations in the same order, so the same bits.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; each pointer reaches 16 values.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn halves_f16_avx2((x1, x2, c, s): Ins, (y1, y2): (*mut u16, *mut u16)) {
        // F16C's immediate has no exception bit: round to nearest even.
        const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;
        for k in [0, 8] {
            // SAFETY: (caller) 16 values behind each pointer: 8 read and 8
            // written at `k` and `k + 8`.
            unsafe {
                let (a, b) = (
                    _mm256_cvtph_ps(_mm_loadu_si128(x1.add(k).cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(x2.add(k).cast())),
                );
                let (cv, sv) = (_mm256_loadu_ps(c.add(k)), _mm256_loadu_ps(s.add(k)));
                let lo = _mm256_sub_ps(_mm256_mul_ps(a, cv), _mm256_mul_ps(b, sv));
                let hi = _mm256_add_ps(_mm256_mul_ps(b, cv), _mm256_mul_ps(a, sv));
                _mm_storeu_si128(y1.add(k).cast(), _mm256_cvtps_ph::<RNE>(lo));
                _mm_storeu_si128(y2.add(k).cast(), _mm256_cvtps_ph::<RNE>(hi));
            }
        }
    }

    /// `x`, `cd`, `sd` of [`super::row_pairs`]: 16 values each (8 with AVX2).
    type PairIns = (*const u16, *const f32, *const f32);

    /// `x cd + swap(x) sd` (see [`super::row_pairs`]).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn pair_rotate(x: __m512, cd: __m512, sd: __m512) -> __m512 {
        _mm512_add_ps(_mm512_mul_ps(x, cd), _mm512_mul_ps(_mm512_permute_ps::<0b10_11_00_01>(x), sd))
    }

    /// One group (8 pairs) of [`super::row_pairs`] for f16.
    ///
    /// # Safety
    /// The CPU has AVX512F; each pointer reaches 16 values.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn pairs_f16((x, cd, sd): PairIns, y: *mut u16) {
        const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        // SAFETY: (caller) 16 values behind each pointer.
        unsafe {
            let v =
                pair_rotate(_mm512_cvtph_ps(_mm256_loadu_si256(x.cast())), _mm512_loadu_ps(cd), _mm512_loadu_ps(sd));
            _mm256_storeu_si256(y.cast(), _mm512_cvtps_ph::<RNE>(v));
        }
    }

    /// Two groups (32 values, 16 pairs) of [`super::row_pairs`] for bf16,
    /// rounded together by [`crate::narrow::x86::bf16_pair`] (one
    /// `vcvtne2ps2bf16` and one store): false, writing nothing, where a
    /// result is an f32 subnormal, which that instruction would flush.
    ///
    /// # Safety
    /// The CPU has [`crate::simd::has_v4_bf16`]'s features; each pointer
    /// reaches 32 values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    #[inline]
    pub(super) unsafe fn pairs_bf16((x, cd, sd): PairIns, y: *mut u16) -> bool {
        // SAFETY: (caller) 32 values behind each pointer.
        unsafe {
            let widen = |p: *const u16| {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
            };
            let lo = pair_rotate(widen(x), _mm512_loadu_ps(cd), _mm512_loadu_ps(sd));
            let hi = pair_rotate(widen(x.add(16)), _mm512_loadu_ps(cd.add(16)), _mm512_loadu_ps(sd.add(16)));
            crate::narrow::x86::bf16_pair(y.cast(), lo, hi)
        }
    }

    /// [`pairs_f16`] on 8 values (4 pairs) with AVX2's F16C conversions.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; each pointer reaches 8 values.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn pairs_f16_avx2((x, cd, sd): PairIns, y: *mut u16) {
        // F16C's immediate has no exception bit: round to nearest even.
        const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;
        // SAFETY: (caller) 8 values behind each pointer.
        unsafe {
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.cast()));
            let swap = _mm256_permute_ps::<0b10_11_00_01>(xv);
            let v = _mm256_add_ps(_mm256_mul_ps(xv, _mm256_loadu_ps(cd)), _mm256_mul_ps(swap, _mm256_loadu_ps(sd)));
            _mm_storeu_si128(y.cast(), _mm256_cvtps_ph::<RNE>(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{applies, row_halves_at, row_pairs_at, N};
    use crate::element::Element;
    use crate::simd::dispatch;
    use half::{bf16, f16};

    /// `got` is `want`, sign of zero included, or both are NaN (f16 or bf16).
    macro_rules! assert_same {
        ($got:expr, $want:expr, $i:expr, $sign:expr) => {{
            // Through f64, which holds every f16 and bf16 exactly.
            let (got, want) = ($got.to_f64(), $want.to_f64());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "pair {}, sign {}: {got:e}, want {want:e}",
                $i,
                $sign,
            );
        }};
    }

    /// [`row_halves`] (NeoX) or [`row_pairs`] (GPT-J, `interleaved`) over
    /// rows of every 7th bit pattern of `T` (results that are subnormal,
    /// overflow, infinite or NaN), for both signs of the angle, with whole
    /// groups and a tail: the generic loop's expression bit for bit, on cos
    /// and sin widened as the parent's `Widened` does. Returns how many pairs
    /// had an f32 subnormal result (bf16 redoes their groups in scalar code).
    fn row_matches<T: Element<Acc = f32>>(bits: fn(u16) -> T, interleaved: bool) -> usize {
        row_matches_at::<T, false>(bits, interleaved)
    }

    /// [`row_matches`], with `AVX2` as in `path`.
    fn row_matches_at<T: Element<Acc = f32>, const AVX2: bool>(bits: fn(u16) -> T, interleaved: bool) -> usize {
        if !applies::<T>() {
            eprintln!("note: no explicit rotary path for {} on this CPU: the scalar one is tested", T::NAME);
        }
        let all: Vec<T> = (0..=u16::MAX).step_by(7).map(bits).collect();
        let h = (all.len() - 29) / N * N - 3;
        // The pairs' two values are the same patterns shifted, and cos and
        // sin too, so that each pair meets other values.
        let (a, b) = (&all[..h], &all[7..][..h]);
        let x: Vec<T> = if interleaved {
            a.iter().zip(b).flat_map(|(&a, &b)| [a, b]).collect()
        } else {
            a.iter().chain(b).copied().collect()
        };
        // Where pair `i` lies in the row.
        let at = |i: usize| if interleaved { (2 * i, 2 * i + 1) } else { (i, h + i) };
        let (c, s) = (&all[13..][..h], &all[29..][..h]);
        let mut subnormal = 0;
        for sign in [1.0f32, -1.0] {
            let cw: Vec<f32> = c.iter().map(|v| v.to_acc()).collect();
            let sw: Vec<f32> = s.iter().map(|v| v.to_acc() * sign).collect();
            let mut y = vec![bits(0x7777); 2 * h];
            if interleaved {
                let cd: Vec<f32> = cw.iter().flat_map(|&c| [c, c]).collect();
                let sd: Vec<f32> = sw.iter().flat_map(|&s| [-s, s]).collect();
                dispatch(
                    #[inline(always)]
                    || row_pairs_at::<T, AVX2>(&x, &mut y, &cd, &sd),
                );
            } else {
                dispatch(
                    #[inline(always)]
                    || row_halves_at::<T, AVX2>(&x, &mut y, &cw, &sw),
                );
            }
            for i in 0..h {
                let (ia, ib) = at(i);
                let (a, b, c, s) = (x[ia].to_acc(), x[ib].to_acc(), c[i].to_acc(), s[i].to_acc() * sign);
                let (p, q) = (a * c - b * s, b * c + a * s);
                subnormal += usize::from(p.is_subnormal() || q.is_subnormal());
                for (got, want) in [(y[ia], T::from_acc(p)), (y[ib], T::from_acc(q))] {
                    assert_same!(got, want, i, sign);
                }
            }
        }
        subnormal
    }

    #[test]
    fn f16_rows_match_the_scalar_rotation_in_both_layouts() {
        row_matches(f16::from_bits, false);
        row_matches(f16::from_bits, true);
    }

    /// The AVX2 and F16C code for f16, which AVX-512 CPUs take the other
    /// code instead of.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_rows_on_avx2_match_the_scalar_rotation_in_both_layouts() {
        if crate::wide::x86::V8::try_new().is_none() {
            eprintln!("skipped: this CPU lacks AVX2 with F16C, or KEEL_CPU_CAPABILITY is below avx2");
            return;
        }
        row_matches_at::<f16, true>(f16::from_bits, false);
        row_matches_at::<f16, true>(f16::from_bits, true);
    }

    #[test]
    fn bf16_rows_match_the_scalar_rotation_in_both_layouts_subnormal_groups_included() {
        for interleaved in [false, true] {
            let subnormal = row_matches(bf16::from_bits, interleaved);
            assert!(subnormal > 0, "interleaved={interleaved}: no f32 subnormal result, so the fallback went untested");
        }
    }
}
