//! Gated activations: `act(a) * b` for an input whose last dimension is
//! `[a | b]`, each half `d` wide (SwiGLU with `silu`, GeGLU with `gelu`).
//!
//! - Shapes: `input` and `grad_input` hold `rows * 2d` elements, `out` and
//!   `grad_out` hold `rows * d`. `rows` may be 0.
//! - Numerics: the activation and product in `T::Acc`, one rounding to `T`
//!   (torch rounds `act(a)` first, then the product). f32 uses the
//!   vectorised `exp`/`erf` of `math` (within 5e-7 absolute), the tanh
//!   gelu in its sigmoid form, `x sigmoid(2u)` (one division, not two).
//!   bf16 and f16 results take an `exp` within 3.2e-6, relative
//!   (`narrow`; `erf` is the same): 1/600 of bf16's rounding step, as
//!   torch's CPU kernels do for outputs "downcasted to FP16 / BF16"
//!   (`fexp_u20`). With THP a bf16 forward of `[4096, 8192]` is bound by
//!   this arithmetic on two AVX-512 cores (Zen 4); the narrow `exp` made
//!   silu's 1.11x and gelu tanh's 1.14x faster there, their forward and
//!   backward 1.08x and 1.12x (same process, alternated), and moved
//!   0.02% of the outputs by one unit in the last place.
//! - Backward: `grad_a = dy * b * act'(a)`, `grad_b = dy * act(a)`.
use crate::element::{Acc, Element};
use crate::error::{check_len, Error, Result};
use crate::par::Par;
use crate::rows::{Blocks, Split};
use crate::simd::dispatch;

#[cfg(target_arch = "x86_64")]
mod x86;

/// The activation applied to the first half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)` (SwiGLU).
    Silu,
    /// `x * Phi(x)`, the exact gelu (`approximate="none"`).
    Gelu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (`approximate="tanh"`).
    GeluTanh,
}

impl Activation {
    /// Short name (`"silu"`, `"gelu"`, `"gelu_tanh"`), as in kernel symbols.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
        }
    }

    /// The op this activation belongs to, for messages.
    pub fn op(self) -> &'static str {
        match self {
            Activation::Silu => "silu_and_mul",
            Activation::Gelu | Activation::GeluTanh => "gelu_and_mul",
        }
    }

    /// The gelu for torch's `approximate` argument: `"none"` or `"tanh"`.
    pub fn gelu(approximate: &str) -> Result<Activation> {
        match approximate {
            "none" => Ok(Activation::Gelu),
            "tanh" => Ok(Activation::GeluTanh),
            other => Err(Error::Shape {
                op: "gelu_and_mul",
                arg: "approximate",
                msg: format!("must be \"none\" or \"tanh\", got {other:?}"),
            }),
        }
    }

    /// The activation and its derivative at `x`, in f64 (for references).
    pub fn eval_ref(self, x: f64) -> (f64, f64) {
        match self {
            Activation::Silu => {
                let s = 1.0 / (1.0 + (-x).exp());
                (x * s, s * (1.0 + x * (1.0 - s)))
            }
            Activation::Gelu => {
                let cdf = 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (x * cdf, cdf + x * pdf)
            }
            Activation::GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                let t = (k * (x + 0.044715 * x * x * x)).tanh();
                (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x))
            }
        }
    }
}

/// One activation, monomorphised so each compiles to its own vector loop.
///
/// `narrow` (a constant where the kernels call these: [`narrow`] of the
/// element type) takes the `exp` for results rounded to 16 bits.
pub(crate) trait Act {
    /// Which activation this is (each has explicit SIMD in `gated/x86.rs`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const KIND: Activation;
    fn f<A: Acc>(x: A, narrow: bool) -> A;
    /// `(f(x), f'(x))`.
    fn f_df<A: Acc>(x: A, narrow: bool) -> (A, A);
}

/// Whether `T`'s results are rounded to 16 bits (bf16, f16): there the
/// activations take [`Acc::exp_narrow`] and [`Acc::exp_nonpos_narrow`]
/// (within 3.2e-6, relative), four and two vector instructions fewer per 16
/// values than the f32-accurate ones, in kernels bound by that arithmetic
/// on 16-bit data.
#[inline(always)]
pub(crate) fn narrow<T>() -> bool {
    std::mem::size_of::<T>() == 2
}

/// `e^x` for a sigmoid's `1 + e^x`: [`Acc::exp_narrow`] where `narrow`.
#[inline(always)]
fn exp_for<A: Acc>(x: A, narrow: bool) -> A {
    if narrow {
        x.exp_narrow()
    } else {
        x.exp()
    }
}

pub(crate) struct Silu;
pub(crate) struct Gelu;
pub(crate) struct GeluTanh;

impl Act for Silu {
    const KIND: Activation = Activation::Silu;
    #[inline(always)]
    fn f<A: Acc>(x: A, narrow: bool) -> A {
        x / (A::ONE + exp_for(A::ZERO - x, narrow))
    }
    #[inline(always)]
    fn f_df<A: Acc>(x: A, narrow: bool) -> (A, A) {
        let s = A::ONE / (A::ONE + exp_for(A::ZERO - x, narrow));
        (x * s, s * (A::ONE + x * (A::ONE - s)))
    }
}

const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// 1 / sqrt(2 pi)
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// 2 sqrt(2 / pi)
const SQRT_8_PI: f64 = 1.595_769_121_605_730_8;
const GELU_C: f64 = 0.044715;
/// Where gelu_tanh's sigmoid `s` is exactly 0 or 1 in f32 and in f64 (from
/// about |x| = 20), so that the derivative's term `x s (1 - s) v'` is 0. Its
/// `v' = k (1 + 3 c x^2)` (`k + 3 k c x^2`, one fused multiply-add) takes
/// `x` clamped to this: unclamped, `x^2` overflows from |x| = 1.8e19 in f32
/// and `0 * inf` gave NaN where the derivative is 1 (torch's CPU backward
/// has the same NaN from 3e19).
const GELU_TANH_SATURATED: f64 = 1e9;

impl Act for Gelu {
    const KIND: Activation = Activation::Gelu;
    #[inline(always)]
    /// `h + h erf(x / sqrt 2)` with `h = x / 2`, one fused multiply-add
    /// (exactly 0 where erf is -1).
    fn f<A: Acc>(x: A, _narrow: bool) -> A {
        let h = A::from_f64(0.5) * x;
        h.mul_add((x * A::from_f64(FRAC_1_SQRT_2)).erf(), h)
    }
    /// `cdf = 0.5 + 0.5 erf(x / sqrt 2)` (one fused multiply-add). The
    /// pdf's `e^(-x^2 / 2)` has an argument `<= 0` (or NaN): where
    /// `narrow`, [`Acc::exp_nonpos_narrow`], 0 where `exp` gives 0.
    #[inline(always)]
    fn f_df<A: Acc>(x: A, narrow: bool) -> (A, A) {
        let half = A::from_f64(0.5);
        let cdf = half.mul_add((x * A::from_f64(FRAC_1_SQRT_2)).erf(), half);
        let arg = A::ZERO - half * x * x;
        let e = if narrow { arg.exp_nonpos_narrow() } else { arg.exp() };
        let pdf = e * A::from_f64(FRAC_1_SQRT_2PI);
        (x * cdf, cdf + x * pdf)
    }
}

/// `gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x sigmoid(2u)`, where `u =
/// sqrt(2/pi) (x + 0.044715 x^3)`. The sigmoid form takes one division where
/// the tanh form takes two (divisions were most of its cost on an AVX2 CPU),
/// and has no cancellation in `1 + tanh(u)` for negative `x`. `-inf` gives
/// NaN, as the tanh form and torch do.
impl Act for GeluTanh {
    const KIND: Activation = Activation::GeluTanh;
    #[inline(always)]
    fn f<A: Acc>(x: A, narrow: bool) -> A {
        x / (A::ONE + exp_for(minus_v(x), narrow))
    }
    #[inline(always)]
    fn f_df<A: Acc>(x: A, narrow: bool) -> (A, A) {
        let k = A::from_f64(SQRT_8_PI);
        let s = A::ONE / (A::ONE + exp_for(minus_v(x), narrow));
        let lim = A::from_f64(GELU_TANH_SATURATED);
        let xc = if x > lim {
            lim
        } else if x < A::ZERO - lim {
            A::ZERO - lim
        } else {
            x
        };
        let dv = (xc * xc).mul_add(A::from_f64(3.0 * SQRT_8_PI * GELU_C), k);
        (x * s, s + x * s * (A::ONE - s) * dv)
    }
}

/// gelu_tanh's `-v = -k (x + c x^3)` as `x (-k - k c x^2)`: three operations
/// (a square, a fused multiply-add, a product), where the form as written
/// takes five and a negation. `x^2` overflowing (|x| > 1.8e19 in f32) gives
/// `-inf` times `x`, where the sigmoid is exactly 0 or 1 anyway.
#[inline(always)]
fn minus_v<A: Acc>(x: A) -> A {
    x * (x * x).mul_add(A::from_f64(-SQRT_8_PI * GELU_C), A::from_f64(-SQRT_8_PI))
}

/// Checks lengths: `input` is `rows * 2d`, `out` is `rows * d`; returns `rows`.
pub fn check(op: &'static str, input: usize, out_arg: &'static str, out: usize, d: usize) -> Result<usize> {
    if d == 0 {
        return if input == 0 && out == 0 {
            Ok(0)
        } else {
            Err(Error::Shape { op, arg: "d", msg: "is 0 but the input is not empty".into() })
        };
    }
    if !input.is_multiple_of(2 * d) {
        return Err(Error::Shape {
            op,
            arg: "input",
            msg: format!("length {input} is not a multiple of 2d = {}", 2 * d),
        });
    }
    let rows = input / (2 * d);
    check_len(op, out_arg, out, rows * d)?;
    Ok(rows)
}

/// Forward: `out[r, j] = act(input[r, j]) * input[r, d + j]`.
pub fn forward<T: Element>(act: Activation, input: &[T], out: &mut [T], d: usize, par: Par<'_>) -> Result<()> {
    let rows = check(act.op(), input.len(), "out", out.len(), d)?;
    match act {
        Activation::Silu => forward_with::<Silu, T>(input, out, rows, d, par),
        Activation::Gelu => forward_with::<Gelu, T>(input, out, rows, d, par),
        Activation::GeluTanh => forward_with::<GeluTanh, T>(input, out, rows, d, par),
    }
    Ok(())
}

/// Backward: `grad_input = [grad_out * b * act'(a) | grad_out * act(a)]`.
pub fn backward<T: Element>(
    act: Activation,
    grad_out: &[T],
    input: &[T],
    grad_input: &mut [T],
    d: usize,
    par: Par<'_>,
) -> Result<()> {
    let rows = check(act.op(), input.len(), "grad_out", grad_out.len(), d)?;
    check_len(act.op(), "grad_input", grad_input.len(), input.len())?;
    match act {
        Activation::Silu => backward_with::<Silu, T>(grad_out, input, grad_input, rows, d, par),
        Activation::Gelu => backward_with::<Gelu, T>(grad_out, input, grad_input, rows, d, par),
        Activation::GeluTanh => backward_with::<GeluTanh, T>(grad_out, input, grad_input, rows, d, par),
    }
    Ok(())
}

fn forward_with<F: Act, T: Element>(input: &[T], out: &mut [T], rows: usize, d: usize, par: Par<'_>) {
    if rows == 0 {
        return;
    }
    let blocks = Blocks::new(&par, rows, 2 * d);
    let ys = Split::new(out, blocks.per * d);
    par.for_each(blocks.count, &|b| {
        let (mut y, order) = ys.get_ordered(b);
        let x = &input[blocks.rows(b).start * 2 * d..][..2 * y.len()];
        #[cfg(target_arch = "x86_64")]
        if x86::forward::<F, T>(x, &mut y, d, order) {
            return;
        }
        let _ = order; // the lane loop goes in ascending order
        dispatch(
            #[inline(always)]
            || {
                for (x, y) in x.chunks_exact(2 * d).zip(y.chunks_exact_mut(d)) {
                    let (a, g) = x.split_at(d);
                    T::write_acc(
                        y,
                        #[inline(always)]
                        |at, y| {
                            let (a, g) = (&a[at..][..y.len()], &g[at..][..y.len()]);
                            for ((y, a), g) in y.iter_mut().zip(a).zip(g) {
                                *y = F::f(a.to_acc(), narrow::<T>()) * g.to_acc();
                            }
                        },
                    );
                }
            },
        );
    });
}

fn backward_with<F: Act, T: Element>(
    grad_out: &[T],
    input: &[T],
    grad_input: &mut [T],
    rows: usize,
    d: usize,
    par: Par<'_>,
) {
    if rows == 0 {
        return;
    }
    let blocks = Blocks::new(&par, rows, 2 * d);
    let dxs = Split::new(grad_input, blocks.per * 2 * d);
    par.for_each(blocks.count, &|b| {
        let (mut dx, order) = dxs.get_ordered(b);
        let start = blocks.rows(b).start;
        let x = &input[start * 2 * d..][..dx.len()];
        let dy = &grad_out[start * d..][..dx.len() / 2];
        #[cfg(target_arch = "x86_64")]
        if x86::backward::<F, T>(x, dy, &mut dx, d, order) {
            return;
        }
        let _ = order; // the lane loop goes in ascending order
        dispatch(
            #[inline(always)]
            || {
                for ((x, dy), dx) in x.chunks_exact(2 * d).zip(dy.chunks_exact(d)).zip(dx.chunks_exact_mut(2 * d)) {
                    let (a, g) = x.split_at(d);
                    let (da, dg) = dx.split_at_mut(d);
                    backward_row::<F, T>(a, g, dy, da, dg);
                }
            },
        );
    });
}

/// One row of the backward, in chunks computed into local arrays: with five
/// slices in one loop the compiler gave up on vectorising the f32 version
/// (measured 1.35 ns per element, 10x the bf16 one); locals cannot alias.
#[inline(always)]
fn backward_row<F: Act, T: Element>(a: &[T], g: &[T], dy: &[T], da: &mut [T], dg: &mut [T]) {
    const CHUNK: usize = 64;
    let mut start = 0;
    while start < a.len() {
        let len = CHUNK.min(a.len() - start);
        let (mut ta, mut tg) = ([T::Acc::ZERO; CHUNK], [T::Acc::ZERO; CHUNK]);
        let (a, g, dy) = (&a[start..start + len], &g[start..start + len], &dy[start..start + len]);
        for (((ta, tg), (a, g)), dy) in ta.iter_mut().zip(tg.iter_mut()).zip(a.iter().zip(g)).zip(dy) {
            let (f, df) = F::f_df(a.to_acc(), narrow::<T>());
            let dy = dy.to_acc();
            *ta = dy * g.to_acc() * df;
            *tg = dy * f;
        }
        T::from_acc_slice(&ta[..len], &mut da[start..start + len]);
        T::from_acc_slice(&tg[..len], &mut dg[start..start + len]);
        start += len;
    }
}

/// Reference forward in f64.
pub fn forward_ref<T: Element>(act: Activation, input: &[T], d: usize) -> Vec<f64> {
    input
        .chunks(2 * d.max(1))
        .flat_map(|row| {
            let (a, g) = row.split_at(d);
            a.iter().zip(g).map(move |(a, g)| act.eval_ref(a.to_f64()).0 * g.to_f64())
        })
        .collect()
}

/// Reference backward in f64: `grad_input`.
pub fn backward_ref<T: Element>(act: Activation, grad_out: &[T], input: &[T], d: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(input.len());
    for (row, dy) in input.chunks(2 * d.max(1)).zip(grad_out.chunks(d.max(1))) {
        let (a, g) = row.split_at(d);
        let e: Vec<(f64, f64)> = a.iter().map(|a| act.eval_ref(a.to_f64())).collect();
        out.extend(e.iter().zip(g).zip(dy).map(|((e, g), dy)| dy.to_f64() * g.to_f64() * e.1));
        out.extend(e.iter().zip(dy).map(|(e, dy)| dy.to_f64() * e.0));
    }
    out
}
