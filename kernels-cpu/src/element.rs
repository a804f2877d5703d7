//! The element types the kernels accept and their conversions to the
//! accumulation type.
//!
//! The f16/bf16 conversions are written branch-free on bits (rather than
//! calling `half`'s per-value conversions, which test CPU features per call) so
//! that the compiler vectorises them inside the SIMD-dispatched loops. They are
//! bit-exact with `half` (round to nearest even, NaN kept NaN): the tests check
//! every f16 and bf16 value.
use crate::narrow;
use crate::sum_squares;
use half::{bf16, f16};
use std::ops::{Add, Div, Mul, Sub};

/// Accumulation arithmetic: `f32` for the 16/32-bit types, `f64` for `f64`.
pub trait Acc:
    Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// From f64 (rounded).
    fn from_f64(v: f64) -> Self;
    /// To f64 (exact).
    fn to_f64(self) -> f64;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Count as this type.
    fn from_usize(n: usize) -> Self;
    /// `e^x` (vectorisable for f32; see `math`).
    fn exp(self) -> Self;
    /// `e^x` for `x <= 0` or NaN (softmax after the max is subtracted). For
    /// f32 cheaper than [`Acc::exp`], and 0 where the result would be
    /// subnormal; for f64 the same as `exp`.
    fn exp_nonpos(self) -> Self;
    /// `e^x` where the result is rounded to 16 bits: for f32
    /// `math::exp_narrow_f32` (within 3.2e-6, relative; cheaper than
    /// [`Acc::exp`]); for f64 the same as `exp`.
    fn exp_narrow(self) -> Self;
    /// [`Acc::exp_nonpos`] where the result is rounded to 16 bits: for f32
    /// `math::exp_nonpos_narrow_f32`; for f64 the same as `exp`.
    fn exp_nonpos_narrow(self) -> Self;
    /// The error function.
    fn erf(self) -> Self;
    /// The larger of two values, the other one when either is NaN (IEEE
    /// maxNum): one `vmaxps` plus a NaN fix-up, which vectorises where the
    /// `if v > m` form was left scalar.
    fn max(self, other: Self) -> Self;
    /// `self * a + b`, rounded once: one FMA instruction inside the kernels'
    /// SIMD dispatch on CPUs that have FMA (a slow library call on the few
    /// that do not).
    fn mul_add(self, a: Self, b: Self) -> Self;
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn from_usize(n: usize) -> Self {
        n as f32
    }
    #[inline(always)]
    fn exp(self) -> Self {
        crate::math::exp_f32(self)
    }
    #[inline(always)]
    fn exp_nonpos(self) -> Self {
        crate::math::exp_nonpos_f32(self)
    }
    #[inline(always)]
    fn exp_narrow(self) -> Self {
        crate::math::exp_narrow_f32(self)
    }
    #[inline(always)]
    fn exp_nonpos_narrow(self) -> Self {
        crate::math::exp_nonpos_narrow_f32(self)
    }
    #[inline(always)]
    fn erf(self) -> Self {
        crate::math::erf_f32(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f32::mul_add(self, a, b)
    }
}

impl Acc for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn from_usize(n: usize) -> Self {
        n as f64
    }
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn exp_nonpos(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn exp_narrow(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn exp_nonpos_narrow(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erf(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f64::mul_add(self, a, b)
    }
}

/// A tensor element type: `f32`, `f64`, [`struct@f16`] or [`bf16`].
pub trait Element: Copy + Send + Sync + Default + 'static {
    /// The type sums and products are computed in.
    type Acc: Acc;
    /// Short name used in kernel symbols and messages (`"f32"`, `"bf16"`, ...).
    const NAME: &'static str;
    /// Widen to the accumulation type (exact).
    fn to_acc(self) -> Self::Acc;
    /// Round from the accumulation type (to nearest even).
    fn from_acc(v: Self::Acc) -> Self;
    /// Widen to f64 (exact), for references.
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.to_acc().to_f64()
    }
    /// Round from f64, for references and tests.
    fn from_f64(v: f64) -> Self;
    /// Writes `out` from accumulator values: `fill(start, buf)` must set
    /// `buf[i]` to the value of `out[start + i]` for every `i`. f32 and f64
    /// hand `out` itself over as `buf` (one call, `start` 0); bf16 and f16
    /// fill blocks of a scratch buffer and round each block with the CPU's
    /// conversion instruction where it has one (see `narrow.rs`), which is
    /// bit-identical to [`from_acc`](Element::from_acc).
    #[inline(always)]
    fn write_acc(out: &mut [Self], fill: impl FnMut(usize, &mut [Self::Acc])) {
        // Closures marked `inline(always)`, not the functions themselves:
        // passed as function items, the rounding could end up behind a
        // `Fn::call` shim that LLVM chose not to inline, compiled for the
        // baseline CPU (SSE2) instead of the kernel's AVX2 (see `update_acc`).
        narrow::write_blocks(
            out,
            fill,
            #[inline(always)]
            |s, d| Self::from_acc_slice(s, d),
        )
    }
    /// Rewrites `out` in place from accumulator values: `update(start, buf)`
    /// gets `buf[i]` holding `out[start + i]` widened and must leave the new
    /// value there. f32 and f64 hand `out` itself over (one call, `start`
    /// 0); bf16 and f16 work in blocks, rounded as in
    /// [`write_acc`](Element::write_acc).
    #[inline(always)]
    fn update_acc(out: &mut [Self], update: impl FnMut(usize, &mut [Self::Acc])) {
        // Closures marked `inline(always)`: given `Self::from_acc_slice`
        // itself, LLVM left bf16's rounding behind a `Fn::call` shim compiled
        // for SSE2 (perf: 26% of fused_add_rms_norm_ bf16 [32, 4096] in
        // `Fn::call`, on `pshuflw`/`pshufhw` packing), 1.33x the time of the
        // out-of-place forward.
        narrow::update_blocks(
            out,
            update,
            #[inline(always)]
            |v| Self::to_acc(v),
            #[inline(always)]
            |s, d| Self::from_acc_slice(s, d),
        )
    }
    /// `dst[i] = from_acc(src[i])` for slices of one length, with the CPU's
    /// conversion instruction where it has one (as [`write_acc`](Element::write_acc)).
    fn from_acc_slice(src: &[Self::Acc], dst: &mut [Self]);
    /// `dst[i] = from_acc(src[i] * scale - shift)` (multiply, then
    /// subtract: no fused multiply-add), for slices of one length: the map
    /// done in the narrowing pass where the CPU converts (softmax's and
    /// cross_entropy's last passes).
    #[inline(always)]
    fn from_acc_slice_affine(src: &[Self::Acc], (scale, shift): (Self::Acc, Self::Acc), dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_acc(*s * scale - shift);
        }
    }
    /// `sum(x_i^2)` in the accumulation type: rms_norm's reduction, with
    /// explicit AVX-512 code for f32, bf16 and f16 (see `sum_squares.rs`).
    fn sum_squares(x: &[Self]) -> Self::Acc;
}

/// `Element` for a type that is its own accumulator (f32, f64): no rounding,
/// and `write_acc` hands `out` itself to `fill`.
macro_rules! own_acc_element {
    ($t:ty, $name:literal, $sum_squares:path) => {
        impl Element for $t {
            type Acc = $t;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(v: $t) -> Self {
                v
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn write_acc(out: &mut [Self], mut fill: impl FnMut(usize, &mut [Self])) {
                fill(0, out)
            }
            #[inline(always)]
            fn update_acc(out: &mut [Self], mut update: impl FnMut(usize, &mut [Self])) {
                update(0, out)
            }
            #[inline(always)]
            fn from_acc_slice(src: &[Self], dst: &mut [Self]) {
                dst.copy_from_slice(src)
            }
            #[inline(always)]
            fn sum_squares(x: &[Self]) -> Self {
                $sum_squares(x)
            }
        }
    };
}

own_acc_element!(f32, "f32", sum_squares::f32s);
own_acc_element!(f64, "f64", sum_squares::generic);

impl Element for bf16 {
    type Acc = f32;
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_acc(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(v))
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    #[inline(always)]
    fn from_acc_slice(src: &[f32], dst: &mut [Self]) {
        narrow::bf16_slice::<false>(src, (1.0, 0.0), dst, Self::from_acc)
    }
    #[inline(always)]
    fn from_acc_slice_affine(src: &[f32], (scale, shift): (f32, f32), dst: &mut [Self]) {
        narrow::bf16_slice::<true>(src, (scale, shift), dst, |v| Self::from_acc(v * scale - shift))
    }
    #[inline(always)]
    fn sum_squares(x: &[Self]) -> f32 {
        sum_squares::bf16s(x)
    }
}

impl Element for f16 {
    type Acc = f32;
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_acc(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        f16::from_bits(f32_to_f16_bits(v))
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    #[inline(always)]
    fn from_acc_slice(src: &[f32], dst: &mut [Self]) {
        narrow::f16_slice::<false>(src, (1.0, 0.0), dst, Self::from_acc)
    }
    #[inline(always)]
    fn from_acc_slice_affine(src: &[f32], (scale, shift): (f32, f32), dst: &mut [Self]) {
        narrow::f16_slice::<true>(src, (scale, shift), dst, |v| Self::from_acc(v * scale - shift))
    }
    #[inline(always)]
    fn sum_squares(x: &[Self]) -> f32 {
        sum_squares::f16s(x)
    }
}

/// f32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if v.is_nan() { nan } else { rounded }) as u16
}

/// f16 bits -> f32 (exact, subnormals included), after F. Giesen's
/// "half_to_float_fast5": scale by 2^112 to move the exponent, then fix Inf/NaN.
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    const MAGIC: f32 = f32::from_bits((254 - 15) << 23);
    const WAS_INF_NAN: f32 = f32::from_bits((127 + 16) << 23);
    let h = h as u32;
    let o = f32::from_bits((h & 0x7fff) << 13) * MAGIC;
    let bits = o.to_bits() | if o >= WAS_INF_NAN { 255 << 23 } else { 0 };
    f32::from_bits(bits | ((h & 0x8000) << 16))
}

/// f32 -> f16 bits, round to nearest even, after F. Giesen's
/// "float_to_half_fast3_rtne". Overflow gives Inf; NaN gives a quiet NaN.
#[inline(always)]
fn f32_to_f16_bits(v: f32) -> u16 {
    const F32_INF: u32 = 255 << 23;
    const F16_MAX: u32 = (127 + 16) << 23;
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
    let b = v.to_bits();
    let sign = b & 0x8000_0000;
    let a = b ^ sign;
    let inf_nan = if a > F32_INF { 0x7e00 } else { 0x7c00 };
    let denorm = (f32::from_bits(a) + f32::from_bits(DENORM_MAGIC)).to_bits().wrapping_sub(DENORM_MAGIC);
    let mant_odd = (a >> 13) & 1;
    let normal = a.wrapping_add(((15u32.wrapping_sub(127)) << 23).wrapping_add(0xfff)).wrapping_add(mant_odd) >> 13;
    let o = if a >= F16_MAX {
        inf_nan
    } else if a < (113 << 23) {
        denorm
    } else {
        normal
    };
    (o | (sign >> 16)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let ours = h.to_acc();
            let theirs = h.to_f32();
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "bits {bits:#x}");
        }
    }

    #[test]
    fn bf16_widening_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let h = bf16::from_bits(bits);
            let (ours, theirs) = (h.to_acc(), h.to_f32());
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "bits {bits:#x}");
        }
    }

    fn check_narrowing(v: f32) {
        let (a, b) = (f16::from_acc(v), f16::from_f32(v));
        assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "f16 of {v:e} ({:#x})", v.to_bits());
        let (a, b) = (bf16::from_acc(v), bf16::from_f32(v));
        assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "bf16 of {v:e} ({:#x})", v.to_bits());
    }

    #[test]
    fn narrowing_matches_half_on_a_bit_sweep() {
        // Every 4099th f32 bit pattern (odd stride: all exponents, mixed low bits),
        // plus the halfway cases around every f16 value.
        let mut bits: u64 = 0;
        while bits <= u32::MAX as u64 {
            check_narrowing(f32::from_bits(bits as u32));
            bits += 4099;
        }
        for h in 0..=u16::MAX {
            let x = f16::from_bits(h).to_f32();
            if x.is_finite() {
                for d in [-1i32, 0, 1] {
                    check_narrowing(f32::from_bits((x.to_bits() as i64 + d as i64 + (1 << 12)) as u32));
                    check_narrowing(f32::from_bits((x.to_bits() as i64 + d as i64) as u32));
                }
            }
        }
        for v in [0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65504.0, 65520.0, 65519.99, 1e-8, -6e-8] {
            check_narrowing(v);
        }
    }
}
