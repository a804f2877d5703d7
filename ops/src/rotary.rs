//! `keel::rotary_embedding` and `keel::rotary_embedding_backward`.
//!
//! `rotary_embedding(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor`
//! for `x[batch, seq, heads, head_dim]`, `cos`/`sin[seq, rotary_dim / 2]`.
//! `rotary_embedding_backward(grad_out, cos, sin, interleaved) -> grad_x`: the
//! rotation by the opposite angle.
//!
//! `x` (and `grad_out`) may have any strides whose last one is 1: it is read
//! in place (q and k sliced from a fused qkv projection, or a
//! `[batch, heads, seq, head_dim]` tensor transposed to this layout). The
//! output is contiguous.
//!
//! `rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False) -> ()`
//! rotates `x` in place, through the same strides (vLLM's form); its heads
//! must not overlap, nor `x` `cos` or `sin`. An `x` whose last dim is strided
//! is rotated in a contiguous copy and written back.
use crate::checks::{self, invalid, with_float_type, Rows};
use crate::device::{check_err, kernel_err, ptr, CudaCall};
use crate::torch_pool::with_torch_par;
use keel::ops::rotary::{Shape, Strides};
use keel_abi::{BoxedOp, DeviceType, Result, Tensor};

/// The checked `x` (each head contiguous), `cos` and `sin` (contiguous),
/// what the checks found, the shape and `x`'s strides.
type Checked = (Tensor, Tensor, Tensor, Rows, Shape, Strides);

/// Checks `x` (4-D) and `cos`, `sin` against it. An `x` whose heads are not
/// contiguous, and a strided `cos` or `sin`, is copied to a contiguous tensor
/// ([`checks::dense`]; the in-place op hands over its own copy of such an `x`,
/// made by [`checks::written`], to write back).
fn check(op: &str, arg: &'static str, x: Tensor, cos: Tensor, sin: Tensor) -> Result<Checked> {
    let c = checks::strided_rows_of(op, arg, &x)?;
    let &[batch, seq, heads, head_dim] = x.sizes()? else {
        let s = x.sizes()?;
        return Err(invalid(op, arg, format!("must have 4 dims [batch, seq, heads, head_dim], got shape {s:?}")));
    };
    for (name, t) in [("cos", &cos), ("sin", &sin)] {
        checks::same_device(op, name, t, arg, c.device)?;
        checks::same_dtype(op, name, t, arg, c.dtype)?;
        let ts = t.sizes()?;
        if ts.len() != 2 || ts[0] != seq {
            return Err(invalid(
                op,
                name,
                format!("must have shape [seq, rotary_dim / 2] with seq = {seq}, got {ts:?}"),
            ));
        }
        if 2 * ts[1] > head_dim {
            let msg = format!("gives rotary_dim = {} (2 x its last dim), more than head_dim = {head_dim}", 2 * ts[1]);
            return Err(invalid(op, name, msg));
        }
    }
    if cos.sizes()? != sin.sizes()? {
        return Err(invalid(op, "sin", format!("has shape {:?} but 'cos' has {:?}", sin.sizes()?, cos.sizes()?)));
    }
    let rotary_dim = 2 * cos.sizes()?[1] as usize;
    let (batch, seq, heads, head_dim) = (batch as usize, seq as usize, heads as usize, head_dim as usize);
    let x = if checks::rows_read_in_place(x.strides()?, head_dim) { x } else { checks::dense(op, arg, x)? };
    let st = x.strides()?;
    let strides = Strides { batch: st[0] as usize, seq: st[1] as usize, heads: st[2] as usize };
    let (cos, sin) = (checks::dense(op, "cos", cos)?, checks::dense(op, "sin", sin)?);
    Ok((x, cos, sin, c, Shape { batch, seq, heads, head_dim, rotary_dim }, strides))
}

fn run(op: &str, arg: &'static str, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Result<(Tensor,)> {
    let (x, cos, sin, c, shape, strides) = check(op, arg, x, cos, sin)?;
    let inverse = op.ends_with("_backward");
    let out = c.empty_like(&x)?;
    match c.device.kind {
        DeviceType::Cpu => with_float_type!(c.dtype, T => {
            // SAFETY: checked CPU tensors of element type T, `x` read through its
            // strides (checked non-negative), the others contiguous; `out` is fresh.
            let (xs, cs, ss, ys) = unsafe { (x.as_span_slice::<T>()?, cos.as_slice::<T>()?, sin.as_slice::<T>()?, out.as_mut_slice::<T>()?) };
            let xs = xs.ok_or_else(|| invalid(op, arg, format!("strides {strides:?} overflow the address space")))?;
            with_torch_par(|par| keel::ops::rotary::apply_strided_cpu(xs, strides, cs, ss, ys, shape, interleaved, inverse, par))
                .map_err(kernel_err)?
        }),
        DeviceType::Cuda => {
            let call = CudaCall::new(op, c.device)?;
            let dtype = checks::cuda_dtype(c.dtype)?;
            let (px, pc, ps, po) = (ptr(Some(&x))?, ptr(Some(&cos))?, ptr(Some(&sin))?, ptr(Some(&out))?);
            // SAFETY: checked CUDA tensors on the guarded device, `x` read through
            // its strides, the others contiguous; `out` is fresh.
            unsafe {
                keel::ops::rotary::apply_cuda_raw(
                    &call.gpu,
                    &call.stream,
                    dtype,
                    px,
                    strides,
                    pc,
                    ps,
                    po,
                    shape,
                    interleaved,
                    inverse,
                )
            }
            .map_err(kernel_err)?
        }
        DeviceType::Meta | DeviceType::Other(_) => {}
    }
    Ok((out,))
}

/// `rotary_embedding`.
pub(crate) struct RotaryEmbedding;

impl BoxedOp for RotaryEmbedding {
    const NAME: &'static str = "rotary_embedding";
    type Args = (Tensor, Tensor, Tensor, bool);
    type Out = (Tensor,);

    fn run((x, cos, sin, interleaved): Self::Args) -> Result<Self::Out> {
        run(Self::NAME, "x", x, cos, sin, interleaved)
    }
}

/// `rotary_embedding_backward`.
pub(crate) struct RotaryEmbeddingBackward;

impl BoxedOp for RotaryEmbeddingBackward {
    const NAME: &'static str = "rotary_embedding_backward";
    type Args = (Tensor, Tensor, Tensor, bool);
    type Out = (Tensor,);

    fn run((grad_out, cos, sin, interleaved): Self::Args) -> Result<Self::Out> {
        run(Self::NAME, "grad_out", grad_out, cos, sin, interleaved)
    }
}

/// `rotary_embedding_`: `x` rotated in place. No autograd (the Python layer
/// refuses it where a gradient is needed).
pub(crate) struct RotaryEmbeddingInplace;

impl BoxedOp for RotaryEmbeddingInplace {
    const NAME: &'static str = "rotary_embedding_";
    type Args = (Tensor, Tensor, Tensor, bool);
    type Out = ();

    fn run((x, cos, sin, interleaved): Self::Args) -> Result<Self::Out> {
        let op = Self::NAME;
        let sizes = x.sizes()?;
        let heads_strided = sizes.len() == 4 && !checks::rows_read_in_place(x.strides()?, sizes[3] as usize);
        // Heads whose last dim is strided are rotated in a contiguous copy and
        // written back after (`back`); any other view in place, through its strides.
        let (x, back) = if heads_strided { checks::written(op, "x", x)? } else { (x, None) };
        let (x, cos, sin, c, shape, strides) = check(op, "x", x, cos, sin)?;
        shape.check_disjoint(op, strides).map_err(check_err)?;
        let given = back.as_ref().unwrap_or(&x);
        checks::disjoint(op, "cos", &cos, "x", given)?;
        checks::disjoint(op, "sin", &sin, "x", given)?;
        match c.device.kind {
            DeviceType::Cpu => with_float_type!(c.dtype, T => {
                // SAFETY: checked CPU tensors of element type T; `x`'s heads
                // (through its strides, checked non-negative) do not overlap
                // each other or cos and sin, and the kernel writes only them.
                let (xs, cs, ss) = unsafe { (x.as_mut_span_slice::<T>()?, cos.as_slice::<T>()?, sin.as_slice::<T>()?) };
                let xs = xs.ok_or_else(|| invalid(op, "x", format!("strides {strides:?} overflow the address space")))?;
                with_torch_par(|par| keel::ops::rotary::apply_inplace_cpu(xs, strides, cs, ss, shape, interleaved, false, par))
                    .map_err(kernel_err)?
            }),
            DeviceType::Cuda => {
                let call = CudaCall::new(op, c.device)?;
                let dtype = checks::cuda_dtype(c.dtype)?;
                let (px, pc, ps) = (ptr(Some(&x))?, ptr(Some(&cos))?, ptr(Some(&sin))?);
                // SAFETY: checked CUDA tensors on the guarded device; `x`'s
                // heads do not overlap each other or cos and sin.
                unsafe {
                    keel::ops::rotary::apply_inplace_cuda_raw(
                        &call.gpu,
                        &call.stream,
                        dtype,
                        px,
                        strides,
                        pc,
                        ps,
                        shape,
                        interleaved,
                        false,
                    )
                }
                .map_err(kernel_err)?
            }
            DeviceType::Meta | DeviceType::Other(_) => {}
        }
        if let Some(back) = back {
            back.copy_from(&x)?;
        }
        Ok(())
    }
}
