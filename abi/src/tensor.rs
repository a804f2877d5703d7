use crate::error::Result;
use crate::sys::{api, check, AtenTensorHandle};
use crate::types::{Device, DeviceType, Layout, ScalarType};
use std::ffi::c_void;

/// An owning handle to a torch tensor. Dropping it releases the reference.
#[derive(Debug)]
pub struct Tensor {
    handle: AtenTensorHandle,
}

// SAFETY: an AtenTensorHandle is a heap pointer to an at::Tensor, whose
// refcount is atomic; torch passes tensors between threads freely.
unsafe impl Send for Tensor {}
unsafe impl Sync for Tensor {}

impl Tensor {
    /// Takes ownership of a handle torch gave us (an op argument, a new tensor).
    ///
    /// # Safety
    /// `handle` must be a valid owning `AtenTensorHandle` not owned by anything else.
    pub unsafe fn from_raw(handle: AtenTensorHandle) -> Self {
        Tensor { handle }
    }

    /// Gives up ownership (e.g. to return the tensor on the stack).
    pub fn into_raw(self) -> AtenTensorHandle {
        let h = self.handle;
        std::mem::forget(self);
        h
    }

    /// A new uninitialised contiguous tensor.
    pub fn empty(sizes: &[i64], dtype: ScalarType, device: Device) -> Result<Tensor> {
        // On the stack for the usual ranks: this runs on every op call.
        let (mut small, mut large) = ([1i64; 8], Vec::new());
        let strides: &mut [i64] = if sizes.len() <= small.len() {
            &mut small[..sizes.len()]
        } else {
            large.resize(sizes.len(), 1);
            &mut large
        };
        for i in (0..sizes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * sizes[i + 1].max(1);
        }
        let a = api()?;
        let mut out: AtenTensorHandle = std::ptr::null_mut();
        // SAFETY: sizes/strides point to `len` i64s; `out` receives a new owning handle.
        let code = unsafe {
            (a.aoti_torch_empty_strided)(
                sizes.len() as i64,
                sizes.as_ptr(),
                strides.as_ptr(),
                dtype.code()?,
                device.kind.code()?,
                device.index.max(0),
                &mut out,
            )
        };
        check("aoti_torch_empty_strided", code)?;
        // SAFETY: success gave us a fresh owning handle.
        Ok(unsafe { Tensor::from_raw(out) })
    }

    /// A new uninitialised contiguous tensor with this one's sizes, dtype and device.
    pub fn empty_like(&self) -> Result<Tensor> {
        Tensor::empty(self.sizes()?, self.dtype()?, self.device()?)
    }

    /// This tensor itself where it is contiguous, else a contiguous copy of
    /// it ([`Tensor::contiguous_copy`]): for a kernel that reads dense rows,
    /// given a view.
    pub fn into_contiguous(self) -> Result<Tensor> {
        if self.is_contiguous()? {
            Ok(self)
        } else {
            self.contiguous_copy()
        }
    }

    /// A new contiguous tensor with this one's sizes, dtype, device and
    /// values, made by torch's `copy_` on the current stream.
    pub fn contiguous_copy(&self) -> Result<Tensor> {
        let out = self.empty_like()?;
        out.copy_from(self)?;
        Ok(out)
    }

    /// Writes `src`'s values into this tensor (torch's `copy_`, on the
    /// current stream; same sizes, or sizes that broadcast to these). Torch
    /// refuses, with an error, a destination whose elements share memory.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        // SAFETY: both handles are valid and owned for the call.
        check("aoti_torch_copy_", unsafe { (api()?.aoti_torch_copy_)(self.handle, src.handle, 0) })
    }

    fn get<T: Default>(
        &self,
        call: &'static str,
        f: unsafe extern "C-unwind" fn(AtenTensorHandle, *mut T) -> i32,
    ) -> Result<T> {
        let mut v = T::default();
        // SAFETY: `self.handle` is valid for our lifetime; `f` writes one T.
        check(call, unsafe { f(self.handle, &mut v) })?;
        Ok(v)
    }

    /// Whether the tensor is defined: torch hands an op an undefined tensor
    /// where a `Tensor` argument (not `Tensor?`) was given None. Every other
    /// query of an undefined tensor fails (its device) or says nothing
    /// (its dim, 0).
    pub fn is_defined(&self) -> Result<bool> {
        self.get("aoti_torch_is_defined", api()?.aoti_torch_is_defined)
    }

    /// Number of dimensions.
    pub fn dim(&self) -> Result<usize> {
        Ok(self.get("aoti_torch_get_dim", api()?.aoti_torch_get_dim)? as usize)
    }

    fn borrowed_i64s(
        &self,
        call: &'static str,
        f: unsafe extern "C-unwind" fn(AtenTensorHandle, *mut *mut i64) -> i32,
    ) -> Result<&[i64]> {
        let n = self.dim()?;
        let mut p: *mut i64 = std::ptr::null_mut();
        // SAFETY: valid handle; torch returns a pointer borrowed from the tensor.
        check(call, unsafe { f(self.handle, &mut p) })?;
        if n == 0 || p.is_null() {
            return Ok(&[]);
        }
        // SAFETY: the tensor's metadata holds `dim` i64s and lives as long as `self`.
        Ok(unsafe { std::slice::from_raw_parts(p, n) })
    }

    /// Sizes, one per dimension (borrowed from the tensor).
    pub fn sizes(&self) -> Result<&[i64]> {
        self.borrowed_i64s("aoti_torch_get_sizes", api()?.aoti_torch_get_sizes)
    }

    /// Strides in elements, one per dimension (borrowed from the tensor).
    pub fn strides(&self) -> Result<&[i64]> {
        self.borrowed_i64s("aoti_torch_get_strides", api()?.aoti_torch_get_strides)
    }

    /// Number of elements.
    pub fn numel(&self) -> Result<usize> {
        match api()?.aoti_torch_get_numel {
            // One shim call, where the sizes take two (dim, then sizes).
            Some(f) => Ok(self.get("aoti_torch_get_numel", f)? as usize),
            None => Ok(self.sizes()?.iter().product::<i64>() as usize),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> Result<ScalarType> {
        ScalarType::from_code(self.get("aoti_torch_get_dtype", api()?.aoti_torch_get_dtype)?)
    }

    /// Layout; None where this torch cannot tell it (no `aoti_torch_get_layout`).
    pub fn layout(&self) -> Result<Option<Layout>> {
        match api()?.aoti_torch_get_layout {
            Some(f) => Ok(Some(Layout::from_code(self.get("aoti_torch_get_layout", f)?)?)),
            None => Ok(None),
        }
    }

    /// Device.
    pub fn device(&self) -> Result<Device> {
        let a = api()?;
        let kind = DeviceType::from_code(self.get("aoti_torch_get_device_type", a.aoti_torch_get_device_type)?)?;
        let index = self.get("aoti_torch_get_device_index", a.aoti_torch_get_device_index)?;
        Ok(Device { kind, index })
    }

    /// Whether the tensor is contiguous in row-major order.
    pub fn is_contiguous(&self) -> Result<bool> {
        self.get("aoti_torch_is_contiguous", api()?.aoti_torch_is_contiguous)
    }

    /// Address of the first element (storage offset included); null for
    /// tensors without memory (meta) and possibly for empty ones.
    pub fn data_ptr(&self) -> Result<*mut c_void> {
        self.get("aoti_torch_get_data_ptr", api()?.aoti_torch_get_data_ptr)
    }

    /// The elements of a contiguous CPU tensor as a slice.
    ///
    /// # Safety
    /// The tensor must be contiguous, on the CPU, of element type `T`, and not
    /// written through any other handle while the slice lives.
    pub unsafe fn as_slice<T>(&self) -> Result<&[T]> {
        let n = self.numel()?;
        let p = self.data_ptr()?;
        if n == 0 || p.is_null() {
            return Ok(&[]);
        }
        // SAFETY: per this function's contract.
        Ok(unsafe { std::slice::from_raw_parts(p as *const T, n) })
    }

    /// Elements from the first (at [`Tensor::data_ptr`]) to one past the last
    /// that the sizes and strides reach: the memory a strided view reads
    /// (0 when the tensor is empty). `None` for a negative stride or on
    /// overflow.
    pub fn span(&self) -> Result<Option<usize>> {
        if self.numel()? == 0 {
            return Ok(Some(0));
        }
        let last = self.sizes()?.iter().zip(self.strides()?).try_fold(0usize, |acc, (&n, &s)| {
            let step = usize::try_from(s).ok()?.checked_mul(usize::try_from(n - 1).ok()?)?;
            acc.checked_add(step)
        });
        Ok(last.and_then(|l| l.checked_add(1)))
    }

    /// The [`Tensor::span`] of a CPU tensor as a slice, which the tensor's
    /// strides index (contiguous or not); `None` where the span is.
    ///
    /// # Safety
    /// The tensor must be on the CPU, of element type `T`, and not written
    /// through any other handle while the slice lives.
    pub unsafe fn as_span_slice<T>(&self) -> Result<Option<&[T]>> {
        let Some(n) = self.span()? else {
            return Ok(None);
        };
        let p = self.data_ptr()?;
        if n == 0 || p.is_null() {
            return Ok(Some(&[]));
        }
        // SAFETY: per this function's contract; the span lies within the
        // tensor's storage, as every element the view reaches does.
        Ok(Some(unsafe { std::slice::from_raw_parts(p as *const T, n) }))
    }

    /// [`Tensor::as_span_slice`], mutable: the memory a strided view
    /// reaches, for an op that writes the view in place through its strides.
    ///
    /// # Safety
    /// As [`Tensor::as_span_slice`], and no other slice of this memory may be
    /// alive; elements in the span that the view does not reach (padding,
    /// other views' elements) must not be written.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_span_slice<T>(&self) -> Result<Option<&mut [T]>> {
        let Some(n) = self.span()? else {
            return Ok(None);
        };
        let p = self.data_ptr()?;
        if n == 0 || p.is_null() {
            return Ok(Some(&mut []));
        }
        // SAFETY: per this function's contract; the span lies within the
        // tensor's storage, as every element the view reaches does.
        Ok(Some(unsafe { std::slice::from_raw_parts_mut(p as *mut T, n) }))
    }

    /// The elements of a contiguous CPU tensor as a mutable slice.
    ///
    /// # Safety
    /// As [`Tensor::as_slice`], and no other slice of this tensor may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<T>(&self) -> Result<&mut [T]> {
        let n = self.numel()?;
        let p = self.data_ptr()?;
        if n == 0 || p.is_null() {
            return Ok(&mut []);
        }
        // SAFETY: per this function's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut T, n) })
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: we own the handle and release it exactly once.
            let _ = unsafe { (a.aoti_torch_delete_tensor_object)(self.handle) };
        }
    }
}
