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
//!
//! In place, a group's values are all loaded before any is stored, so each
//! row is rotated where it lies ([`halves_in_place`], [`pairs_in_place`])
//! instead of being copied to a buffer first: new/old medians of 40
//! alternated rounds on the same machine (session 58), NeoX 0.86 and 0.87,
//! GPT-J 0.89 (2.65-2.75 ms against 3.15-3.16 for NeoX).
use crate::element::{Acc, Element};
use crate::wide::is;
use crate::wide::x86::{Lanes, V8};
use half::bf16;
use std::marker::PhantomData;

/// Pairs of a NeoX group: 16, two vectors of each half.
const HALVES: usize = 16;
/// Pairs of a GPT-J group: 8 (16 values, two vectors).
const PAIRS: usize = 8;

/// The AVX2 token for rows of `T`, which exists only where this code runs
/// for `T`: bf16, on a CPU with AVX2, FMA and F16C ([`V8`]) and without
/// AVX512-BF16. [`super::Rotator`] takes it once per block of rows.
pub(super) struct Token<T>(V8, PhantomData<fn() -> T>);

impl<T> Clone for Token<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Token<T> {}

impl<T: 'static> Token<T> {
    /// The token, where this code runs for `T`.
    #[inline(always)]
    pub(super) fn new() -> Option<Self> {
        if is::<T, bf16>() && !crate::simd::has_v4_bf16() {
            V8::try_new().map(|l| Token(l, PhantomData))
        } else {
            None
        }
    }
}

/// NeoX: rotates pairs `(x[i], x[h + i])` of a row of `2 h` by `c[i]`,
/// `s[i] * sign` (`h = c.len()`) into `y`, as the generic loop does, for
/// every whole group of 16 pairs; returns how many pairs it did.
///
/// # Panics
/// Where `s` is shorter than `c`, or `x` or `y` holds fewer than `2 h`.
#[inline(always)]
pub(super) fn halves<T: Element>(t: Token<T>, x: &[T], y: &mut [T], c: &[T], s: &[T], sign: T::Acc) -> usize {
    let h = c.len();
    let (x, y) = (&x[..2 * h], &mut y[..2 * h]);
    // SAFETY: `x` and `y` hold `2 h` values each and, as a shared and a
    // mutable borrow, do not overlap.
    unsafe { halves_at(t, x.as_ptr(), y.as_mut_ptr(), c, &s[..h], sign) }
}

/// [`halves`] of `row` into itself, every pair (the last ones, fewer than
/// a group, as the generic loop does them): each group's values are all
/// read before any is written.
///
/// # Panics
/// Where `s` is shorter than `c`, or `row` holds fewer than `2 h`.
#[inline(always)]
pub(super) fn halves_in_place<T: Element>(t: Token<T>, row: &mut [T], c: &[T], s: &[T], sign: T::Acc) {
    let h = c.len();
    let (row, s) = (&mut row[..2 * h], &s[..h]);
    let p = row.as_mut_ptr();
    // SAFETY: `row` holds `2 h` values, read and written through one pointer.
    let done = unsafe { halves_at(t, p, p, c, s, sign) };
    for i in done..h {
        (row[i], row[h + i]) = super::turn(row[i], row[h + i], c[i], s[i], sign);
    }
}

/// [`halves`] from `x` into `y`.
///
/// # Safety
/// `x` and `y` point to `2 h` values each (`h = c.len() <= s.len()`), and
/// are either the same or do not overlap.
#[inline(always)]
unsafe fn halves_at<T: Element>(t: Token<T>, x: *const T, y: *mut T, c: &[T], s: &[T], sign: T::Acc) -> usize {
    let (l, h) = (t.0, c.len());
    let sign = l.splat(sign.to_f64() as f32);
    let whole = h / HALVES * HALVES;
    let mut i = 0;
    // SAFETY: `i + 16 <= whole <= h`: within `c` and `s`, and within each
    // half of `x` and `y` (the caller's); `T` is bf16 (`Token`). Every load
    // of a group comes before its stores, so `y` may be `x`.
    unsafe {
        let (x1, x2, y1, y2) = (x, x.add(h), y, y.add(h));
        while i < whole {
            let (a, b) = (l.load_pair_unordered(x1.add(i)), l.load_pair_unordered(x2.add(i)));
            let (c, s) = (l.load_pair_unordered(c.as_ptr().add(i)), l.load_pair_unordered(s.as_ptr().add(i)));
            let s = (l.mul(s.0, sign), l.mul(s.1, sign));
            let (p0, q0) = rotate(l, a.0, b.0, c.0, s.0);
            let (p1, q1) = rotate(l, a.1, b.1, c.1, s.1);
            l.store_bf16_pair_normal_even_odd(y1.add(i).cast(), p0, p1);
            l.store_bf16_pair_normal_even_odd(y2.add(i).cast(), q0, q1);
            i += HALVES;
        }
    }
    whole
}

/// GPT-J: rotates pairs `(x[2k], x[2k + 1])` of a row of `2 h` by `c[k]`,
/// `s[k] * sign` (`h = c.len()`) into `y`, as the generic loop does, for
/// every whole group of 8 pairs; returns how many pairs it did.
///
/// # Panics
/// As [`halves`].
#[inline(always)]
pub(super) fn pairs<T: Element>(t: Token<T>, x: &[T], y: &mut [T], c: &[T], s: &[T], sign: T::Acc) -> usize {
    let h = c.len();
    let (x, y) = (&x[..2 * h], &mut y[..2 * h]);
    // SAFETY: as in `halves`.
    unsafe { pairs_at(t, x.as_ptr(), y.as_mut_ptr(), c, &s[..h], sign) }
}

/// [`pairs`] of `row` into itself, every pair (as [`halves_in_place`]).
///
/// # Panics
/// As [`halves_in_place`].
#[inline(always)]
pub(super) fn pairs_in_place<T: Element>(t: Token<T>, row: &mut [T], c: &[T], s: &[T], sign: T::Acc) {
    let h = c.len();
    let (row, s) = (&mut row[..2 * h], &s[..h]);
    let p = row.as_mut_ptr();
    // SAFETY: as in `halves_in_place`.
    let done = unsafe { pairs_at(t, p, p, c, s, sign) };
    for k in done..h {
        (row[2 * k], row[2 * k + 1]) = super::turn(row[2 * k], row[2 * k + 1], c[k], s[k], sign);
    }
}

/// [`pairs`] from `x` into `y`.
///
/// # Safety
/// As [`halves_at`].
#[inline(always)]
unsafe fn pairs_at<T: Element>(t: Token<T>, x: *const T, y: *mut T, c: &[T], s: &[T], sign: T::Acc) -> usize {
    let (l, h) = (t.0, c.len());
    let sign = l.splat(sign.to_f64() as f32);
    let whole = h / PAIRS * PAIRS;
    let mut k = 0;
    // SAFETY: `k + 8 <= whole <= h`: 8 values of `c` and `s` from `k`, 16
    // of `x` and `y` (`2 h`, the caller's) from `2 k`; `T` is bf16
    // (`Token`). The group's loads come before its store.
    unsafe {
        while k < whole {
            let (a, b) = l.load_pair_unordered(x.add(2 * k));
            let (c, s) = (l.load(c.as_ptr().add(k)), l.mul(l.load(s.as_ptr().add(k)), sign));
            let (p, q) = rotate(l, a, b, c, s);
            l.store_bf16_pair_normal_even_odd(y.add(2 * k).cast(), p, q);
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
    use super::{halves, halves_in_place, pairs, pairs_in_place, Token, HALVES, PAIRS};
    use crate::element::Element;
    use crate::simd::dispatch;
    use half::bf16;

    /// Both layouts over rows of every 7th bf16 bit pattern (NaN of both
    /// signs with many payloads, infinities, subnormals, results that are
    /// f32 subnormals or overflow), both signs of the angle, rows with and
    /// without a tail: every whole group is done, each value the generic
    /// loop's expression rounded by `from_acc`, bit for bit (any NaN for a
    /// NaN: the payload x86 passes on is that of an operand LLVM may order
    /// its own way), and the tail is left untouched. In place, every pair
    /// is done, each as out of place.
    #[test]
    fn bf16_groups_are_the_scalar_rotation_in_both_layouts() {
        if dispatch(
            #[inline(always)]
            || Token::<bf16>::new().is_none(),
        ) {
            eprintln!("skipped: this CPU lacks AVX2 with FMA and F16C (or KEEL_CPU_CAPABILITY is below avx2), or runs AVX512-BF16 (the other path)");
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
                    let (mut y, mut z) = (vec![bf16::from_bits(0x7777); 2 * h], x.clone());
                    let done = dispatch(
                        #[inline(always)]
                        || {
                            let t = Token::new().unwrap();
                            if interleaved {
                                pairs_in_place(t, &mut z, c, s, sign);
                                pairs(t, &x, &mut y, c, s, sign)
                            } else {
                                halves_in_place(t, &mut z, c, s, sign);
                                halves(t, &x, &mut y, c, s, sign)
                            }
                        },
                    );
                    assert_eq!(done, h / group * group, "h={h} interleaved={interleaved}");
                    for i in 0..h {
                        let (ia, ib) = at(i);
                        let (a, b, c, s) = (x[ia].to_acc(), x[ib].to_acc(), c[i].to_acc(), s[i].to_acc() * sign);
                        let want = [bf16::from_acc(a * c - b * s), bf16::from_acc(b * c + a * s)];
                        let untouched = bf16::from_bits(0x7777);
                        let out = if i < done { want } else { [untouched; 2] };
                        for (got, want) in [(y[ia], out[0]), (y[ib], out[1]), (z[ia], want[0]), (z[ib], want[1])] {
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
