//! Layer normalisation over the last dimension.
//!
//! For a row `x` of `n` elements: `y = (x - mean) / sqrt(var + eps) * w + b`
//! with the biased variance, the same as
//! `torch.nn.functional.layer_norm(x, (n,), w, b, eps)`.
//!
//! - Shapes: `x`, `out`, `grad_*` (but `grad_weight`, `grad_bias`) hold
//!   `rows * cols` elements, row-major; `weight`, `bias` and their gradients
//!   hold `cols`. `rows` may be 0.
//! - Numerics: mean and variance in `T::Acc` from shifted sums, with an
//!   exact second pass when they would lose accuracy (see `moments`); one
//!   rounding to `T` at the end. A row whose variance overflows `T::Acc`
//!   (f32: values spread by about 1e19 or more) gives NaN, in the forward and
//!   the backward (see `inv_std`).
//! - The backward recomputes each row's mean and variance rather than taking
//!   them from the forward: a row is re-read from cache, and the op keeps the
//!   signature of torch's functional form.
//! - Parallelism: blocks of whole rows; the weight and bias gradients are
//!   summed per block and then over blocks in order (deterministic).
use crate::element::{Acc, Element};
use crate::error::{check_len, check_rows, Error, Result};
use crate::par::Par;
use crate::rows::{row_and_next, sum_partials, Blocks, Split};
use crate::simd::{dispatch, prefetching, reduce_lanes, sum_pairs, sums3, LANES};
use crate::wide::{cast, cast_mut};
use crate::widen;
#[cfg(target_arch = "x86_64")]
use half::bf16;
use half::f16;

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_backward;

const OP_FWD: &str = "layer_norm";
const OP_BWD: &str = "layer_norm_backward";

/// Checks the lengths of a forward call against `cols`, and `eps`; returns
/// the number of rows. Shared by the CPU kernel and the CUDA entry points.
pub fn check_forward(
    x: usize,
    weight: Option<usize>,
    bias: Option<usize>,
    out: usize,
    cols: usize,
    eps: f64,
) -> Result<usize> {
    let rows = check_rows(OP_FWD, x, cols, eps)?;
    check_len(OP_FWD, "out", out, x)?;
    check_params(OP_FWD, weight, bias, cols)?;
    Ok(rows)
}

fn check_params(op: &'static str, weight: Option<usize>, bias: Option<usize>, cols: usize) -> Result<()> {
    if let Some(w) = weight {
        check_len(op, "weight", w, cols)?;
    }
    if let Some(b) = bias {
        check_len(op, "bias", b, cols)?;
    }
    Ok(())
}

/// Checks the lengths of a backward call, as [`check_forward`]. A gradient
/// of `weight` or `bias` may be asked for only when that parameter is given.
#[allow(clippy::too_many_arguments)]
pub fn check_backward(
    grad_out: usize,
    x: usize,
    weight: Option<usize>,
    bias: Option<usize>,
    grad_input: usize,
    grad_weight: Option<usize>,
    grad_bias: Option<usize>,
    cols: usize,
    eps: f64,
) -> Result<usize> {
    let rows = check_rows(OP_BWD, x, cols, eps)?;
    check_len(OP_BWD, "grad_out", grad_out, x)?;
    check_len(OP_BWD, "grad_input", grad_input, x)?;
    check_params(OP_BWD, weight, bias, cols)?;
    for (arg, grad, param) in [("grad_weight", grad_weight, weight), ("grad_bias", grad_bias, bias)] {
        match (grad, param) {
            (Some(g), Some(_)) => check_len(OP_BWD, arg, g, cols)?,
            (Some(_), None) => {
                return Err(Error::Shape { op: OP_BWD, arg, msg: "given but its parameter is None".into() })
            }
            _ => {}
        }
    }
    Ok(rows)
}

/// Forward: writes `layer_norm(x) * weight + bias` to `out`.
///
/// Errors if a length does not match `cols`, or `eps` is negative or not finite.
pub fn forward<T: Element>(
    x: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    out: &mut [T],
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_forward(x.len(), weight.map(<[T]>::len), bias.map(<[T]>::len), out.len(), cols, eps)?;
    if rows == 0 {
        return Ok(());
    }
    let eps = T::Acc::from_f64(eps);
    let blocks = Blocks::new(&par, rows, cols);
    let ys = Split::new(out, blocks.per * cols);
    par.for_each(blocks.count, &|b| {
        let (mut y, order) = ys.get_ordered(b);
        let x = &x[blocks.rows(b).start * cols..][..y.len()];
        #[cfg(target_arch = "x86_64")]
        if crate::wide::has_lanes::<T>() {
            let k = x86::Forward { x, w: weight, b: bias, y: &mut y, cols, eps: eps.to_f64() as f32, order };
            if crate::wide::x86::run(k).is_some() {
                return;
            }
        }
        let _ = order; // the lane loop goes in ascending order
        dispatch(
            #[inline(always)]
            || {
                for (x, y) in x.chunks_exact(cols).zip(y.chunks_exact_mut(cols)) {
                    forward_row(x, weight, bias, y, eps);
                }
            },
        );
    });
    Ok(())
}

/// Backward: from `grad_out` and the forward's `x`, `weight`, `bias`, writes
/// `grad_input` and (when given) `grad_weight` and `grad_bias`.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
    grad_out: &[T],
    x: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    grad_input: &mut [T],
    grad_weight: Option<&mut [T]>,
    grad_bias: Option<&mut [T]>,
    cols: usize,
    eps: f64,
    par: Par<'_>,
) -> Result<()> {
    let rows = check_backward(
        grad_out.len(),
        x.len(),
        weight.map(<[T]>::len),
        bias.map(<[T]>::len),
        grad_input.len(),
        grad_weight.as_deref().map(<[T]>::len),
        grad_bias.as_deref().map(<[T]>::len),
        cols,
        eps,
    )?;
    let eps = T::Acc::from_f64(eps);
    let blocks = Blocks::new(&par, rows, cols);
    let (want_dw, want_db) = (grad_weight.is_some(), grad_bias.is_some());
    let wide = std::mem::size_of::<T>() == std::mem::size_of::<T::Acc>();
    let mut dw_part = vec![T::Acc::ZERO; if want_dw { blocks.count * cols } else { 0 }];
    let mut db_part = vec![T::Acc::ZERO; if want_db { blocks.count * cols } else { 0 }];
    {
        let dxs = Split::new(grad_input, blocks.per * cols);
        let (dws, dbs) = (Split::new(&mut dw_part, cols), Split::new(&mut db_part, cols));
        par.for_each(blocks.count, &|b| {
            let mut dx = dxs.get(b);
            let mut dw = want_dw.then(|| dws.get(b));
            let mut db = want_db.then(|| dbs.get(b));
            let at = blocks.rows(b).start * cols;
            let (x, dy) = (&x[at..][..dx.len()], &grad_out[at..][..dx.len()]);
            // f32, bf16 and f16 with every gradient (training): two rows
            // at a time.
            #[cfg(target_arch = "x86_64")]
            if let (true, Some(w), Some(dw), Some(db)) = (cols > 0, weight, &mut dw, &mut db) {
                let (ins, eps) = ((x, dy, w), eps.to_f64() as f32);
                if grouped::<T, f32>(ins, (&mut dx, dw, db), cols, eps)
                    || grouped::<T, bf16>(ins, (&mut dx, dw, db), cols, eps)
                    || grouped::<T, f16>(ins, (&mut dx, dw, db), cols, eps)
                {
                    return;
                }
            }
            dispatch(
                #[inline(always)]
                || {
                    if widen::applies::<T>() {
                        let dx = cast_mut::<T, f16>(&mut dx).expect("layer_norm: widen applies to f16 only");
                        let e = "f16's Acc is f32";
                        let dw = dw.as_deref_mut().map(|d| cast_mut::<T::Acc, f32>(&mut d[..]).expect(e));
                        let db = db.as_deref_mut().map(|d| cast_mut::<T::Acc, f32>(&mut d[..]).expect(e));
                        let (x, dy, weight) = (cast::<T, f16>(x), cast::<T, f16>(dy), weight.map(cast::<T, f16>));
                        return backward_rows_f16(x, dy, weight, dx, (dw, db), eps.to_f64() as f32, cols);
                    }
                    for (r, dx) in dx.chunks_exact_mut(cols).enumerate() {
                        let ((x, x_next), (dy, dy_next)) = (row_and_next(x, r, cols), row_and_next(dy, r, cols));
                        let (dw, db) = (dw.as_deref_mut().map(|d| &mut d[..]), db.as_deref_mut().map(|d| &mut d[..]));
                        // Prefetching the next rows pays where the pass waits
                        // on memory: f32 4096x4096 9.7 -> 8.4 ms (criterion,
                        // AVX2 CPU). The f16 and bf16 lane loops are bound by
                        // their conversions: bf16 the same, f16 5% slower.
                        let ahead = if wide { Some([x_next, dy_next]) } else { None };
                        backward_row(x, dy, weight, dx, dw, db, eps, ahead);
                    }
                },
            );
        });
    }
    if let Some(gw) = grad_weight {
        sum_partials(&dw_part, gw, cols);
    }
    if let Some(gb) = grad_bias {
        sum_partials(&db_part, gb, cols);
    }
    Ok(())
}

/// The training case's rows through `x86_backward` when `T` is `U` (f32,
/// bf16 or f16) and the CPU has AVX2 or AVX-512; false, computing nothing,
/// otherwise.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn grouped<T: Element, U: Element<Acc = f32>>(
    (x, dy, w): (&[T], &[T], &[T]),
    (dx, dw, db): (&mut [T], &mut [T::Acc], &mut [T::Acc]),
    cols: usize,
    eps: f32,
) -> bool {
    let (Some(dx), Some(dw), Some(db)) =
        (cast_mut::<T, U>(dx), cast_mut::<T::Acc, f32>(dw), cast_mut::<T::Acc, f32>(db))
    else {
        return false;
    };
    let (x, dy, w) = (cast::<T, U>(x), cast::<T, U>(dy), cast::<T, U>(w));
    crate::wide::x86::run(x86_backward::Backward { x, dy, w, dx, dw, db, cols, eps }).is_some()
}

/// The backward's rows for f16 where [`widen`] applies: each row's `x` and
/// `dy` widened to f32 first (the weight once), then [`backward_row`] with
/// f32 inputs and f16 outputs: the f16 loop's values, bit for bit (measured,
/// criterion 4096x4096 on an AVX2 CPU: see `widen.rs`).
#[inline(always)]
fn backward_rows_f16(
    x: &[f16],
    dy: &[f16],
    weight: Option<&[f16]>,
    dx: &mut [f16],
    (mut dw, mut db): (Option<&mut [f32]>, Option<&mut [f32]>),
    eps: f32,
    cols: usize,
) {
    let mut bufs: [Vec<f32>; 3] = Default::default();
    let [xs, dys, ws] = &mut bufs;
    let widened = "layer_norm: widen applies";
    let weight = weight.map(|w| widen::to_f32(w, ws).expect(widened));
    for (r, dx) in dx.chunks_exact_mut(cols).enumerate() {
        let (x, dy) = (&x[r * cols..][..cols], &dy[r * cols..][..cols]);
        let (x, dy) = (widen::to_f32(x, xs).expect(widened), widen::to_f32(dy, dys).expect(widened));
        backward_row(x, dy, weight, dx, dw.as_deref_mut(), db.as_deref_mut(), eps, None);
    }
}

/// The moments of a row: `mean = k + m1` kept as a shift `k` (close to the
/// row's values, so `x - k` is exact) and a small correction `m1`, and
/// `rstd = 1 / sqrt(var + eps)`. Normalising as `((x - k) - m1) * rstd` keeps
/// full accuracy for rows whose mean is large against their spread, where
/// `x - mean` with `mean` rounded to f32 would not.
#[derive(Clone, Copy)]
struct Moments<A> {
    k: A,
    m1: A,
    rstd: A,
}

impl<A: Acc> Moments<A> {
    /// `(x - mean) * rstd`.
    #[inline(always)]
    fn xh(&self, x: A) -> A {
        (x - self.k - self.m1) * self.rstd
    }
}

/// One pass of shifted sums `S1 = sum(x - k)`, `S2 = sum((x - k)^2)` with
/// `k` from the first 16 elements ([`shift`]: 0 or their mean), and `var = S2/n - (S1/n)^2`. That
/// subtraction loses accuracy only when `(S1/n)^2` is close to `S2/n` (the
/// shift far from the mean, relative to the spread); when it is more than
/// half of it, the variance is recomputed exactly in a second pass. So the
/// result is as accurate as two passes, and typical rows are read once
/// (measured: f32 layer_norm 4096x4096 forward 3.96 ms with two passes, 2.57
/// ms with this).
#[inline(always)]
fn moments<T: Element>(x: &[T], eps: T::Acc) -> Moments<T::Acc> {
    let n = T::Acc::from_usize(x.len());
    let k = shift(x);
    let (s1, s2) = shifted_sums(x, k);
    let (m1, m2) = (s1 / n, s2 / n);
    let var = if m1 * m1 <= T::Acc::from_f64(0.5) * m2 {
        m2 - m1 * m1
    } else {
        sum_pairs(x, x, |a, _| (a - k - m1) * (a - k - m1)) / n
    };
    Moments { k, m1, rstd: inv_std(var, eps) }
}

/// `rstd = 1 / sqrt(var + eps)`, or NaN where `var` overflowed the
/// accumulator (f32: a row spread by about 1e19 or more). Such a row has no
/// normalisation in f32; `1 / sqrt(inf) = 0` would write zeros, a silent wrong
/// answer, where NaN says so. (torch 2.15's CPU layer_norm gives NaN for
/// such rows at some widths, 4 to 32 and 4096 measured, and zeros at others,
/// 300.)
#[inline(always)]
pub(crate) fn inv_std<A: Acc>(var: A, eps: A) -> A {
    if var == A::from_f64(f64::INFINITY) {
        A::from_f64(f64::NAN)
    } else {
        A::ONE / (var + eps).sqrt()
    }
}

/// The shift `k` of [`moments`]: 0 where the row's first 16 elements put
/// its mean close to 0 against its spread (their mean squared at most a
/// quarter of their mean square, which is finite), else their mean.
///
/// A row centred near 0 (as a network's activations are) gains nothing from
/// a shift: its sums lose nothing unshifted, and `x - 0` is `x`, so the
/// explicit kernels leave the subtraction out of both passes. Measured on
/// the AVX-512 Xeon, 4096x4096 forward, two threads, against the head's
/// mean as the shift (interleaved in one process): bf16 6-14% faster into
/// reused outputs and 2-5% into fresh huge pages, f32 3-9%. A
/// row far from 0 against its spread keeps the shift that makes its sums
/// exact in one pass; where the head misleads, `moments`' test sends the
/// row to the exact second pass, as for a poor shift.
#[inline(always)]
fn shift<T: Element>(x: &[T]) -> T::Acc {
    let head = &x[..x.len().min(16)];
    let (s1, s2) = head.iter().fold((T::Acc::ZERO, T::Acc::ZERO), |(s1, s2), v| {
        let v = v.to_acc();
        (s1 + v, s2 + v * v)
    });
    let n = T::Acc::from_usize(head.len());
    let (m1, m2) = (s1 / n, s2 / n);
    let centred = m1 * m1 <= T::Acc::from_f64(0.25) * m2 && m2 < T::Acc::from_f64(f64::INFINITY);
    if centred {
        T::Acc::ZERO
    } else {
        m1
    }
}

/// `(sum(x - k), sum((x - k)^2))` with independent accumulators.
// Indexed loops over fixed-width lane arrays are what vectorises here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn shifted_sums<T: Element>(x: &[T], k: T::Acc) -> (T::Acc, T::Acc) {
    const L: usize = LANES;
    let (mut a1, mut a2) = ([T::Acc::ZERO; L], [T::Acc::ZERO; L]);
    let chunks = x.chunks_exact(L);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..L {
            let v = c[i].to_acc() - k;
            a1[i] = a1[i] + v;
            a2[i] = a2[i] + v * v;
        }
    }
    let (mut s1, mut s2) = (T::Acc::ZERO, T::Acc::ZERO);
    for v in rest {
        let v = v.to_acc() - k;
        s1 = s1 + v;
        s2 = s2 + v * v;
    }
    (reduce_lanes(a1) + s1, reduce_lanes(a2) + s2)
}

#[inline(always)]
fn forward_row<T: Element>(x: &[T], weight: Option<&[T]>, bias: Option<&[T]>, y: &mut [T], eps: T::Acc) {
    let m = moments(x, eps);
    match (weight, bias) {
        (Some(w), Some(b)) => {
            // `((x - k) rstd - m1 rstd) w + b` in two fused multiply-adds:
            // three operations per value where `xh` then `* w + b` took five.
            // `x - k` is exact and `m1 rstd` small, as in `xh`.
            let nb = T::Acc::ZERO - m.m1 * m.rstd;
            T::write_acc(
                y,
                #[inline(always)]
                |at, y| {
                    let (x, w, b) = (&x[at..][..y.len()], &w[at..][..y.len()], &b[at..][..y.len()]);
                    for ((y, x), (w, b)) in y.iter_mut().zip(x).zip(w.iter().zip(b)) {
                        *y = (x.to_acc() - m.k).mul_add(m.rstd, nb).mul_add(w.to_acc(), b.to_acc());
                    }
                },
            )
        }
        (Some(w), None) => T::write_acc(
            y,
            #[inline(always)]
            |at, y| {
                let (x, w) = (&x[at..][..y.len()], &w[at..][..y.len()]);
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = m.xh(x.to_acc()) * w.to_acc();
                }
            },
        ),
        (None, Some(b)) => T::write_acc(
            y,
            #[inline(always)]
            |at, y| {
                let (x, b) = (&x[at..][..y.len()], &b[at..][..y.len()]);
                for ((y, x), b) in y.iter_mut().zip(x).zip(b) {
                    *y = m.xh(x.to_acc()) + b.to_acc();
                }
            },
        ),
        (None, None) => T::write_acc(
            y,
            #[inline(always)]
            |at, y| {
                let x = &x[at..][..y.len()];
                for (y, x) in y.iter_mut().zip(x) {
                    *y = m.xh(x.to_acc());
                }
            },
        ),
    }
}

/// With `xh = (x - mean) * rstd` and `g = dy * w`:
/// `dx = rstd * (g - mean(g) - xh * mean(g * xh))`, `dw += dy * xh`, `db += dy`;
/// `ahead` (when given) is the next row of `x` and `dy`, prefetched as `dx`
/// is written.
///
/// The inputs are `I`, the output `O`: the same type, or f32 inputs widened
/// from an f16 row for f16 outputs (see [`backward_rows_f16`]). Which path
/// runs is `O`'s choice, so the values are the same either way.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_row<I: Element, O: Element<Acc = I::Acc>>(
    x: &[I],
    dy: &[I],
    weight: Option<&[I]>,
    dx: &mut [O],
    dw: Option<&mut [I::Acc]>,
    db: Option<&mut [I::Acc]>,
    eps: I::Acc,
    ahead: Option<[&[O]; 2]>,
) {
    let narrow = std::mem::size_of::<O>() < std::mem::size_of::<O::Acc>();
    let (m, g) = row_consts(x, dy, weight, eps, narrow, |k| lane_sums(x, dy, weight, k));
    let (mut dw, mut db) = (dw, db);
    // `dx` is computed in `T::Acc` and narrowed in blocks by `T::write_acc`
    // (F16C for f16: one value at a time took f16 2.3x bf16's time), but
    // for bf16, whose rounding LLVM fuses into the loop: through blocks it
    // was 24% slower (criterion 4096x4096: 7.3 -> 9.1 ms).
    let bf16 = crate::wide::is::<O, half::bf16>();
    let id = |v: I::Acc| v;
    let Some(ahead) = ahead else {
        if bf16 {
            return grad_block(0, x, dy, weight, dx, (&mut dw, &mut db), m, g, O::from_acc);
        }
        return O::write_acc(
            dx,
            #[inline(always)]
            |at, dx| grad_block(at, x, dy, weight, dx, (&mut dw, &mut db), m, g, id),
        );
    };
    // Written part by part, prefetching the next row for the sums above
    // (f32 and f64 only: the caller passes `ahead` for them).
    prefetching(
        dx,
        &ahead,
        #[inline(always)]
        |k, dx| {
            O::write_acc(
                dx,
                #[inline(always)]
                |at, dx| grad_block(k + at, x, dy, weight, dx, (&mut dw, &mut db), m, g, id),
            )
        },
    );
}

/// A row's moments and gradient means `(mean(g), mean(g xh))` as the
/// backward uses them: for a `narrow` output (bf16, f16), from one pass where
/// the shift is good; otherwise from [`grad_means`]'s separate passes.
/// [`backward_row`] and the grouped rows of `x86_backward` both take them
/// from here, so their `dx`, `dw` and `db` are the same bits.
///
/// `sums` gives the one pass's `[sum(x - k), sum((x - k)^2), sum(g), sum(g
/// (x - k))]` for the shift `k`: [`lane_sums`], or the same bits in explicit
/// SIMD (`x86_backward`'s f16 rows).
#[inline(always)]
fn row_consts<I: Element>(
    x: &[I],
    dy: &[I],
    weight: Option<&[I]>,
    eps: I::Acc,
    narrow: bool,
    sums: impl FnOnce(I::Acc) -> [I::Acc; 4],
) -> (Moments<I::Acc>, GradMeans<I::Acc>) {
    let n = I::Acc::from_usize(x.len());
    // bf16 and f16: one pass for the moments and the two gradient sums. With
    // the shift k, sum(g xh) = rstd (sum(g (x - k)) - m1 sum(g)), which loses
    // at most about a bit where the shift is good (m1^2 <= m2 / 2, the test of
    // `moments`); elsewhere `moments` takes its exact path and the sums get a
    // pass of their own. Measured, 4096x4096: the bf16 and f16 backwards
    // 12-17% faster (x is widened once, not twice); f32 no faster (bound by
    // memory, the same either way) and up to 7% slower, so f32 and f64 keep
    // the separate moments pass.
    let fused = if narrow {
        let k = shift(x);
        let [s1, s2, sg, sgx] = sums(k);
        let (m1, m2) = (s1 / n, s2 / n);
        (m1 * m1 <= I::Acc::from_f64(0.5) * m2).then(|| {
            let rstd = inv_std(m2 - m1 * m1, eps);
            (Moments { k, m1, rstd }, sg, rstd * (sgx - m1 * sg))
        })
    } else {
        None
    };
    match fused {
        Some((m, sum_g, sum_gxh)) => (m, (sum_g / n, sum_gxh / n)),
        None => grad_means(x, dy, weight, eps),
    }
}

/// The one-pass sums of [`row_consts`] for the shift `k`, in the lane loop.
#[inline(always)]
fn lane_sums<T: Element>(x: &[T], dy: &[T], weight: Option<&[T]>, k: T::Acc) -> [T::Acc; 4] {
    match weight {
        Some(w) => shifted_grad_sums(x, dy, w, k, |d, w| d * w),
        None => shifted_grad_sums(x, dy, dy, k, |d, _| d),
    }
}

/// [`moment_grad_sums`] for the shift `k`: without the subtraction where
/// `k` is 0 (see [`shift`]).
#[inline(always)]
fn shifted_grad_sums<T: Element>(
    x: &[T],
    dy: &[T],
    w: &[T],
    k: T::Acc,
    g: impl Fn(T::Acc, T::Acc) -> T::Acc,
) -> [T::Acc; 4] {
    if k == T::Acc::ZERO {
        moment_grad_sums::<T, false>(x, dy, w, k, g)
    } else {
        moment_grad_sums::<T, true>(x, dy, w, k, g)
    }
}

/// `(mean(g), mean(g xh))` of a row.
type GradMeans<A> = (A, A);

/// A row's moments and gradient means `(mean(g), mean(g xh))` with `g = dy w`
/// (`g = dy` without a weight), each from a pass of its own: the f32 and f64
/// path of [`row_consts`], and its fallback for the others.
#[inline(always)]
fn grad_means<T: Element>(
    x: &[T],
    dy: &[T],
    weight: Option<&[T]>,
    eps: T::Acc,
) -> (Moments<T::Acc>, GradMeans<T::Acc>) {
    let n = T::Acc::from_usize(x.len());
    let m = moments(x, eps);
    let (sum_g, sum_gxh) = match weight {
        Some(w) => weighted_sums(dy, w, x, m),
        None => (sum_pairs(dy, dy, |d, _| d), sum_pairs(dy, x, |d, x| d * m.xh(x))),
    };
    (m, (sum_g / n, sum_gxh / n))
}

/// A row's `dw` and `db` (each when asked for), lent to each block.
type ParamGrads<'a, 'b, A> = (&'a mut Option<&'b mut [A]>, &'a mut Option<&'b mut [A]>);

/// [`grad_part`] for `dx` holding the row's values from `at` on, with the
/// row's `dw` and `db`; `out` maps each value to `D` (see `backward_row`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn grad_block<T: Element, D>(
    at: usize,
    x: &[T],
    dy: &[T],
    weight: Option<&[T]>,
    dx: &mut [D],
    (dw, db): ParamGrads<'_, '_, T::Acc>,
    m: Moments<T::Acc>,
    g: (T::Acc, T::Acc),
    out: impl Fn(T::Acc) -> D,
) {
    let len = dx.len();
    let dw = dw.as_deref_mut().map(|d| &mut d[at..][..len]);
    let db = db.as_deref_mut().map(|d| &mut d[at..][..len]);
    let w = weight.map(|w| &w[at..][..len]);
    grad_part(&x[at..][..len], &dy[at..][..len], w, dx, dw, db, m, g, out);
}

/// `dx`, and `dw`, `db` when given, over one part of a row, from the row's
/// moments and gradient means `(mean(g), mean(g xh))`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn grad_part<T: Element, D>(
    x: &[T],
    dy: &[T],
    weight: Option<&[T]>,
    dx: &mut [D],
    dw: Option<&mut [T::Acc]>,
    db: Option<&mut [T::Acc]>,
    m: Moments<T::Acc>,
    (mg, mgx): (T::Acc, T::Acc),
    out: impl Fn(T::Acc) -> D,
) {
    let rstd = m.rstd;
    let (mut dw, mut db) = (dw, db);
    match weight {
        // The training case: dx, dw and db in one pass over dy and x.
        Some(w) if dw.is_some() && db.is_some() => {
            let (dw, db) = (dw.take().unwrap_or_default(), db.take().unwrap_or_default());
            for (((dx, x), (dy, w)), (dw, db)) in
                dx.iter_mut().zip(x).zip(dy.iter().zip(w)).zip(dw.iter_mut().zip(db.iter_mut()))
            {
                let (xh, dy) = (m.xh(x.to_acc()), dy.to_acc());
                *dx = out(rstd * (dy * w.to_acc() - mg - xh * mgx));
                *dw = *dw + dy * xh;
                *db = *db + dy;
            }
        }
        Some(w) => {
            for ((dx, x), (dy, w)) in dx.iter_mut().zip(x).zip(dy.iter().zip(w)) {
                let xh = m.xh(x.to_acc());
                *dx = out(rstd * (dy.to_acc() * w.to_acc() - mg - xh * mgx));
            }
        }
        None => {
            for ((dx, x), dy) in dx.iter_mut().zip(x).zip(dy) {
                let xh = m.xh(x.to_acc());
                *dx = out(rstd * (dy.to_acc() - mg - xh * mgx));
            }
        }
    }
    if let Some(dw) = dw {
        for ((dw, x), dy) in dw.iter_mut().zip(x).zip(dy) {
            *dw = *dw + dy.to_acc() * m.xh(x.to_acc());
        }
    }
    if let Some(db) = db {
        for (db, dy) in db.iter_mut().zip(dy) {
            *db = *db + dy.to_acc();
        }
    }
}

/// `[sum(x - k), sum((x - k)^2), sum(g), sum(g (x - k))]` with `g = g(dy, w)`,
/// in one pass with four named accumulator arrays (kept in registers);
/// `x - k` only where `SHIFTED` (`k` is 0 otherwise, and `x - 0` is `x`).
// Indexed loops over fixed-width lane arrays are what vectorises here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn moment_grad_sums<T: Element, const SHIFTED: bool>(
    x: &[T],
    dy: &[T],
    w: &[T],
    k: T::Acc,
    g: impl Fn(T::Acc, T::Acc) -> T::Acc,
) -> [T::Acc; 4] {
    const L: usize = LANES;
    let z = [T::Acc::ZERO; L];
    let (mut a1, mut a2, mut ag, mut agx) = (z, z, z, z);
    let (cx, cd, cw) = (x.chunks_exact(L), dy.chunks_exact(L), w.chunks_exact(L));
    let at = x.len() - cx.remainder().len();
    for ((cx, cd), cw) in cx.zip(cd).zip(cw) {
        for i in 0..L {
            let v = if SHIFTED { cx[i].to_acc() - k } else { cx[i].to_acc() };
            let gi = g(cd[i].to_acc(), cw[i].to_acc());
            a1[i] = a1[i] + v;
            a2[i] = a2[i] + v * v;
            ag[i] = ag[i] + gi;
            agx[i] = agx[i] + gi * v;
        }
    }
    let mut t = [T::Acc::ZERO; 4];
    for ((x, d), w) in x[at..].iter().zip(&dy[at..]).zip(&w[at..]) {
        let (v, gi) = (x.to_acc() - k, g(d.to_acc(), w.to_acc()));
        t = [t[0] + v, t[1] + v * v, t[2] + gi, t[3] + gi * v];
    }
    [reduce_lanes(a1) + t[0], reduce_lanes(a2) + t[1], reduce_lanes(ag) + t[2], reduce_lanes(agx) + t[3]]
}

/// `(sum(dy * w), sum(dy * w * xh))` in one pass, with independent accumulators.
#[inline(always)]
fn weighted_sums<T: Element>(dy: &[T], w: &[T], x: &[T], m: Moments<T::Acc>) -> (T::Acc, T::Acc) {
    sums3(dy, w, x, |dy, w, x| {
        let g = dy * w;
        (g, g * m.xh(x))
    })
}

/// Reference forward: plain loops in f64 from the given values.
pub fn forward_ref<T: Element>(x: &[T], weight: Option<&[T]>, bias: Option<&[T]>, cols: usize, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols.max(1)) {
        let n = cols as f64;
        let mean = row.iter().map(|v| v.to_f64()).sum::<f64>() / n;
        let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n;
        let rstd = 1.0 / (var + eps).sqrt();
        for (j, v) in row.iter().enumerate() {
            let y = (v.to_f64() - mean) * rstd * weight.map_or(1.0, |w| w[j].to_f64());
            out.push(y + bias.map_or(0.0, |b| b[j].to_f64()));
        }
    }
    out
}

/// Reference backward in f64: `(grad_input, grad_weight, grad_bias)`, the
/// last two `None` when their parameter is.
pub fn backward_ref<T: Element>(
    grad_out: &[T],
    x: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Option<Vec<f64>>, Option<Vec<f64>>) {
    let mut dx = Vec::with_capacity(x.len());
    let mut dw = weight.map(|_| vec![0.0f64; cols]);
    let mut db = bias.map(|_| vec![0.0f64; cols]);
    let w = |j: usize| weight.map_or(1.0, |w| w[j].to_f64());
    for (row, dy) in x.chunks(cols.max(1)).zip(grad_out.chunks(cols.max(1))) {
        let n = cols as f64;
        let mean = row.iter().map(|v| v.to_f64()).sum::<f64>() / n;
        let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n;
        let rstd = 1.0 / (var + eps).sqrt();
        let xh: Vec<f64> = row.iter().map(|v| (v.to_f64() - mean) * rstd).collect();
        let g: Vec<f64> = (0..cols).map(|j| dy[j].to_f64() * w(j)).collect();
        let mg = g.iter().sum::<f64>() / n;
        let mgx = g.iter().zip(&xh).map(|(g, x)| g * x).sum::<f64>() / n;
        for j in 0..cols {
            dx.push(rstd * (g[j] - mg - xh[j] * mgx));
        }
        for j in 0..cols {
            if let Some(dw) = dw.as_mut() {
                dw[j] += dy[j].to_f64() * xh[j];
            }
            if let Some(db) = db.as_mut() {
                db[j] += dy[j].to_f64();
            }
        }
    }
    (dx, dw, db)
}

#[cfg(test)]
mod tests {
    use super::{backward_row, backward_rows_f16, shift};
    use crate::simd::dispatch;
    use crate::widen::testing::{bits, runs, wave};
    use half::f16;

    /// The widened f16 backward against the plain f16 one, bit for bit
    /// (`dx`, `dw`, `db`), with and without weight and parameter gradients,
    /// on a row whose mean is far from its spread (the exact moments path)
    /// and ordinary ones (the fused one), with a part block and a
    /// subnormal.
    #[test]
    fn widened_f16_backward_is_the_plain_one() {
        if !runs() {
            return;
        }
        // Enough rows of irregular values that the two paths' different
        // gradient sums would show in some rounding.
        let (rows, cols) = (64, 300);
        let mut x = wave(rows * cols, 0.37);
        for v in &mut x[2 * cols..3 * cols] {
            *v = f16::from_f64(1000.0 + v.to_f64() / 64.0);
        }
        x[5] = f16::from_bits(0x0001);
        let (dy, w) = (wave(rows * cols, 0.91), wave(cols, 1.7));
        for (weight, grads) in [(Some(&w[..]), true), (Some(&w[..]), false), (None, false)] {
            let (mut got, mut want) = (vec![f16::ZERO; rows * cols], vec![f16::ZERO; rows * cols]);
            let mut p: [Vec<f32>; 4] = std::array::from_fn(|_| vec![0f32; cols]);
            let [dw_got, db_got, dw_want, db_want] = &mut p;
            dispatch(|| {
                let g = (grads.then_some(&mut dw_got[..]), grads.then_some(&mut db_got[..]));
                backward_rows_f16(&x, &dy, weight, &mut got, g, 1e-5, cols)
            });
            dispatch(|| {
                for r in 0..rows {
                    let (x, dy, dx) = (&x[r * cols..][..cols], &dy[r * cols..][..cols], &mut want[r * cols..][..cols]);
                    let (dw, db) = (grads.then_some(&mut dw_want[..]), grads.then_some(&mut db_want[..]));
                    backward_row(x, dy, weight, dx, dw, db, 1e-5f32, None);
                }
            });
            let bits32 = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let case = format!("weight {} grads {grads}", weight.is_some());
            assert_eq!(bits(&got), bits(&want), "{case}");
            assert_eq!((bits32(dw_got), bits32(db_got)), (bits32(dw_want), bits32(db_want)), "{case}");
        }
    }

    /// The shift is 0 for a head centred near 0 against its spread (its
    /// mean squared at most a quarter of its mean square), else the head's
    /// mean: off-centre heads, the boundary both ways, a short row, a head
    /// whose squares overflow (its mean kept, so the shifted sums stay
    /// finite), NaN. Only the first 16 values count.
    #[test]
    fn the_shift_is_zero_only_for_a_centred_head() {
        let alternating = |a: f32, b: f32| -> Vec<f32> { (0..40).map(|i| if i % 2 == 0 { a } else { b }).collect() };
        // Mean 0.05, mean square 0.905; mean 0.25, 0.965: centred.
        assert_eq!(shift(&alternating(1.0, -0.9)), 0.0);
        assert_eq!(shift(&alternating(1.2, -0.7)), 0.0);
        // Mean 0.65, mean square 1.325: 0.4225 > 0.33.
        assert!((shift(&alternating(1.6, -0.3)) - 0.65).abs() < 1e-6);
        // Four 2s in 16: mean 0.5, mean square 1, exactly the boundary
        // (centred); five: 0.390625 > 0.3125. Values after 16 do not count.
        let twos = |k: usize| -> Vec<f32> { (0..64).map(|i| if i < k || i >= 16 { 2.0 } else { 0.0 }).collect() };
        assert_eq!(shift(&twos(4)), 0.0);
        assert_eq!(shift(&twos(5)), 0.625);
        assert_eq!(shift(&[3.0f32, 3.0, 3.0]), 3.0);
        let huge = [1e20f32, 1.25e20, 0.75e20, 1e20];
        assert_eq!(shift(&huge), 1e20);
        assert!(shift(&[f32::NAN, 1.0]).is_nan());
    }
}
