//! bf16 rows of rotary on AVX2, which has no bf16 conversion (CPUs with
//! AVX512-BF16 take [`super::wide`]), in the even/odd order of
//! [`Lanes::load_pair_unordered`]: 16 bf16 values load as the 8 even ones
//! and the 8 odd ones with one load, a shift and a mask, and their results
//! go back in place with the integer rounding and one blend
//! ([`Lanes::store_bf16_pair_normal_even_odd`]). Both layouts fit that
//! order: NeoX rotates `x1[i]` with `x2[i]`, lane by lane, whatever the
//! order, with cos and sin (bf16, `[seq, half]`) loaded the same way; GPT-J's
//! pairs `(x[2k], x[2k + 1])` are the even and odd lanes themselves, and
//! take cos and sin in order (one per pair).
//!
//! The values are the generic loop's, bit for bit (its products and sums in
//! its order, no fused multiply-add): each is float arithmetic on values
//! widened from bf16 (`s * sign` exact), so any NaN among them is quiet with
//! its low 16 bits zero, which the integer rounding keeps as `from_acc`
//! does, and it rounds f32 subnormals as `from_acc` does (the argument of
//! `RowValues::ARITHMETIC` in `wide/x86/write_row.rs`). So every group is
//! written here, and a row's last pairs (fewer than a group) are left to
//! the generic loop.
//!
//! Against the generic loop (LLVM's vectorised software rounding with its
//! NaN fix-up), `[4, 1024, 32, 128]` bf16 on a 2-core Zen 3, alternated in
//! one process, medians of 20-40 per-round new/old ratios (session 57): in
//! place, NeoX 0.71 and GPT-J 0.84 on two threads, 0.69 and 0.83 on one;
//! out of place into fresh huge pages, NeoX 0.80 and GPT-J 0.90 (into
//! memory faulted in before, 0.81 and 0.83); `x.T` NeoX 0.80. Session 56
//! tried the values in order (cos and sin widened to f32 once per position,
//! a pack and a permute per 16 results) and kept nothing: only in-place
//! NeoX gained, by 10% on one thread.
use crate::element::{Acc, Element};
use crate::wide::is;
use crate::wide::x86::{Lanes, V8};
use half::bf16;

/// Pairs of a NeoX group: 16, two vectors of each half.
const HALVES: usize = 16;
/// Pairs of a GPT-J group: 8 (16 values, two vectors).
const PAIRS: usize = 8;

/// The AVX2 token where this code runs for `T`: bf16, on a CPU with AVX2,
/// FMA and F16C ([`V8`]) and without AVX512-BF16.
#[inline(always)]
fn token<T: 'static>() -> Option<V8> {
    if is::<T, bf16>() && !crate::simd::has_v4_bf16() {
        V8::try_new()
    } else {
        None
    }
}

/// NeoX: rotates pairs `(x[i], x[h + i])` of a row of `2 h` by `c[i]`,
/// `s[i] * sign` (`h = c.len()`) into `y`, as the generic loop does, for
/// every whole group of 16 pairs; returns how many pairs it did (0 where
/// this code does not run for `T`).
///
/// # Panics
/// Where `s` is not as long as `c`, or `x` or `y` holds fewer than `2 h`.
#[inline(always)]
pub(super) fn halves<T: Element>(x: &[T], y: &mut [T], c: &[T], s: &[T], sign: T::Acc) -> usize {
    let Some(l) = token::<T>() else { return 0 };
    let h = c.len();
    let (x1, x2) = (&x[..h], &x[h..2 * h]);
    let (y1, y2) = y[..2 * h].split_at_mut(h);
    let s = &s[..h];
    let sign = l.splat(sign.to_f64() as f32);
    let whole = h / HALVES * HALVES;
    let mut i = 0;
    // SAFETY: `i + 16 <= whole <= h`, the length of `x1`, `x2`, `c`, `s`,
    // `y1` and `y2` (the slices above); `T` is bf16 (`token`).
    unsafe {
        while i < whole {
            let (a, b) = (l.load_pair_unordered(x1.as_ptr().add(i)), l.load_pair_unordered(x2.as_ptr().add(i)));
            let (c, s) = (l.load_pair_unordered(c.as_ptr().add(i)), l.load_pair_unordered(s.as_ptr().add(i)));
            let s = (l.mul(s.0, sign), l.mul(s.1, sign));
            let (p0, q0) = rotate(l, a.0, b.0, c.0, s.0);
            let (p1, q1) = rotate(l, a.1, b.1, c.1, s.1);
            l.store_bf16_pair_normal_even_odd(y1.as_mut_ptr().add(i).cast(), p0, p1);
            l.store_bf16_pair_normal_even_odd(y2.as_mut_ptr().add(i).cast(), q0, q1);
            i += HALVES;
        }
    }
    whole
}

/// GPT-J: rotates pairs `(x[2k], x[2k + 1])` of a row of `2 h` by `c[k]`,
/// `s[k] * sign` (`h = c.len()`) into `y`, as the generic loop does, for
/// every whole group of 8 pairs; returns how many pairs it did (0 where
/// this code does not run for `T`).
///
/// # Panics
/// As [`halves`].
#[inline(always)]
pub(super) fn pairs<T: Element>(x: &[T], y: &mut [T], c: &[T], s: &[T], sign: T::Acc) -> usize {
    let Some(l) = token::<T>() else { return 0 };
    let h = c.len();
    let (x, y, s) = (&x[..2 * h], &mut y[..2 * h], &s[..h]);
    let sign = l.splat(sign.to_f64() as f32);
    let whole = h / PAIRS * PAIRS;
    let mut k = 0;
    // SAFETY: `k + 8 <= whole <= h`: 8 values of `c` and `s` (`h` long)
    // and 16 of `x` and `y` (`2 h`) from `k` and `2 k`; `T` is bf16
    // (`token`).
    unsafe {
        while k < whole {
            let (a, b) = l.load_pair_unordered(x.as_ptr().add(2 * k));
            let (c, s) = (l.load(c.as_ptr().add(k)), l.mul(l.load(s.as_ptr().add(k)), sign));
            let (p, q) = rotate(l, a, b, c, s);
            l.store_bf16_pair_normal_even_odd(y.as_mut_ptr().add(2 * k).cast(), p, q);
            k += PAIRS;
        }
    }
    whole
}

/// `(a c - b s, b c + a s)`: the generic loop's operations in its order.
#[inline(always)]
fn rotate<L: Lanes>(l: L, a: L::V, b: L::V, c: L::V, s: L::V) -> (L::V, L::V) {
    (l.sub(l.mul(a, c), l.mul(b, s)), l.add(l.mul(b, c), l.mul(a, s)))
}

#[cfg(test)]
mod tests {
    use super::{halves, pairs, token, HALVES, PAIRS};
    use crate::element::Element;
    use crate::simd::dispatch;
    use half::bf16;

    /// Both layouts over rows of every 7th bf16 bit pattern (NaN of both
    /// signs with many payloads, infinities, subnormals, results that are
    /// f32 subnormals or overflow), both signs of the angle, rows with and
    /// without a tail: every whole group is done, each value the generic
    /// loop's expression rounded by `from_acc`, bit for bit (any NaN for a
    /// NaN: the payload x86 passes on is that of an operand LLVM may order
    /// its own way), and the tail is left untouched.
    #[test]
    fn bf16_groups_are_the_scalar_rotation_in_both_layouts() {
        if dispatch(
            #[inline(always)]
            || token::<bf16>().is_none(),
        ) {
            eprintln!("skipped: this CPU lacks AVX2 with FMA and F16C, or has AVX512-BF16 (the other path)");
            return;
        }
        let all: Vec<bf16> = (0..=u16::MAX).step_by(7).map(bf16::from_bits).collect();
        for h in [all.len() / 2 - 40, 64, 16, 8, 5] {
            let (a, b) = (&all[..h], &all[7..][..h]);
            let (c, s) = (&all[13..][..h], &all[29..][..h]);
            for interleaved in [false, true] {
                let group = if interleaved { PAIRS } else { HALVES };
                let x: Vec<bf16> = if interleaved {
                    a.iter().zip(b).flat_map(|(&a, &b)| [a, b]).collect()
                } else {
                    a.iter().chain(b).copied().collect()
                };
                let at = |i: usize| if interleaved { (2 * i, 2 * i + 1) } else { (i, h + i) };
                for sign in [1.0f32, -1.0] {
                    let mut y = vec![bf16::from_bits(0x7777); 2 * h];
                    let done = dispatch(
                        #[inline(always)]
                        || {
                            if interleaved {
                                pairs(&x, &mut y, c, s, sign)
                            } else {
                                halves(&x, &mut y, c, s, sign)
                            }
                        },
                    );
                    assert_eq!(done, h / group * group, "h={h} interleaved={interleaved}");
                    for i in 0..h {
                        let (ia, ib) = at(i);
                        let (a, b, c, s) = (x[ia].to_acc(), x[ib].to_acc(), c[i].to_acc(), s[i].to_acc() * sign);
                        let want = [bf16::from_acc(a * c - b * s), bf16::from_acc(b * c + a * s)];
                        for (got, want) in [(y[ia], want[0]), (y[ib], want[1])] {
                            let want = if i < done { want } else { bf16::from_bits(0x7777) };
                            assert!(
                                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                                "h={h} interleaved={interleaved} sign={sign} pair {i}: {got} {:#x}, want {want} {:#x}",
                                got.to_bits(),
                                want.to_bits(),
                            );
                        }
                    }
                }
            }
        }
    }
}
