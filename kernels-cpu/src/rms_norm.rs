//! RMS normalisation over the last dimension.
//!
//! For a row `x` of `n` elements: `y = x / sqrt(mean(x^2) + eps) * w`, the same
//! as `torch.nn.functional.rms_norm(x, (n,), w, eps)`.
//!
//! - Shapes: `x` and `out` hold `rows * cols` elements, row-major; `weight`
//!   holds `cols`. `rows` may be 0.
//! - Numerics: sums and products in `T::Acc` (f32 for f16/bf16/f32, f64 for
//!   f64), rounded to `T` once at the end. Against the f64 reference
//!   ([`forward_ref`]) the error is within one rounding of `T` plus the f32
//!   accumulation error (about `1e-6 * sqrt(cols)` relative).
//! - Layout: [`forward_strided`] reads rows placed by a [`RowLayout`] (a
//!   strided view, each row contiguous); the output is always contiguous.
//! - Parallelism: blocks of whole rows, spread by [`Par`]; the backward's
//!   weight gradient is summed per block and the blocks are then added in
//!   order, so for a given thread count the result is deterministic.
use crate::element::{Acc, Element};
use crate::error::{check_len, check_rows, Error, Result};
use crate::layout::{Offsets, RowLayout};
use crate::narrow::BLOCK;
use crate::par::Par;
use crate::rows::{row_and_next, sum_partials, Blocks, Order, Split};
use crate::simd::{dispatch, prefetch_part, prefetching, sums3};
#[cfg(target_arch = "x86_64")]
use crate::wide::{cast, cast_mut};
#[cfg(target_arch = "x86_64")]
use half::f16;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_backward;
#[cfg(target_arch = "x86_64")]
mod x86_rows;

const OP_FWD: &str = "rms_norm";

/// Where the forward rounds to the element type `T`, when there is a weight
/// (without one the two are the same).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Rounding {
    /// Once, at the end: `T((x r) w)` with `r = 1 / rms`, as torch's
    /// `F.rms_norm` computes.
    #[default]
    Once,
    /// The normalised value first, then its product with the weight:
    /// `T(T(x r) w)`, as Hugging Face's `LlamaRMSNorm` computes (`weight *
    /// hidden.to(input_dtype)`), and the models that copy it (Mistral,
    /// Qwen2, Qwen3 ...), vLLM's kernels and Liger's "llama" casting mode.
    /// The same as [`Rounding::Once`] for f32 and f64.
    BeforeWeight,
}

const OP_BWD: &str = "rms_norm_backward";

/// Checks the buffer lengths of a forward call (`weight` is the weight's
/// length, if given) against `cols`, and `eps`; returns the number of rows.
/// Shared by the CPU kernel and the CUDA entry points of the root crate.
pub fn check_forward(x: usize, weight: Option<usize>, out: usize, cols: usize, eps: f64) -> Result<usize> {
    let rows = check_rows(OP_FWD, x, cols, eps)?;
    check_len(OP_FWD, "out", out, x)?;
    if let Some(w) = weight {
        check_len(OP_FWD, "weight", w, cols)?;
    }
    Ok(rows)
}

/// Checks the buffer lengths of a backward call, as [`check_forward`];
/// `grad_weight` may be given only when `weight` is.
pub fn check_backward(
    grad_out: usize,
    x: usize,
    weight: Option<usize>,
    grad_input: usize,
    grad_weight: Option<usize>,
    cols: usize,
    eps: f64,
) -> Result<usize> {
    let rows = check_rows(OP_BWD, x, cols, eps)?;
    check_len(OP_BWD, "grad_out", grad_out, x)?;
    check_len(OP_BWD, "grad_input", grad_input, x)?;
    if let Some(w) = weight {
        check_len(OP_BWD, "weight", w, cols)?;
    }
    match (grad_weight, weight) {
        (Some(gw), Some(_)) => check_len(OP_BWD, "grad_weight", gw, cols)?,
        (Some(_), None) => {
            return Err(Error::Shape { op: OP_BWD, arg: "grad_weight", msg: "given but weight is None".into() });
        }
        _ => {}
    }
    Ok(rows)
}

/// Forward: writes `rms_norm(x) * weight` to `out`, rounded once
/// ([`Rounding::Once`]).
///
/// Errors if a length does not match `cols`, or `eps` is negative or not finite.
pub fn forward<T: Element>(
    x: &[T],
    weight: Option<&[T]>,
    out: &mut [T],
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_forward(x.len(), weight.map(<[T]>::len), out.len(), cols, eps)?;
    forward_contiguous(x, weight, out, rows, cols, eps, Rounding::Once, par);
    Ok(())
}

/// [`forward`] over checked lengths (`rows` of `cols`), rounding as `rounding` says.
#[allow(clippy::too_many_arguments)]
fn forward_contiguous<T: Element>(
    x: &[T],
    weight: Option<&[T]>,
    out: &mut [T],
    rows: usize,
    cols: usize,
    eps: f64,
    rounding: Rounding,
    par: Par<'_>,
) {
    if rows * cols == 0 {
        return;
    }
    let eps = T::Acc::from_f64(eps);
    let round = rounds_first::<T>(weight, rounding);
    let blocks = Blocks::new(&par, rows, cols);
    let ys = Split::new(out, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let (mut y, order) = ys.get_ordered(b);
        let x = &x[blocks.rows(b).start * cols..][..y.len()];
        let at = RowLayout::contiguous(y.len() / cols, cols).offsets_from(0);
        if forward_explicit(x, at, weight, &mut y, cols, eps, round, order) {
            return;
        }
        dispatch(
            #[inline(always)]
            || {
                for (r, y) in y.chunks_exact_mut(cols).enumerate() {
                    let (x, ahead) = row_and_next(x, r, cols);
                    forward_row(x, weight, y, eps, round, ahead);
                }
            },
        );
    });
}

/// Whether the forward rounds `x r` to `T` before the weight: only where
/// `rounding` asks, there is a weight, and `T` is narrower than its
/// accumulator (f32 and f64 values are already in it).
pub(crate) fn rounds_first<T: Element>(weight: Option<&[T]>, rounding: Rounding) -> bool {
    rounding == Rounding::BeforeWeight && weight.is_some() && std::mem::size_of::<T>() < std::mem::size_of::<T::Acc>()
}

/// [`forward`] of an `x` whose rows `layout` places (each row `cols`
/// contiguous elements), rounding as `rounding` says; `out` is contiguous.
/// `x` must hold at least `layout.span(cols)` elements.
#[allow(clippy::too_many_arguments)]
pub fn forward_strided<T: Element>(
    x: &[T],
    layout: RowLayout,
    weight: Option<&[T]>,
    out: &mut [T],
    cols: usize,
    eps: f64,
    rounding: Rounding,
    par: Par<'_>,
) -> Result<()> {
    let rows = layout.rows();
    check_forward(rows * cols, weight.map(<[T]>::len), out.len(), cols, eps)?;
    layout.check_len(OP_FWD, "input", x.len(), cols)?;
    if rows * cols == 0 {
        return Ok(());
    }
    if layout.is_contiguous(cols) {
        forward_contiguous(&x[..rows * cols], weight, out, rows, cols, eps, rounding, par);
        return Ok(());
    }
    let eps = T::Acc::from_f64(eps);
    let round = rounds_first::<T>(weight, rounding);
    let blocks = Blocks::new(&par, rows, cols);
    let ys = Split::new(out, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let (mut y, order) = ys.get_ordered(b);
        let mut at = layout.offsets_from(blocks.rows(b).start);
        if forward_explicit(x, at.clone(), weight, &mut y, cols, eps, round, order) {
            return;
        }
        dispatch(
            #[inline(always)]
            || {
                let n = y.len() / cols;
                for (r, y) in y.chunks_exact_mut(cols).enumerate() {
                    let (row, ahead) = strided_row_and_next(x, &mut at, r + 1 < n, cols);
                    forward_row(row, weight, y, eps, round, ahead);
                }
            },
        );
    });
    Ok(())
}

/// The forward's rows that `at` places in `x`, into `y`, in explicit SIMD
/// (`rms_norm/x86.rs`), `x r` rounded to `T` before the weight where
/// `round`; false (without running) where there is none: `T` not f32, bf16
/// or f16, or a CPU without AVX2 (with FMA and F16C).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn forward_explicit<T: Element>(
    x: &[T],
    at: Offsets,
    weight: Option<&[T]>,
    y: &mut [T],
    cols: usize,
    eps: T::Acc,
    round: bool,
    order: Order,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::wide::has_lanes::<T>() {
        let k = x86::Forward { x, at, w: weight, y, cols, eps: eps.to_f64() as f32, round, order };
        return crate::wide::x86::run(k).is_some();
    }
    let _ = (x, at, weight, y, cols, eps, round, order);
    false
}

/// The row at `at` and (where `more`) the next one, which the row kernels
/// prefetch; moves `at` on.
#[inline(always)]
fn strided_row_and_next<'a, T>(x: &'a [T], at: &mut Offsets, more: bool, cols: usize) -> (&'a [T], &'a [T]) {
    let row = &x[at.get()..][..cols];
    at.advance();
    (row, if more { &x[at.get()..][..cols] } else { &[] })
}

/// Backward: from `grad_out` and the forward's `x` and `weight`, writes
/// `grad_input` and (when given) `grad_weight`.
///
/// `grad_weight` must be `Some` only when `weight` is.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
    grad_out: &[T],
    x: &[T],
    weight: Option<&[T]>,
    grad_input: &mut [T],
    grad_weight: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_backward(
        grad_out.len(),
        x.len(),
        weight.map(<[T]>::len),
        grad_input.len(),
        grad_weight.as_deref().map(<[T]>::len),
        cols,
        eps,
    )?;
    let layout = RowLayout::contiguous(rows, cols);
    backward_unchecked(grad_out, None, x, layout, weight, grad_input, grad_weight, cols, eps, par);
    Ok(())
}

/// [`backward`] of an `x` whose rows `layout` places (the forward's input,
/// read in place as [`forward_strided`] does); `grad_out`, `grad_input` are
/// contiguous. `x` must hold at least `layout.span(cols)` elements.
#[allow(clippy::too_many_arguments)]
pub fn backward_strided<T: Element>(
    grad_out: &[T],
    x: &[T],
    layout: RowLayout,
    weight: Option<&[T]>,
    grad_input: &mut [T],
    grad_weight: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    let n = layout.rows() * cols;
    let gw = grad_weight.as_deref().map(<[T]>::len);
    check_backward(grad_out.len(), n, weight.map(<[T]>::len), grad_input.len(), gw, cols, eps)?;
    layout.check_len(OP_BWD, "input", x.len(), cols)?;
    backward_unchecked(grad_out, None, x, layout, weight, grad_input, grad_weight, cols, eps, par);
    Ok(())
}

/// The backward over checked lengths, `x`'s rows placed by `layout` (the
/// others contiguous), adding `grad_add` (when given, `grad_input`'s shape)
/// to `grad_input`: `fused_add_rms_norm`'s gradient through its second output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_unchecked<T: Element>(
    grad_out: &[T],
    grad_add: Option<&[T]>,
    x: &[T],
    layout: RowLayout,
    weight: Option<&[T]>,
    grad_input: &mut [T],
    grad_weight: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) {
    let rows = layout.rows();
    if rows * cols == 0 {
        if let Some(gw) = grad_weight {
            sum_partials::<T>(&[], gw, cols);
        }
        return;
    }
    let eps = T::Acc::from_f64(eps);
    let blocks = Blocks::new(&par, rows, cols);
    let mut partial = vec![T::Acc::ZERO; if grad_weight.is_some() { blocks.count * cols } else { 0 }];
    {
        let dxs = Split::new(grad_input, blocks.per * cols);
        let dws = Split::new(&mut partial, cols);
        let want_dw = grad_weight.is_some();
        par.for_each(blocks.count, &|b| {
            let mut dx = dxs.get(b);
            let mut dw = want_dw.then(|| dws.get(b));
            let start = blocks.rows(b).start;
            let (at, n) = (start * cols, dx.len());
            let mut ox = layout.offsets_from(start);
            let (dy, add) = (&grad_out[at..][..n], grad_add.map(|a| &a[at..][..n]));
            dispatch(
                #[inline(always)]
                || {
                    // f16 and bf16: row by row in explicit SIMD, on the rows as
                    // they lie (`x86_rows.rs`).
                    #[cfg(target_arch = "x86_64")]
                    if crate::wide::is::<T, f16>() || crate::wide::is::<T, half::bf16>() {
                        let k = x86_rows::Rows {
                            x,
                            ox: &mut ox,
                            dy,
                            add,
                            w: weight,
                            dx: &mut dx,
                            dw: dw
                                .as_deref_mut()
                                .map(|d| cast_mut::<T::Acc, f32>(d).expect("rms_norm: f16's and bf16's Acc is f32")),
                            cols,
                            eps: eps.to_f64() as f32,
                        };
                        if crate::wide::x86::run(k).is_some() {
                            return;
                        }
                    }
                    let rows = n / cols;
                    // f32 with the weight's gradient (training): two rows at a time.
                    #[cfg(target_arch = "x86_64")]
                    if let (true, Some(w), Some(dw)) = (crate::wide::is::<T, f32>(), weight, &mut dw) {
                        let e = "rms_norm: T is f32";
                        let k = x86_backward::Backward {
                            x: cast::<T, f32>(x),
                            ox: &mut ox,
                            dy: cast::<T, f32>(dy),
                            add: add.map(cast::<T, f32>),
                            w: cast::<T, f32>(w),
                            dx: cast_mut::<T, f32>(&mut dx).expect(e),
                            dw: cast_mut::<T::Acc, f32>(&mut dw[..]).expect(e),
                            cols,
                            eps: eps.to_f64() as f32,
                        };
                        if crate::wide::x86::run(k).is_some() {
                            return;
                        }
                    }
                    for (r, dx) in dx.chunks_exact_mut(cols).enumerate() {
                        let (x, next_x) = strided_row_and_next(x, &mut ox, r + 1 < rows, cols);
                        let (dy, next_dy) = row_and_next(dy, r, cols);
                        let add = add.map(|a| &a[r * cols..][..cols]);
                        let dw = dw.as_deref_mut().map(|d| &mut d[..]);
                        backward_row(x, dy, add, weight, dx, dw, eps, &[next_dy, next_x]);
                    }
                },
            );
        });
    }
    if let Some(gw) = grad_weight {
        sum_partials(&partial, gw, cols);
    }
}

#[inline(always)]
pub(crate) fn inv_rms<A: Acc>(sum_sq: A, cols: usize, eps: A) -> A {
    A::ONE / (sum_sq / A::from_usize(cols) + eps).sqrt()
}

/// One row of the forward; the write pass prefetches `ahead` (the next row,
/// or empty), whose first read otherwise waits on memory (measured,
/// criterion 4096x4096 on an AVX2 CPU: bf16 3.2 -> 2.6 ms, f16 5.3 -> 4.6,
/// f32 unchanged). Where `round` (and there is a weight), `x r` is rounded
/// to `O` before the weight multiplies it ([`Rounding::BeforeWeight`]).
///
/// The inputs are `I`, the output `O`: the same type, or f32 inputs widened
/// from f16 for f16 outputs (fused_add_rms_norm's widened f16 rows).
#[inline(always)]
pub(crate) fn forward_row<I: Element, O: Element<Acc = I::Acc>>(
    x: &[I],
    weight: Option<&[I]>,
    y: &mut [O],
    eps: I::Acc,
    round: bool,
    ahead: &[O],
) {
    let sum_sq = I::sum_squares(x);
    let r = inv_rms(sum_sq, x.len(), eps);
    match weight {
        Some(w) if round => O::write_acc(
            y,
            #[inline(always)]
            |at, y| {
                prefetch_part::<O, false>(ahead, at / BLOCK, BLOCK);
                let (x, w) = (&x[at..][..y.len()], &w[at..][..y.len()]);
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = O::from_acc(x.to_acc() * r).to_acc() * w.to_acc();
                }
            },
        ),
        Some(w) => O::write_acc(
            y,
            #[inline(always)]
            |at, y| {
                prefetch_part::<O, false>(ahead, at / BLOCK, BLOCK);
                let (x, w) = (&x[at..][..y.len()], &w[at..][..y.len()]);
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = x.to_acc() * r * w.to_acc();
                }
            },
        ),
        None => O::write_acc(
            y,
            #[inline(always)]
            |at, y| {
                prefetch_part::<O, false>(ahead, at / BLOCK, BLOCK);
                let x = &x[at..][..y.len()];
                for (y, x) in y.iter_mut().zip(x) {
                    *y = x.to_acc() * r;
                }
            },
        ),
    }
}

/// With `r = inv_rms(x)`, `g = dy * w`:
/// `dx = r * g - x * r^3 * sum(g * x) / n (+ add)` and `dw += dy * x * r`;
/// `ahead` is the next row of `dy` and `x`, prefetched as `dx` is written.
/// The lane loop: f64, f32 outside the training case, and every type on
/// CPUs without AVX2 (f16 and bf16 take `x86_rows.rs` where they have it).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_row<T: Element>(
    x: &[T],
    dy: &[T],
    add: Option<&[T]>,
    weight: Option<&[T]>,
    dx: &mut [T],
    mut dw: Option<&mut [T::Acc]>,
    eps: T::Acc,
    ahead: &[&[T]],
) {
    let (r, c) = grad_consts(x, dy, weight, eps);
    // Written part by part, prefetching the next row for the sums above.
    prefetching(
        dx,
        ahead,
        #[inline(always)]
        |k, dx| {
            // Computed in `T::Acc` and narrowed in blocks (F16C for f16,
            // where one value at a time took 3x bf16's time).
            T::write_acc(
                dx,
                #[inline(always)]
                |at, dx| {
                    let (k, m) = (k + at, dx.len());
                    let dw = dw.as_deref_mut().map(|d| &mut d[k..][..m]);
                    let (w, add) = (weight.map(|w| &w[k..][..m]), add.map(|a| &a[k..][..m]));
                    grad_part(&x[k..][..m], &dy[k..][..m], add, w, dx, dw, r, c);
                },
            )
        },
    );
}

/// A row's `r = 1 / rms(x)` and `c = r^3 sum(g x) / n` (`g = dy w`, or `dy`
/// without a weight), from one pass over `dy`, `w` and `x`: for
/// [`backward_row`] and the rows of `x86_backward`.
#[inline(always)]
fn grad_consts<T: Element>(x: &[T], dy: &[T], weight: Option<&[T]>, eps: T::Acc) -> (T::Acc, T::Acc) {
    let n = x.len();
    let (sum_sq, gx) = match weight {
        Some(w) => sums3(dy, w, x, |dy, w, x| (x * x, dy * w * x)),
        None => sums3(dy, x, x, |dy, x, _| (x * x, dy * x)),
    };
    consts_from_sums(sum_sq, gx, n, eps)
}

/// `(r, c)` of a row of `n` from its `sum(x^2)` and `sum(g x)`: `r = 1 /
/// rms`, `c = r^3 sum(g x) / n`. For [`grad_consts`] and `x86_rows`.
#[inline(always)]
fn consts_from_sums<A: Acc>(sum_sq: A, gx: A, n: usize, eps: A) -> (A, A) {
    let r = inv_rms(sum_sq, n, eps);
    (r, r * r * r * gx / A::from_usize(n))
}

/// `dx = r * dy * w - x * c (+ add)` and `dw += dy * x * r` over one part of
/// a row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn grad_part<T: Element>(
    x: &[T],
    dy: &[T],
    add: Option<&[T]>,
    weight: Option<&[T]>,
    dx: &mut [T::Acc],
    dw: Option<&mut [T::Acc]>,
    r: T::Acc,
    c: T::Acc,
) {
    let mut dw = dw;
    match (weight, add) {
        // The training case: dx and dw in one pass over dy and x.
        (Some(w), None) if dw.is_some() => {
            let dw = dw.take().unwrap_or_default();
            for (((dx, x), (dy, w)), dw) in dx.iter_mut().zip(x).zip(dy.iter().zip(w)).zip(dw.iter_mut()) {
                let (x, dy) = (x.to_acc(), dy.to_acc());
                *dx = r * dy * w.to_acc() - x * c;
                *dw = *dw + dy * x * r;
            }
        }
        (Some(w), None) => {
            for ((dx, x), (dy, w)) in dx.iter_mut().zip(x).zip(dy.iter().zip(w)) {
                *dx = r * dy.to_acc() * w.to_acc() - x.to_acc() * c;
            }
        }
        (None, None) => {
            for ((dx, x), dy) in dx.iter_mut().zip(x).zip(dy) {
                *dx = r * dy.to_acc() - x.to_acc() * c;
            }
        }
        (Some(w), Some(a)) => {
            for ((dx, x), ((dy, w), a)) in dx.iter_mut().zip(x).zip(dy.iter().zip(w).zip(a)) {
                *dx = r * dy.to_acc() * w.to_acc() - x.to_acc() * c + a.to_acc();
            }
        }
        (None, Some(a)) => {
            for ((dx, x), (dy, a)) in dx.iter_mut().zip(x).zip(dy.iter().zip(a)) {
                *dx = r * dy.to_acc() - x.to_acc() * c + a.to_acc();
            }
        }
    }
    if let Some(dw) = dw {
        for ((dw, x), dy) in dw.iter_mut().zip(x).zip(dy) {
            *dw = *dw + dy.to_acc() * x.to_acc() * r;
        }
    }
}

/// Reference forward: plain loops in f64 from the given values.
pub fn forward_ref<T: Element>(x: &[T], weight: Option<&[T]>, cols: usize, eps: f64) -> Vec<f64> {
    forward_ref_rounded(x, weight, cols, eps, Rounding::Once)
}

/// [`forward_ref`] rounding as `rounding` says: for
/// [`Rounding::BeforeWeight`] with a weight and `T` f16 or bf16, `x r` (in
/// f64) rounded to `T` before the weight multiplies it.
pub fn forward_ref_rounded<T: Element>(
    x: &[T],
    weight: Option<&[T]>,
    cols: usize,
    eps: f64,
    rounding: Rounding,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols.max(1)) {
        let ms = row.iter().map(|v| v.to_f64() * v.to_f64()).sum::<f64>() / cols as f64;
        let r = 1.0 / (ms + eps).sqrt();
        for (j, v) in row.iter().enumerate() {
            let normed = v.to_f64() * r;
            let normed = match rounding {
                Rounding::BeforeWeight if rounds_first::<T>(weight, rounding) => T::from_f64(normed).to_f64(),
                _ => normed,
            };
            out.push(normed * weight.map_or(1.0, |w| w[j].to_f64()));
        }
    }
    out
}

/// Reference backward: `(grad_input, grad_weight)` in f64; `grad_weight` is
/// `None` when `weight` is.
pub fn backward_ref<T: Element>(
    grad_out: &[T],
    x: &[T],
    weight: Option<&[T]>,
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Option<Vec<f64>>) {
    let mut dx = Vec::with_capacity(x.len());
    let mut dw = weight.map(|_| vec![0.0f64; cols]);
    for (row, dy) in x.chunks(cols.max(1)).zip(grad_out.chunks(cols.max(1))) {
        let n = cols as f64;
        let r = 1.0 / (row.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / n + eps).sqrt();
        let w = |j: usize| weight.map_or(1.0, |w| w[j].to_f64());
        let gx: f64 = (0..cols).map(|j| dy[j].to_f64() * w(j) * row[j].to_f64()).sum();
        for j in 0..cols {
            dx.push(r * dy[j].to_f64() * w(j) - row[j].to_f64() * r.powi(3) * gx / n);
        }
        if let Some(dw) = dw.as_mut() {
            for j in 0..cols {
                dw[j] += dy[j].to_f64() * row[j].to_f64() * r;
            }
        }
    }
    (dx, dw)
}
