//! `keel::_abi_selftest`: echoes one argument of every kind the binding
//! unboxes (Tensor?, int, float, bool, str, int[], ScalarType), so the Python
//! tests check each conversion through the real dispatcher. Not a user op.
//! `anchor` gives the dispatcher a tensor to pick the (CPU) kernel from.
use keel_abi::{BoxedOp, Device, DeviceType, Result, ScalarType, Tensor};

pub(crate) struct AbiSelfTest;

impl BoxedOp for AbiSelfTest {
    const NAME: &'static str = "_abi_selftest";
    type Args = (Tensor, Option<Tensor>, i64, f64, bool, String, Vec<i64>, ScalarType);
    type Out = (Tensor, Tensor);

    /// Returns `[numel(t) or -1, i, f, b, bytes(s), sum of s's bytes, *l]` as
    /// f64, and an empty tensor of dtype `dtype`.
    fn run((_anchor, t, i, f, b, s, l, dtype): Self::Args) -> Result<Self::Out> {
        let numel = match &t {
            Some(t) => t.numel()? as f64,
            None => -1.0,
        };
        let bytes: u64 = s.bytes().map(u64::from).sum();
        let mut vals = vec![numel, i as f64, f, f64::from(u8::from(b)), s.len() as f64, bytes as f64];
        vals.extend(l.iter().map(|&v| v as f64));
        let cpu = Device { kind: DeviceType::Cpu, index: -1 };
        let out = Tensor::empty(&[vals.len() as i64], ScalarType::F64, cpu)?;
        // SAFETY: fresh contiguous f64 CPU tensor of vals.len() elements, no other view.
        unsafe { out.as_mut_slice::<f64>()? }.copy_from_slice(&vals);
        Ok((out, Tensor::empty(&[0], dtype, cpu)?))
    }
}
