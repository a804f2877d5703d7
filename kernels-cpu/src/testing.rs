//! Helpers shared by the unit tests (those of the x86 kernels, so far).
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
use half::bf16;

/// bf16 NaN bit patterns: quiet and signalling, with and without payloads,
/// of both signs (`0x7fff`: every payload bit).
pub(crate) const BF16_NANS: [u16; 6] = [0x7fc0, 0xffc0, 0x7f81, 0xff81, 0x7fff, 0xffbf];

/// Whether `a` and `b` have the same bits, or are both NaN (of any sign and
/// payload: kernels need not pass on the same operand's payload as their
/// reference, since LLVM orders an operation's operands its own way).
pub(crate) fn same_or_nan(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The bits of `v`, every NaN as `u16::MAX`: bf16 rows compared with a NaN
/// counting as any NaN.
pub(crate) fn bf16_bits_any_nan(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|v| if v.is_nan() { u16::MAX } else { v.to_bits() }).collect()
}
