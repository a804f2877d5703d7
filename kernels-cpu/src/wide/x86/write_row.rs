//! One row of f32 results written as `T` from explicit code, shared by the
//! norms' forwards (layer_norm, rms_norm) and the gated forwards, whose
//! values differ only in their [`RowValues`]: bf16 rows rounded in
//! registers where the width can ([`Lanes::store_bf16_pair`]), the rest
//! through `T::write_acc`'s blocks (straight into the row for f32),
//! prefetching the next row's inputs as it goes.
use super::Lanes;
use crate::element::Element;
use crate::narrow::BLOCK;
use crate::rows::Order;
use crate::simd::{prefetch_each, prefetch_write_ahead, prefetch_write_below};
use crate::wide::x86::load_n;
use crate::wide::{cast_mut, is};
use half::bf16;

/// The values of one output row, a vector at a time: an implementation
/// holds its inputs' pointers and the row's constants.
pub(crate) trait RowValues<L: Lanes>: Copy {
    /// Whether bf16 rows round in registers on AVX2, with no NaN check. An
    /// implementation may set it only where every NaN value is quiet with
    /// its low 16 bits zero (and should where that measures faster), as it is
    /// where each value is the result of float arithmetic (add, subtract,
    /// multiply, divide, fused multiply-add) whose NaN operands are values
    /// widened from bf16 or results of the same kind. x86 gives such an
    /// operation the payload of a NaN operand, quieted, or its default NaN,
    /// `0xffc00000`, and widening puts 16 bits in the high half. Between
    /// the operations, what keeps a lane or picks one of such values (a
    /// min, max, blend, a mask of whole lanes, `abs`, `copysign`) keeps
    /// that; so does a value whose mantissa is all zero, which is not NaN
    /// (the `2^n` that `exp` builds by shifting an integer into the exponent
    /// field). The integer rounding of [`Lanes::store_bf16_pair_normal`]
    /// keeps such a NaN's high half, as `from_acc` does (it sets the quiet
    /// bit, already set), and rounds every other f32 as `from_acc` does; so
    /// where this holds, bf16 rows round in registers on AVX2 too, with no
    /// NaN check. (A NaN with other low bits can round to an infinity or,
    /// all ones, carry into the sign: `0x7fffffff` gives `-0.0`.)
    ///
    /// The norms' forwards set it, and the gated ones but gelu tanh's
    /// (`WideAct::AVX2_PAIRS` in `gated/x86.rs`). On AVX2 (a 2-core Zen 3),
    /// bf16, two threads, into fresh huge pages and into memory faulted in
    /// before, old (a scratch block of f32, then LLVM's `from_acc` with its
    /// NaN fix-up) and new alternated in one process, new/old medians:
    /// `[4096, 4096]`, 60 rounds, layer_norm 0.92-0.97, rms_norm 0.92-0.98,
    /// fused_add_rms_norm 0.97-0.99 (session 54); `[4096, 8192]` out,
    /// 40-100 rounds, silu_and_mul 0.95-0.98, gelu_and_mul 0.91-0.94, gelu
    /// tanh 1.04-1.10 (session 55).
    const ARITHMETIC: bool = false;
    /// How many values the row has (its inputs hold at least that many).
    fn len(self) -> usize;
    /// Values `i..i + 2 N` of a bf16 row, each computed as
    /// [`RowValues::value`] computes it, in [`load_bf16_pair`]'s order:
    /// the inputs loaded by it, as the values are computed lane by lane.
    ///
    /// # Safety
    /// `i + 2 N <= self.len()`; the inputs are bf16.
    unsafe fn pair(self, l: L, i: usize) -> (L::V, L::V);
    /// The vector of output values `i..i + count` (`count <= N`; the other
    /// lanes of a part vector are unused).
    ///
    /// # Safety
    /// `i + count <= self.len()`.
    unsafe fn value(self, l: L, i: usize, count: usize) -> L::V;
}

/// Writes the row `f` gives into `y` (as long as `f.len()`), in `order`,
/// prefetching each of `ahead` (the next row's inputs, or empty slices) one
/// block at a time: block `k` of `y` prefetches block `k` of each.
#[inline(always)]
pub(crate) fn write_row<L: Lanes, T: Element, F: RowValues<L>>(l: L, f: F, y: &mut [T], ahead: &[&[T]], order: Order) {
    assert_eq!(f.len(), y.len(), "write_row: the row and its values differ in length");
    if order == Order::Descending {
        write_row_down(l, f, y, ahead);
        return;
    }
    // bf16 rows round in registers where the width can; the block path
    // below writes what is left (all of it for other types).
    let (y, at0) = match cast_mut::<T, bf16>(y) {
        Some(yb) => {
            let done = write_bf16_pairs(l, f, yb, ahead);
            (&mut cast_mut::<bf16, T>(yb).expect("write_row: T is bf16")[done..], done)
        }
        None => (y, 0),
    };
    T::write_acc(
        y,
        #[inline(always)]
        |at, out| {
            prefetch_each(ahead, (at0 + at) / BLOCK, BLOCK);
            let out = cast_mut::<T::Acc, f32>(out).expect("write_row: T::Acc is f32 for f32, bf16, f16");
            let (len, o, from) = (out.len(), out.as_mut_ptr(), at0 + at);
            let mut i = 0;
            // On Intel's AVX-512 an f32 row is `out` itself (no scratch block), a
            // vector a line: each store asks for its line ahead, as bf16
            // rows do ([`write_bf16_pairs`]). The Xeon, 4096x4096, two
            // threads, interleaved medians (session 62): into reused outputs
            // rms_norm 4.97 -> 3.86 ms, layer_norm 5.03 -> 4.55,
            // fused_add_rms_norm 11.7 -> 9.9; into fresh huge pages 3-6%
            // faster, into fresh 4 KiB pages 3-5%.
            let ahead_w = L::writes_ahead() && is::<T, f32>();
            // SAFETY: whole vectors while they fit in `out`, then the `len -
            // i < N` values left; `from + len <= f.len()` (the block lies in
            // the row).
            unsafe {
                while i + L::N <= len {
                    if ahead_w {
                        prefetch_write_ahead(o.add(i));
                    }
                    l.store(o.add(i), f.value(l, from + i, L::N));
                    i += L::N;
                }
                if i < len {
                    l.store_part(o.add(i), f.value(l, from + i, len - i), len - i);
                }
            }
        },
    );
}

/// [`write_row`] from the row's last value down: the same values, the same
/// vectors (each at the same place in the row), stored in the opposite
/// order. bf16 where it rounds in registers ([`write_bf16_pairs`]): the
/// values past the last whole group of `2 N` first, then the groups from the
/// last; the rest (f32, f16, and bf16 on AVX2 unless
/// [`RowValues::ARITHMETIC`]) block by block from the last block, each
/// block's vectors from the last.
#[inline(always)]
fn write_row_down<L: Lanes, T: Element, F: RowValues<L>>(l: L, f: F, y: &mut [T], ahead: &[&[T]]) {
    let n = 2 * L::N;
    let whole = if rounds_in_registers::<L, F>() && cast_mut::<T, bf16>(y).is_some() { y.len() / n * n } else { 0 };
    let (groups, rest) = y.split_at_mut(whole);
    write_blocks_down(l, f, rest, whole, ahead);
    if let Some(yb) = cast_mut::<T, bf16>(groups).filter(|_| whole > 0) {
        let mut i = whole;
        let yp = yb.as_ptr();
        while i > 0 {
            i -= n;
            // On Intel's AVX-512 each group asks for the line below ahead, as
            // `write_bf16_pairs` asks for the one above: on the Xeon, into
            // fresh huge pages (the only outputs written downwards), two
            // threads, 4096x4096, interleaved medians (session 62):
            // layer_norm 4.85-5.14 -> 4.63-4.86 ms, rms_norm 4.52-4.57 ->
            // 4.29-4.37, fused_add_rms_norm unchanged.
            if L::writes_ahead() {
                prefetch_write_below(yp.wrapping_add(i));
            }
            bf16_pair_at(l, f, yb, i, ahead);
        }
    }
}

/// Values `at0..at0 + y.len()` of `f` into `y`, a [`BLOCK`] (counted from
/// the row's start) at a time from the last, each block's vectors from the
/// last; prefetches block `k` of `ahead` before writing block `k`.
#[inline(always)]
fn write_blocks_down<L: Lanes, T: Element, F: RowValues<L>>(l: L, f: F, y: &mut [T], at0: usize, ahead: &[&[T]]) {
    let mut end = y.len();
    while end > 0 {
        // The block of the row that holds `at0 + end - 1`, clipped to `y`.
        let start = ((at0 + end - 1) / BLOCK * BLOCK).max(at0) - at0;
        prefetch_each(ahead, (at0 + start) / BLOCK, BLOCK);
        T::write_acc(
            &mut y[start..end],
            #[inline(always)]
            |at, out| {
                let out = cast_mut::<T::Acc, f32>(out).expect("write_row: T::Acc is f32 for f32, bf16, f16");
                let (len, o, from) = (out.len(), out.as_mut_ptr(), at0 + start + at);
                let mut i = len / L::N * L::N;
                // SAFETY: the part vector past the whole ones, then whole
                // vectors down to 0, all inside `out`; `from + len <=
                // f.len()` (the block lies in the row).
                unsafe {
                    if i < len {
                        l.store_part(o.add(i), f.value(l, from + i, len - i), len - i);
                    }
                    while i > 0 {
                        i -= L::N;
                        l.store(o.add(i), f.value(l, from + i, L::N));
                    }
                }
            },
        );
        end = start;
    }
}

/// bf16 rows rounded in registers ([`Lanes::store_bf16_pair`], or on AVX2
/// for [`RowValues::ARITHMETIC`] values the integer rounding): `y`'s first
/// whole groups of `2 N` values, prefetching `ahead` as the block path
/// does; returns how many values it wrote (0 on AVX2 for other values). A
/// group with an f32 subnormal is rounded in software, as
/// [`Element::from_acc`] does, where the conversion instruction would flush
/// it.
///
/// The block path (f32 values stored to a scratch block, then narrowed)
/// costs two stores and two loads more per `2 N` values: layer_norm bf16,
/// criterion, 4096x4096 on the Xeon (Emerald Rapids), one thread,
/// 4.66-5.10 -> 4.00-4.09 ms; through torch with THP, 1.22-1.24x -> 1.18x
/// a clone of `x` (alternated runs).
///
/// On Intel's AVX-512 each group asks for its line ahead
/// ([`prefetch_write_ahead`]): perf had put most of layer_norm's bf16
/// forward on the store, waiting on the line's read for ownership. On a
/// 2-core AVX-512 Xeon, outputs reused, 1 KiB ahead against none:
/// layer_norm bf16 4096x4096 2.17 -> 1.93 ms, rms_norm 1.83 -> 1.59,
/// 512x4096 and 2048x8192 1.06-1.12x, fused_add_rms_norm 1.12x, the gated
/// ops 1.04-1.05x; into fresh outputs neither faster nor slower (session 61).
#[inline(always)]
fn write_bf16_pairs<L: Lanes, F: RowValues<L>, T>(l: L, f: F, y: &mut [bf16], ahead: &[&[T]]) -> usize {
    if !rounds_in_registers::<L, F>() {
        return 0;
    }
    let (n, len) = (2 * L::N, y.len());
    let whole = len / n * n;
    let mut i = 0;
    let yp = y.as_ptr();
    while i < whole {
        if L::writes_ahead() {
            // A group of 2 N = 32 values is one 64-byte line. Past the row
            // the prefetch reaches the next row (or the next block's, or
            // memory past the output).
            prefetch_write_ahead(yp.wrapping_add(i));
        }
        bf16_pair_at(l, f, y, i, ahead);
        i += n;
    }
    whole
}

/// The group of `2 N` values of `f` at `i` rounded into `y[i..i + 2 N]`,
/// prefetching block `i / BLOCK` of `ahead` where the group starts a block:
/// one step of [`write_bf16_pairs`] and of [`write_row_down`]'s groups.
/// Panics where `y` does not hold the group; `y` must be no longer than
/// `f` (as [`write_row`] asserts of the whole row).
#[inline(always)]
fn bf16_pair_at<L: Lanes, F: RowValues<L>, T>(l: L, f: F, y: &mut [bf16], i: usize, ahead: &[&[T]]) {
    let n = 2 * L::N;
    if i.is_multiple_of(BLOCK) {
        prefetch_each(ahead, i / BLOCK, BLOCK);
    }
    let y = &mut y[i..i + n];
    // SAFETY: `y` holds values `i..i + 2 N` (the slice above), and `f` at
    // least as many values as the row `y` lies in; the row is bf16 (`y`).
    let (a, b) = unsafe { f.pair(l, i) };
    // Without `ROUNDS_BF16`, `F::ARITHMETIC` holds (`rounds_in_registers`).
    store_bf16_pair_arithmetic(l, y, a, b);
}

/// Whether bf16 rows of `F` round in registers at this width: where it
/// converts in hardware, or where `F`'s values keep NaN as the integer
/// rounding needs ([`RowValues::ARITHMETIC`]).
#[inline(always)]
fn rounds_in_registers<L: Lanes, F: RowValues<L>>() -> bool {
    L::ROUNDS_BF16 || F::ARITHMETIC
}

/// `lo` then `hi` rounded to bf16 into `y` (`2 N` long): by
/// [`Lanes::store_bf16_pair`], or, where a lane is an f32 subnormal, in
/// software, as [`Element::from_acc`] does. For a width with
/// `ROUNDS_BF16` only (else every pair goes the software way).
#[inline(always)]
fn store_bf16_pair_rounded<L: Lanes>(l: L, y: &mut [bf16], lo: L::V, hi: L::V) {
    assert_eq!(y.len(), 2 * L::N, "store_bf16_pair_rounded: y is not two vectors long");
    // SAFETY: `y` holds the `2 N` values both calls write.
    unsafe {
        if !l.store_bf16_pair(y.as_mut_ptr(), lo, hi) {
            let mut t = [0f32; 64];
            l.store(t.as_mut_ptr(), lo);
            l.store(t.as_mut_ptr().add(L::N), hi);
            bf16::from_acc_slice(&t[..2 * L::N], y);
        }
    }
}

/// `2 N` values in [`load_bf16_pair`]'s order rounded into `y` (`2 N`
/// long): [`store_bf16_pair_rounded`] where the width converts, else (AVX2)
/// the integer rounding with no NaN check
/// ([`Lanes::store_bf16_pair_normal_even_odd`]), for values of which
/// [`RowValues::ARITHMETIC`]'s argument holds: any NaN among them is quiet
/// with its low 16 bits zero.
#[inline(always)]
pub(crate) fn store_bf16_pair_arithmetic<L: Lanes>(l: L, y: &mut [bf16], a: L::V, b: L::V) {
    if L::ROUNDS_BF16 {
        store_bf16_pair_rounded(l, y, a, b);
    } else {
        assert_eq!(y.len(), 2 * L::N, "store_bf16_pair_arithmetic: y is not two vectors long");
        // SAFETY: `y` holds the `2 N` values written.
        unsafe { l.store_bf16_pair_normal_even_odd(y.as_mut_ptr(), a, b) };
    }
}

/// `2 N` bf16 values at `p` widened to f32, as the bf16 pairs of
/// [`RowValues::pair`] and [`store_bf16_pair_arithmetic`] hold them: in
/// order where the width converts in hardware (`ROUNDS_BF16`), else as
/// [`Lanes::load_pair_unordered`] holds bf16 (the even values, then the odd
/// ones): per 16 values, a load and two integer instructions where the
/// order takes two widening loads and two shifts, and one blend on the
/// store where the order takes a shift, a pack and a lane-crossing permute.
/// On AVX2 (a 2-core Zen 3, bf16, `[4096, 4096]` norms, `[4096, 8192]`
/// gated outputs, two threads, into fresh huge pages and into memory
/// faulted in before, both orders alternated in one process, medians of
/// 60-80 per-round ratios, session 57), this order against the other:
/// layer_norm 0.69-0.78, rms_norm 0.89-0.98, fused_add_rms_norm
/// 0.87-0.90, silu_and_mul 0.91-0.94, gelu_and_mul 0.96-0.98, and the
/// gated backwards 0.92-0.95.
///
/// # Safety
/// `p..p + 2 N` is readable (`T` is bf16: asserted).
#[inline(always)]
pub(crate) unsafe fn load_bf16_pair<L: Lanes, T: 'static>(l: L, p: *const T) -> (L::V, L::V) {
    assert!(crate::wide::is::<T, bf16>(), "load_bf16_pair: T is not bf16");
    // SAFETY: the caller's.
    unsafe {
        if L::ROUNDS_BF16 {
            (l.load(p), l.load(p.add(L::N)))
        } else {
            l.load_pair_unordered(p)
        }
    }
}

/// [`load_n`] of an optional input at `i` (a norm's weight or bias).
///
/// # Safety
/// As [`load_n`], where `p` is some.
#[inline(always)]
// A match, not `Option::map`: a closure is not compiled for the width's
// features, so the intrinsics of its load would not inline.
#[allow(clippy::manual_map)]
pub(crate) unsafe fn load_n_opt<L: Lanes, T: 'static>(
    l: L,
    p: Option<*const T>,
    i: usize,
    count: usize,
) -> Option<L::V> {
    match p {
        // SAFETY: the caller's.
        Some(p) => Some(unsafe { load_n(l, p, i, count) }),
        None => None,
    }
}

/// [`load_bf16_pair`] of an optional input at `i` (a norm's weight or
/// bias): both vectors or neither.
///
/// # Safety
/// As [`load_bf16_pair`] at `p + i`, where `p` is some.
#[inline(always)]
pub(crate) unsafe fn load_bf16_pair_opt<L: Lanes, T: 'static>(
    l: L,
    p: Option<*const T>,
    i: usize,
) -> (Option<L::V>, Option<L::V>) {
    match p {
        Some(p) => {
            // SAFETY: the caller's.
            let (a, b) = unsafe { load_bf16_pair(l, p.add(i)) };
            (Some(a), Some(b))
        }
        None => (None, None),
    }
}
