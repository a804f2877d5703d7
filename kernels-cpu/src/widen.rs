//! f16 rows widened to f32 with the CPU's conversion instruction, for lane
//! loops that read their inputs more than once or from several slices.
//!
//! A lane loop over f16 converts each value in software (about seven vector
//! instructions per eight values, where F16C's `vcvtph2ps` is one): the
//! norm backwards read three or four f16 slices per element and took 2.3-2.5
//! times bf16's time on an AVX2 CPU. Widening each row into an f32 scratch
//! first (L1/L2-resident) and running the f32-input loop on it gives the
//! same values bit for bit, since widening f16 to f32 is exact and f32's
//! `to_acc` is the identity; the outputs are still written as f16 (the
//! layer_norm tests compare both paths bit for bit).
//!
//! Measured, criterion 4096x4096 on an AVX2 CPU, alternated with the plain
//! loop (bf16 in brackets): backward rms_norm f16 12.5 -> 5.6 ms (5.2),
//! fused_add_rms_norm 17.2 -> 7.4 (6.3), layer_norm 14.0 -> 8.8 (6.7);
//! forward rms_norm 4.6 -> 2.9-3.1 (2.6-2.8), fused_add_rms_norm 9.0-9.4 ->
//! 7.8-8.9 (5.7-6.7). The layer_norm forward has its own explicit kernel.
//!
//! Where it is used now: layer_norm's f16 backward without a weight or its
//! gradients. rms_norm's forward, fused_add_rms_norm's forwards and the
//! layer_norm training backward run f16 rows in explicit kernels
//! (`rms_norm/x86.rs`, `fused_add_rms_norm/x86.rs`,
//! `layer_norm/x86_backward.rs`) wherever this would apply.
#[cfg(target_arch = "x86_64")]
use half::f16;

/// Whether [`to_f32`] widens `T` on this CPU: `T` is f16 and the CPU has
/// AVX2, FMA and F16C (or AVX-512). Elsewhere callers keep the plain loop.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(clippy::extra_unused_type_parameters))]
pub(crate) fn applies<T: 'static>() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::wide::is::<T, f16>() && crate::wide::x86::V8::try_new().is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `src` widened into `buf` (resized to fit), returned as a slice; `None`,
/// leaving `buf` alone, where [`applies`] does not hold for `T`.
#[inline(always)]
pub(crate) fn to_f32<'a, T: 'static>(src: &[T], buf: &'a mut Vec<f32>) -> Option<&'a [f32]> {
    #[cfg(target_arch = "x86_64")]
    if applies::<T>() {
        return widen_into(src, buf);
    }
    let _ = (src, buf);
    None
}

/// `src` widened into `buf` (resized to fit) by the x86 kernel, for `T` in
/// f16 and bf16 where the CPU has the lanes (`None` where it has not).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn widen_into<'a, T: 'static>(src: &[T], buf: &'a mut Vec<f32>) -> Option<&'a [f32]> {
    buf.resize(src.len(), 0.0);
    crate::wide::x86::run(x86::Widen { src, dst: &mut buf[..] })?;
    Some(&buf[..src.len()])
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::wide::x86::{Kernel, Lanes};

    /// `dst[i] = src[i]` as f32, for `T` in f32, bf16, f16 (callers pass
    /// f16 and bf16); `dst` at least as long as `src`.
    pub(super) struct Widen<'a, T> {
        pub(super) src: &'a [T],
        pub(super) dst: &'a mut [f32],
    }

    impl<T: 'static> Kernel for Widen<'_, T> {
        type Output = ();
        #[inline(always)]
        fn run<L: Lanes>(self, l: L) {
            let (len, p) = (self.src.len(), self.src.as_ptr());
            assert!(self.dst.len() >= len, "widen: dst shorter than src");
            let q = self.dst.as_mut_ptr();
            let mut i = 0;
            // SAFETY: whole vectors while they fit, then the `len - i < N`
            // left, of `src` and of `dst` (at least as long); `T` is one of
            // the three (the callers').
            unsafe {
                while i + L::N <= len {
                    l.store(q.add(i), l.load(p.add(i)));
                    i += L::N;
                }
                if i < len {
                    l.store_part(q.add(i), l.load_part(p.add(i), len - i), len - i);
                }
            }
        }
    }
}

/// As [`to_f32`], and a bf16 row widened too where f16 is widened on this
/// CPU: for a loop that reads it beside an f16 row widened so (whose software
/// widening is what costs; bf16's is a shift, but the loop's types must
/// match).
#[inline(always)]
pub(crate) fn to_f32_beside_f16<'a, T: 'static>(src: &[T], buf: &'a mut Vec<f32>) -> Option<&'a [f32]> {
    #[cfg(target_arch = "x86_64")]
    if crate::wide::is::<T, half::bf16>() && applies::<f16>() {
        return widen_into(src, buf);
    }
    to_f32(src, buf)
}

/// What the tests that compare a widened f16 path with the plain one share.
#[cfg(test)]
pub(crate) mod testing {
    use half::f16;

    /// Whether f16 is widened on this CPU, so a comparison means
    /// something; prints why the test is skipped where not.
    pub(crate) fn runs() -> bool {
        let runs = super::applies::<f16>();
        if !runs {
            eprintln!("skipped: this CPU lacks AVX2 with F16C (or KEEL_CPU_CAPABILITY is below avx2), so f16 is never widened");
        }
        runs
    }

    /// `n` irregular f16 values, `3 sin(k i)`.
    pub(crate) fn wave(n: usize, k: f64) -> Vec<f16> {
        (0..n).map(|i| f16::from_f64((i as f64 * k).sin() * 3.0)).collect()
    }

    /// The bits of each value.
    pub(crate) fn bits(v: &[f16]) -> Vec<u16> {
        v.iter().map(|v| v.to_bits()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{applies, to_f32};
    use half::{bf16, f16};

    /// Every f16 bit pattern, at lengths with and without a part vector,
    /// widens to `f16::to_f32` exactly (NaN payloads included); other types
    /// are refused.
    #[test]
    fn every_f16_widens_exactly() {
        if !applies::<f16>() {
            eprintln!("skipped: this CPU lacks AVX2 with F16C, or KEEL_CPU_CAPABILITY is below avx2");
            return;
        }
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut buf = vec![7.0; 3];
        for len in [0, 1, 7, 8, 9, 17, all.len()] {
            let got = to_f32(&all[..len], &mut buf).expect("applies");
            assert_eq!(got.len(), len);
            for (g, h) in got.iter().zip(&all) {
                assert_eq!(g.to_bits(), h.to_f32().to_bits(), "{:#06x}", h.to_bits());
                // The lane loops' own widening: the same value, NaN as NaN.
                let own = crate::element::Element::to_acc(*h);
                assert!(g.to_bits() == own.to_bits() || (g.is_nan() && own.is_nan()), "{:#06x}", h.to_bits());
            }
        }
        assert!(to_f32(&[bf16::ONE], &mut buf).is_none() && to_f32(&[1.0f32], &mut buf).is_none());
    }
}
