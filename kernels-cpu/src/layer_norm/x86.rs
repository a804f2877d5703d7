//! layer_norm's forward in explicit SIMD, written once for AVX-512 and AVX2
//! ([`crate::wide`]): the shifted sums of the moments, then the normalised
//! and scaled row, which also prefetches the next row.
//!
//! The lane loops in `layer_norm.rs` left both passes to LLVM, and on an
//! AVX2 CPU (no AVX-512) layer_norm bf16 through torch took 1.3x
//! rms_norm's time and missed its 1.3x over `F.layer_norm`; perf put a
//! third of the time on the first read of each row, stalled on memory.
//! Here every step is full width, one `enter` runs a whole block of rows,
//! and the write pass asks for the next row's lines as it goes. criterion,
//! 4096x4096 forward, on that CPU: bf16 4.1-4.6 -> 3.4 ms, f16 8.3 -> 2.9 ms
//! (the lane loop's f16 widening was the cost there), f32 unchanged (bound
//! by memory). Rounding bf16 in registers instead of through the scratch
//! block was tried: 3.75 against 3.39 ms. With AVX-512's bf16 conversion it
//! is faster (see `wide::x86::write_row`), so bf16 rows round in registers there.
//!
//! The values are those of the lane loops' formulas, in their order for each
//! element (`x - k` exact, then the two fused multiply-adds of the affine
//! case, or `((x - k) - m1) * rstd` then the parameter); only the order of the
//! moments' sums differs (four vector accumulators of each, a part vector
//! last, then a tree over the lanes), within f32 accumulation error.
use super::{shift, Moments};
use crate::element::{Acc, Element};
use crate::rows::{row_and_after, Order};
use crate::simd::sum_pairs;
use crate::wide::x86::write_row::{self, load_bf16_pair, load_bf16_pair_opt, load_n_opt, RowValues};
use crate::wide::x86::{load_n as load, Kernel, Lanes};

/// The forward over whole rows of `cols`: `x` and `y` of one length, `w` and
/// `b` (when given) of `cols`, stored in `order`. For `T` in f32, bf16, f16
/// only (the callers check [`crate::wide::has_lanes`]).
pub(super) struct Forward<'a, T> {
    pub(super) x: &'a [T],
    pub(super) w: Option<&'a [T]>,
    pub(super) b: Option<&'a [T]>,
    pub(super) y: &'a mut [T],
    pub(super) cols: usize,
    pub(super) eps: f32,
    pub(super) order: Order,
}

impl<T: Element> Kernel for Forward<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<L: Lanes>(self, l: L) {
        let Forward { x, w, b, y, cols, eps, order } = self;
        order.each(
            y.len() / cols,
            #[inline(always)]
            |r| {
                let (xr, ahead) = row_and_after(x, r, cols, order);
                let m = moments(l, xr, eps);
                write_row(l, xr, w, b, &mut y[r * cols..][..cols], m, ahead, order);
            },
        );
    }
}

/// The row's [`Moments`]: the shifted sums of `layer_norm::moments` in
/// vectors, and its exact second pass where those would lose accuracy.
#[inline(always)]
fn moments<L: Lanes, T: Element>(l: L, x: &[T], eps: f32) -> Moments<f32> {
    let n = x.len() as f32;
    let k = shift(x).to_f64() as f32;
    let (s1, s2) = if k == 0.0 { shifted_sums::<L, T, false>(l, x, k) } else { shifted_sums::<L, T, true>(l, x, k) };
    let (m1, m2) = (s1 / n, s2 / n);
    let var = if m1 * m1 <= 0.5 * m2 {
        m2 - m1 * m1
    } else {
        let (k, m1) = (T::Acc::from_f64(k.into()), T::Acc::from_f64(m1.into()));
        (sum_pairs(x, x, |a, _| (a - k - m1) * (a - k - m1)).to_f64() as f32) / n
    };
    Moments { k, m1, rstd: super::inv_std(var, eps) }
}

/// `(sum(x - k), sum((x - k)^2))`: four vector accumulators of each over
/// groups of four vectors, then whole vectors, then a part vector (its other
/// lanes load as 0, and `0 - k` is masked off by a part add). Without the
/// subtraction where not `SHIFTED` (`k` is 0: see `layer_norm::shift`).
#[inline(always)]
fn shifted_sums<L: Lanes, T: 'static, const SHIFTED: bool>(l: L, x: &[T], k: f32) -> (f32, f32) {
    let (p, len, n) = (x.as_ptr(), x.len(), L::N);
    let kv = l.splat(k);
    let (mut a1, mut a2) = ([l.splat(0.0); 4], [l.splat(0.0); 4]);
    let mut at = 0;
    // SAFETY (loads): `at + n j + n <= len` in the first loop; the second
    // reads whole vectors while they fit, then the `len - at < n` values
    // left; `T` is f32, bf16 or f16 (the callers check).
    unsafe {
        while at + 4 * n <= len {
            for j in 0..4 {
                let v = minus::<L, SHIFTED>(l, l.load(p.add(at + n * j)), kv);
                a1[j] = l.add(a1[j], v);
                a2[j] = l.fmadd(v, v, a2[j]);
            }
            at += 4 * n;
        }
        let mut j = 0;
        while at + n <= len {
            let v = minus::<L, SHIFTED>(l, l.load(p.add(at)), kv);
            a1[j] = l.add(a1[j], v);
            a2[j] = l.fmadd(v, v, a2[j]);
            at += n;
            j += 1;
        }
        if at < len {
            let part = len - at;
            let v = minus::<L, SHIFTED>(l, l.load_part(p.add(at), part), kv);
            a1[j] = l.add_part(a1[j], v, part);
            a2[j] = l.add_part(a2[j], l.mul(v, v), part);
        }
    }
    (reduce4(l, a1), reduce4(l, a2))
}

/// `x - k`, or `x` where not `SHIFTED` (`k` is 0, and `x - 0` is `x`):
/// the forward's passes here and the backward's walk (`x86_backward`).
#[inline(always)]
pub(super) fn minus<L: Lanes, const SHIFTED: bool>(l: L, x: L::V, k: L::V) -> L::V {
    if SHIFTED {
        l.sub(x, k)
    } else {
        x
    }
}

/// The per-row constants of [`write_row`], as vectors.
#[derive(Clone, Copy)]
struct Consts<V> {
    k: V,
    m1: V,
    rstd: V,
    /// `-m1 rstd`, the affine case's first addend.
    nb: V,
}

/// The sum of the lanes of four vectors.
#[inline(always)]
fn reduce4<L: Lanes>(l: L, a: [L::V; 4]) -> f32 {
    l.reduce_add(l.add(l.add(a[0], a[1]), l.add(a[2], a[3])))
}

/// `y = xh * w + b` (each parameter when given), through
/// [`write_row`] in `order`: bf16 rounded in registers where the width
/// can, else block by block.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn write_row<L: Lanes, T: Element>(
    l: L,
    x: &[T],
    w: Option<&[T]>,
    b: Option<&[T]>,
    y: &mut [T],
    m: Moments<f32>,
    ahead: &[T],
    order: Order,
) {
    let c = Consts { k: l.splat(m.k), m1: l.splat(m.m1), rstd: l.splat(m.rstd), nb: l.splat(0.0 - m.m1 * m.rstd) };
    let len = y.len();
    assert!(x.len() >= len && w.is_none_or(|w| w.len() >= len) && b.is_none_or(|b| b.len() >= len));
    let (x, w, b) = (x.as_ptr(), w.map(<[T]>::as_ptr), b.map(<[T]>::as_ptr));
    if m.k == 0.0 {
        write_row::write_row(l, Row::<T, L::V, false> { c, x, w, b, len }, y, &[ahead], order);
    } else {
        write_row::write_row(l, Row::<T, L::V, true> { c, x, w, b, len }, y, &[ahead], order);
    }
}

/// One row's inputs and constants: its [`RowValues`] are the lane loops'
/// (without their `x - 0` where not `SHIFTED`).
#[derive(Clone, Copy)]
struct Row<T, V, const SHIFTED: bool> {
    c: Consts<V>,
    x: *const T,
    w: Option<*const T>,
    b: Option<*const T>,
    /// `x`, `w`, `b` hold at least this many values (`write_row` asserts).
    len: usize,
}

impl<L: Lanes, T: Copy + 'static, const SHIFTED: bool> RowValues<L> for Row<T, L::V, SHIFTED> {
    /// A subtract and multiplies or fused multiply-adds of the widened
    /// inputs and the row's moments (see [`RowValues::ARITHMETIC`] for what
    /// that gave on AVX2).
    const ARITHMETIC: bool = true;
    #[inline(always)]
    fn len(self) -> usize {
        self.len
    }
    /// [`of`] the inputs at `i`.
    #[inline(always)]
    unsafe fn value(self, l: L, i: usize, count: usize) -> L::V {
        let (c, x, w, b) = (self.c, self.x, self.w, self.b);
        // SAFETY: `i + count <= len` (the caller's), and each pointer holds
        // `len` values; `T` is f32, bf16 or f16 (the callers check).
        unsafe { of::<L, SHIFTED>(l, c, load(l, x, i, count), load_n_opt(l, w, i, count), load_n_opt(l, b, i, count)) }
    }
    #[inline(always)]
    unsafe fn pair(self, l: L, i: usize) -> (L::V, L::V) {
        // SAFETY: `i + 2 N <= len` and the inputs are bf16 (the caller's).
        unsafe {
            let (x0, x1) = load_bf16_pair(l, self.x.add(i));
            let ((w0, w1), (b0, b1)) = (load_bf16_pair_opt(l, self.w, i), load_bf16_pair_opt(l, self.b, i));
            (of::<L, SHIFTED>(l, self.c, x0, w0, b0), of::<L, SHIFTED>(l, self.c, x1, w1, b1))
        }
    }
}

/// One vector of a row from the widened `x`, `w`, `b`: `(x - k)` exact,
/// then the two fused multiply-adds of the affine case, or `((x - k) - m1)
/// * rstd` then the parameter (`x` itself for `x - k` where not `SHIFTED`).
#[inline(always)]
fn of<L: Lanes, const SHIFTED: bool>(l: L, c: Consts<L::V>, x: L::V, w: Option<L::V>, b: Option<L::V>) -> L::V {
    let d = minus::<L, SHIFTED>(l, x, c.k);
    match (w, b) {
        (Some(w), Some(b)) => l.fmadd(l.fmadd(d, c.rstd, c.nb), w, b),
        (Some(w), None) => l.mul(l.mul(l.sub(d, c.m1), c.rstd), w),
        (None, Some(b)) => l.add(l.mul(l.sub(d, c.m1), c.rstd), b),
        (None, None) => l.mul(l.sub(d, c.m1), c.rstd),
    }
}

#[cfg(test)]
mod tests {
    use super::Forward;
    use crate::element::Element;
    use crate::rows::{Order, ORDERS};
    use crate::wide::x86::{every_width, run_with, Width};
    use half::bf16;

    /// bf16 rows give the f32 kernel's values on the widened inputs, each
    /// rounded by `from_acc`, bit for bit: through the pairs rounded in
    /// registers, the groups with a subnormal (rounded in software), and the
    /// tail's block. Rows far from zero take the exact second pass. Row 3
    /// holds NaN (quiet and signalling, with payloads) and infinities, and
    /// the last weights and biases do too (AVX2 rounds these rows in
    /// registers with no NaN check: `RowValues::ARITHMETIC`); with `eps` 0
    /// a constant row's `0 * inf` gives x86's default NaN. A NaN counts as
    /// any NaN: the payload x86 passes on is that of the first NaN operand,
    /// and LLVM orders a fused multiply-add's operands its own way in each
    /// type's code.
    #[test]
    fn bf16_rows_are_the_f32_rows_rounded_at_every_width() {
        fn check<L: Width>(l: L) {
            for cols in [1usize, 16, 31, 32, 33, 100, 128, 300] {
                let rows = 5;
                let n = rows * cols;
                let specials = [0x7fc0u16, 0xffc0, 0x7f81, 0xff81, 0x7fff, 0x7f80, 0xff80, 0x7fc1];
                let mut x: Vec<bf16> = (0..n)
                    .map(|i| {
                        let v = ((i * 37 % 101) as f32 - 50.0) / 13.0;
                        bf16::from_acc(if (i / cols) % 3 == 2 { 1000.0 + v / 64.0 } else { v })
                    })
                    .collect();
                for (j, v) in x[3 * cols..4 * cols].iter_mut().enumerate().filter(|(j, _)| j % 5 == 1) {
                    *v = bf16::from_bits(specials[j % specials.len()]);
                }
                // Tiny weights in row 1: outputs below f32's normal range.
                let mut w: Vec<bf16> = (0..cols).map(|j| bf16::from_acc(0.5 + (j % 7) as f32 / 8.0)).collect();
                let mut b: Vec<bf16> = (0..cols).map(|j| bf16::from_acc((j % 5) as f32 / 4.0 - 0.5)).collect();
                if cols >= 64 {
                    w[cols - 3..].copy_from_slice(&[0x7f81, 0xff80, 0].map(bf16::from_bits));
                    b[cols - 2..].copy_from_slice(&[0xffff, 0x7f80].map(bf16::from_bits));
                }
                let tiny: Vec<bf16> = (0..cols).map(|j| bf16::from_bits(0x0080 + (j % 3) as u16)).collect();
                let wide = |v: &[bf16]| v.iter().map(|v| v.to_acc()).collect::<Vec<f32>>();
                // Each order of the bf16 rows against the other order of the
                // f32 rows: the order of the stores changes no value.
                let params = [(Some(&w[..]), Some(&b[..])), (Some(&tiny[..]), None), (None, None)];
                // Row 4 constant: with `eps` 0 its variance is 0 and `rstd` inf.
                x[4 * cols..].fill(bf16::from_f32(0.75));
                let runs = params.into_iter().flat_map(|p| ORDERS.map(|o| (p, o))).flat_map(|r| [(r, 1e-5), (r, 0.0)]);
                for (((w, b), order), eps) in runs {
                    let mut y = vec![bf16::ZERO; n];
                    run_with(l, Forward { x: &x, w, b, y: &mut y, cols, eps, order });
                    let (x32, w32, b32) = (wide(&x), w.map(wide), b.map(wide));
                    let mut y32 = vec![0f32; n];
                    let other = if order == Order::Ascending { Order::Descending } else { Order::Ascending };
                    let (w32, b32) = (w32.as_deref(), b32.as_deref());
                    run_with(l, Forward { x: &x32, w: w32, b: b32, y: &mut y32, cols, eps, order: other });
                    // A NaN as NaN: which NaN operand x86 passes on depends
                    // on the operand order LLVM picks for each type.
                    let bits = |v: bf16| if v.is_nan() { 0x7fc0 } else { v.to_bits() };
                    let want: Vec<u16> = y32.iter().map(|&v| bits(bf16::from_acc(v))).collect();
                    let got: Vec<u16> = y.iter().map(|&v| bits(v)).collect();
                    assert_eq!(
                        got,
                        want,
                        "cols={cols} weight={} bias={} {order:?} eps={eps}",
                        w.is_some(),
                        b.is_some()
                    );
                    if cols >= 64 {
                        // The specials reached the outputs.
                        assert!(y[3 * cols..4 * cols].iter().any(|v| v.is_nan()), "cols={cols}");
                        assert!(eps > 0.0 || y[4 * cols..].iter().all(|v| v.is_nan()), "cols={cols}");
                    }
                }
            }
        }
        every_width!(check);
    }
}
