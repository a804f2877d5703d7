//! Argument checks shared by the ops. Every message names the op and the argument.
use keel_abi::{Device, DeviceType, Error, Result, ScalarType, Tensor};

pub(crate) fn invalid(op: &str, arg: &str, msg: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("keel::{op}: argument '{arg}' {msg}"))
}

/// A floating-point dtype Keel computes with on `device` (f64 on CPU and Meta only).
pub(crate) fn float_dtype(op: &str, arg: &str, t: &Tensor, device: Device) -> Result<ScalarType> {
    let dt = t.dtype()?;
    match dt {
        ScalarType::F32 | ScalarType::F16 | ScalarType::BF16 => Ok(dt),
        ScalarType::F64 if device.kind != DeviceType::Cuda => Ok(dt),
        ScalarType::F64 => Err(invalid(op, arg, "has dtype torch.float64, which Keel supports on CPU only")),
        other => Err(invalid(op, arg, format!("must be float32, float16, bfloat16 or float64, got {other}"))),
    }
}

/// The device all tensors of a call run on; CPU, CUDA or Meta.
pub(crate) fn supported_device(op: &str, arg: &str, t: &Tensor) -> Result<Device> {
    let d = t.device()?;
    match d.kind {
        DeviceType::Cpu | DeviceType::Cuda | DeviceType::Meta => Ok(d),
        DeviceType::Other(_) => Err(invalid(op, arg, format!("is on {d}, which Keel does not support"))),
    }
}

pub(crate) fn same_device(op: &str, arg: &str, t: &Tensor, main_arg: &str, device: Device) -> Result<()> {
    let d = t.device()?;
    if d == device {
        Ok(())
    } else {
        Err(invalid(op, arg, format!("is on {d} but '{main_arg}' is on {device}")))
    }
}

pub(crate) fn same_dtype(op: &str, arg: &str, t: &Tensor, main_arg: &str, dtype: ScalarType) -> Result<()> {
    let d = t.dtype()?;
    if d == dtype {
        Ok(())
    } else {
        Err(invalid(op, arg, format!("has dtype {d} but '{main_arg}' has {dtype}")))
    }
}

/// `t` itself where it is contiguous, else a contiguous copy: the kernels read
/// dense rows, and a torch op takes any strided layout (torch.compile hands
/// over views of its own choosing, such as a padded matmul's output sliced
/// back). Call it once `t` has passed the op's other checks.
pub(crate) fn dense(op: &str, arg: &str, t: Tensor) -> Result<Tensor> {
    t.into_contiguous().map_err(copy_failed(op, arg))
}

/// The error of a failed contiguous copy of `arg`, naming the op and it.
fn copy_failed<'a>(op: &'a str, arg: &'a str) -> impl FnOnce(Error) -> Error + 'a {
    move |e| invalid(op, arg, format!("could not be copied to a contiguous tensor: {e}"))
}

/// For an op that writes the row tensor `t` in place: `(t, None)` where `t`
/// is contiguous; else a contiguous copy to work on and `t`, to write the
/// result back into ([`Tensor::copy_from`]) once the kernel has run. Refuses
/// a `t` whose elements share memory (an expanded view): no result can be
/// written there.
pub(crate) fn written(op: &str, arg: &'static str, t: Tensor) -> Result<(Tensor, Option<Tensor>)> {
    if t.is_contiguous()? {
        return Ok((t, None));
    }
    // What a copy needs (a supported device, a float dtype); the op's checks follow.
    strided_rows_of(op, arg, &t)?;
    if !no_internal_overlap(t.sizes()?, t.strides()?) {
        let msg = format!(
            "has elements that share memory (sizes {:?}, strides {:?}): the op writes it in place",
            t.sizes()?,
            t.strides()?
        );
        return Err(invalid(op, arg, msg));
    }
    let work = t.contiguous_copy().map_err(copy_failed(op, arg))?;
    Ok((work, Some(t)))
}

/// Whether no two elements of a tensor of these sizes and strides share
/// memory: each dim, in order of stride, steps past everything the smaller
/// ones reach. Sufficient, not necessary (interleaved dims are refused); no
/// element at all, or negative strides (which torch does not make), count as
/// overlapping only where they would.
pub(crate) fn no_internal_overlap(sizes: &[i64], strides: &[i64]) -> bool {
    if sizes.contains(&0) {
        return true;
    }
    let mut dims: Vec<(i64, i64)> = sizes.iter().zip(strides).filter(|(&n, _)| n > 1).map(|(&n, &s)| (s, n)).collect();
    dims.sort_unstable();
    // One past the largest offset the dims so far reach.
    let mut reach: i64 = 1;
    for (s, n) in dims {
        if s < reach {
            return false;
        }
        reach = s.saturating_mul(n - 1).saturating_add(reach);
    }
    true
}

pub(crate) fn same_shape(op: &str, arg: &str, t: &Tensor, main_arg: &str, sizes: &[i64]) -> Result<()> {
    let s = t.sizes()?;
    if s == sizes {
        Ok(())
    } else {
        Err(invalid(op, arg, format!("has shape {s:?} but '{main_arg}' has {sizes:?}")))
    }
}

/// A per-column parameter (weight, bias) of the row tensor `c`: on its
/// device, of its dtype, shape `[cols]`; returned contiguous ([`dense`]).
pub(crate) fn param(op: &str, arg: &str, t: Tensor, c: &Rows) -> Result<Tensor> {
    same_device(op, arg, &t, c.arg, c.device)?;
    same_dtype(op, arg, &t, c.arg, c.dtype)?;
    let (s, cols) = (t.sizes()?, c.cols);
    if s != [cols as i64] {
        return Err(invalid(op, arg, format!("must have shape [{cols}] ({}'s last dim), got {s:?}", c.arg)));
    }
    dense(op, arg, t)
}

/// A tensor that must match the row tensor `main` (checked as `c`) in
/// device, dtype and shape; returned contiguous ([`dense`]).
pub(crate) fn like(op: &str, arg: &str, t: Tensor, main: &Tensor, c: &Rows) -> Result<Tensor> {
    same_device(op, arg, &t, c.arg, c.device)?;
    same_dtype(op, arg, &t, c.arg, c.dtype)?;
    same_shape(op, arg, &t, c.arg, main.sizes()?)?;
    dense(op, arg, t)
}

/// `t` and `other` (both checked, of one dtype) share no element: an op
/// that writes one of them in place while it reads the other needs that.
/// Tensors without memory (meta, empty) overlap nothing.
pub(crate) fn disjoint(op: &str, arg: &str, t: &Tensor, other_arg: &str, other: &Tensor) -> Result<()> {
    let range = |t: &Tensor| -> Result<Option<(usize, usize)>> {
        let (p, span) = (t.data_ptr()? as usize, t.span()?);
        let size = t.dtype()?.size().unwrap_or(1);
        Ok(match span {
            Some(0) => None,
            _ if p == 0 => None,
            // A span past usize (not a tensor torch can make): assume the worst.
            None => Some((p, usize::MAX)),
            Some(n) => Some((p, p.saturating_add(n.saturating_mul(size)))),
        })
    };
    match (range(t)?, range(other)?) {
        (Some((a0, a1)), Some((b0, b1))) if a0 < b1 && b0 < a1 => {
            Err(invalid(op, arg, format!("shares memory with '{other_arg}'; pass distinct tensors")))
        }
        _ => Ok(()),
    }
}

/// What the checks of a row op established about its main tensor.
pub(crate) struct Rows {
    /// The argument's name in the schema (`input`, or `sum` for a backward).
    pub arg: &'static str,
    pub device: Device,
    pub dtype: ScalarType,
    pub rows: usize,
    pub cols: usize,
}

impl Rows {
    /// A new contiguous tensor shaped like `t`, the tensor these checks were
    /// made of, with its dtype and device: `t.empty_like()` without asking
    /// torch again for what is already known (this runs on every call).
    pub(crate) fn empty_like(&self, t: &Tensor) -> Result<Tensor> {
        Tensor::empty(t.sizes()?, self.dtype, self.device)
    }
}

/// The checks every op over the last dimension makes of its main tensor `arg`.
/// Returns `t` contiguous ([`dense`]) with what the checks found.
pub(crate) fn rows_of(op: &str, arg: &'static str, t: Tensor) -> Result<(Tensor, Rows)> {
    let r = strided_rows_of(op, arg, &t)?;
    Ok((dense(op, arg, t)?, r))
}

/// [`rows_of`] for an op that reads `t` through its strides: any layout.
pub(crate) fn strided_rows_of(op: &str, arg: &'static str, t: &Tensor) -> Result<Rows> {
    let device = supported_device(op, arg, t)?;
    let dtype = float_dtype(op, arg, t, device)?;
    let (rows, cols) = rows_cols(op, arg, t)?;
    Ok(Rows { arg, device, dtype, rows, cols })
}

/// Whether rows of `cols` elements can be read in place through `strides`:
/// the last dim contiguous (stride 1, or at most one element), no negative
/// stride.
pub(crate) fn rows_read_in_place(strides: &[i64], cols: usize) -> bool {
    strides.iter().all(|&s| s >= 0) && (cols <= 1 || strides.last() == Some(&1))
}

/// Where the rows of `t` (checked as `c`) lie for a row op that reads it
/// through its strides; None where they cannot be read in place: the last
/// dim strided, a negative stride, or more than three leading dims once the
/// contiguous ones merge.
pub(crate) fn row_layout(t: &Tensor, c: &Rows) -> Result<Option<keel::cpu::RowLayout>> {
    let (sizes, strides) = (t.sizes()?, t.strides()?);
    if !rows_read_in_place(strides, c.cols) {
        return Ok(None);
    }
    let n = sizes.len();
    let us = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
    Ok(keel::cpu::RowLayout::new(&us(&sizes[..n - 1]), &us(&strides[..n - 1])))
}

pub(crate) fn eps(op: &str, eps: f64) -> Result<()> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(invalid(op, "eps", format!("must be finite and >= 0, got {eps}")))
    }
}

/// For an op over the last dimension: (rows, cols) of a contiguous input of
/// at least one dimension.
pub(crate) fn rows_cols(op: &str, arg: &str, t: &Tensor) -> Result<(usize, usize)> {
    let s = t.sizes()?;
    let Some(&cols) = s.last() else {
        return Err(invalid(op, arg, "must have at least 1 dimension, got a 0-dim tensor"));
    };
    let cols = cols as usize;
    let rows = (s.iter().product::<i64>() as usize).checked_div(cols).unwrap_or(0);
    Ok((rows, cols))
}

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype`.
macro_rules! with_float_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            keel_abi::ScalarType::F32 => {
                type $T = f32;
                $body
            }
            keel_abi::ScalarType::F64 => {
                type $T = f64;
                $body
            }
            keel_abi::ScalarType::F16 => {
                type $T = half::f16;
                $body
            }
            keel_abi::ScalarType::BF16 => {
                type $T = half::bf16;
                $body
            }
            other => return Err(keel_abi::Error::Invalid(format!("keel: internal error: no kernel for {other}"))),
        }
    };
}
pub(crate) use with_float_type;

/// The CUDA kernels' dtype for a checked float dtype.
pub(crate) fn cuda_dtype(dtype: ScalarType) -> Result<keel::cuda::DType> {
    match dtype {
        ScalarType::F32 => Ok(keel::cuda::DType::F32),
        ScalarType::F16 => Ok(keel::cuda::DType::F16),
        ScalarType::BF16 => Ok(keel::cuda::DType::BF16),
        other => Err(Error::Invalid(format!("keel: internal error: no CUDA kernel for {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::no_internal_overlap;

    #[test]
    fn internal_overlap_of_layouts() {
        assert!(no_internal_overlap(&[3, 4], &[4, 1])); // contiguous
        assert!(no_internal_overlap(&[3, 4], &[1, 3])); // transposed
        assert!(no_internal_overlap(&[3, 4], &[12, 1])); // padded rows
        assert!(no_internal_overlap(&[2, 3, 4], &[1, 8, 2])); // dims in any order
        assert!(no_internal_overlap(&[1, 4], &[0, 1])); // a size-1 dim's stride reaches nothing
        assert!(no_internal_overlap(&[0, 4], &[0, 0])); // no element
        assert!(!no_internal_overlap(&[3, 4], &[0, 1])); // expanded
        assert!(!no_internal_overlap(&[3, 4], &[2, 1])); // rows overlap
        assert!(!no_internal_overlap(&[2, 2], &[1, 1]));
        assert!(!no_internal_overlap(&[2, 3], &[2, 1])); // row 1 starts inside row 0
    }
}
