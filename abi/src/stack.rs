//! Boxing and unboxing on torch's `StableIValue` stack.
//!
//! A boxed kernel receives `max(num_args, num_outputs)` 64-bit slots: the
//! arguments left to right, and it writes its returns left to right from slot 0.
//! Encodings (measured on 2.10 and 2.15): a tensor is an owning
//! `AtenTensorHandle`; `float` the f64 bits; `int` an i64; `bool` the low byte;
//! `T?` is 0 for None or a pointer to a heap StableIValue the kernel frees;
//! `int[]` an owning list handle; `str` an owning string handle; `ScalarType`
//! the shim dtype code.
use crate::error::{Error, Result};
use crate::sys::{api, check, StableListHandle, StringHandle};
use crate::tensor::Tensor;
use crate::types::ScalarType;
use std::ffi::c_void;

/// One stack slot.
pub type StableIValue = u64;

/// A value that can be taken (with ownership) from stack slots.
pub trait FromStack: Sized {
    /// Slots this value occupies.
    const SLOTS: usize;
    /// Takes the value from `slots[..Self::SLOTS]`.
    ///
    /// # Safety
    /// The slots must hold values of this type as torch boxed them, not yet taken.
    unsafe fn take(slots: &[StableIValue]) -> Result<Self>;

    /// Calls `f` with each tensor this value holds, and the index of the
    /// argument it came in (`index` is this value's first): none for
    /// non-tensor values.
    fn each_tensor(&self, index: usize, f: &mut dyn FnMut(usize, &Tensor)) {
        let _ = (index, f);
    }
}

/// A value that can be written (with ownership) into stack slots.
pub trait IntoStack {
    /// Slots this value occupies.
    const SLOTS: usize;
    /// Writes the value to `slots[..Self::SLOTS]`.
    fn put(self, slots: &mut [StableIValue]);
}

impl FromStack for Tensor {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        // SAFETY: the slot holds an owning tensor handle (caller's contract).
        Ok(unsafe { Tensor::from_raw(slots[0] as usize as *mut c_void) })
    }

    fn each_tensor(&self, index: usize, f: &mut dyn FnMut(usize, &Tensor)) {
        f(index, self)
    }
}

impl IntoStack for Tensor {
    const SLOTS: usize = 1;
    fn put(self, slots: &mut [StableIValue]) {
        slots[0] = self.into_raw() as usize as u64;
    }
}

/// No returns (an op that only mutates its arguments, `-> ()`).
impl IntoStack for () {
    const SLOTS: usize = 0;
    fn put(self, _slots: &mut [StableIValue]) {}
}

impl FromStack for f64 {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        Ok(f64::from_bits(slots[0]))
    }
}

impl FromStack for i64 {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        Ok(slots[0] as i64)
    }
}

impl FromStack for bool {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        Ok(slots[0] & 0xff != 0)
    }
}

impl FromStack for ScalarType {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        ScalarType::from_code(slots[0] as i32)
    }
}

impl<T: FromStack> FromStack for Option<T> {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        let p = slots[0] as usize as *mut StableIValue;
        if p.is_null() {
            return Ok(None);
        }
        // SAFETY: a non-null `T?` slot points to one heap StableIValue holding a T.
        let inner = unsafe { T::take(std::slice::from_ref(&*p)) };
        free_boxed_ivalue(p)?;
        inner.map(Some)
    }

    fn each_tensor(&self, index: usize, f: &mut dyn FnMut(usize, &Tensor)) {
        if let Some(v) = self {
            v.each_tensor(index, f)
        }
    }
}

/// Frees the heap StableIValue behind a `T?` argument: with
/// `torch_delete_stable_ivalue` on 2.13+, else with C++ `operator delete`,
/// which is how torch 2.10-2.12 allocated it (`new StableIValue`).
fn free_boxed_ivalue(p: *mut StableIValue) -> Result<()> {
    let a = api()?;
    if let Some(del) = a.torch_delete_stable_ivalue {
        // SAFETY: `p` came from torch's allocation for this argument; freed once.
        return check("torch_delete_stable_ivalue", unsafe { del(p) });
    }
    match a._ZdlPv {
        // SAFETY: as above, with the deallocator that matches `new`.
        Some(del) => unsafe { del(p.cast()) },
        None => return Err(Error::Load("cannot free an optional argument: operator delete not found".into())),
    }
    Ok(())
}

impl FromStack for Vec<i64> {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        let a = api()?;
        let list = slots[0] as usize as StableListHandle;
        let read = || -> Result<Vec<i64>> {
            let mut n = 0usize;
            // SAFETY: `list` is an owning list handle from the stack.
            check("torch_list_size", unsafe { (a.torch_list_size)(list, &mut n) })?;
            (0..n)
                .map(|i| {
                    let mut v: StableIValue = 0;
                    // SAFETY: i < n; writes one StableIValue.
                    check("torch_list_get_item", unsafe { (a.torch_list_get_item)(list, i, &mut v) })?;
                    Ok(v as i64)
                })
                .collect()
        };
        let out = read();
        // SAFETY: we own the list and free it once, whether or not reading worked.
        check("torch_delete_list", unsafe { (a.torch_delete_list)(list) })?;
        out
    }
}

impl FromStack for String {
    const SLOTS: usize = 1;
    unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
        let a = api()?;
        let h = slots[0] as usize as StringHandle;
        let read = || -> Result<String> {
            let (mut p, mut n) = (std::ptr::null(), 0usize);
            // SAFETY: `h` is an owning string handle; torch returns a borrowed pointer and length.
            check("torch_string_c_str", unsafe { (a.torch_string_c_str)(h, &mut p) })?;
            check("torch_string_length", unsafe { (a.torch_string_length)(h, &mut n) })?;
            if p.is_null() {
                return Ok(String::new());
            }
            // SAFETY: `p` points to `n` bytes owned by the handle (NUL-terminated too).
            let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) };
            Ok(String::from_utf8_lossy(bytes).into_owned())
        };
        let out = read();
        // SAFETY: owned handle, freed once.
        check("torch_delete_string", unsafe { (a.torch_delete_string)(h) })?;
        out
    }
}

/// Unboxes every element even when one fails, so no owning handle leaks.
macro_rules! tuple_impls {
    ($( ($($t:ident),+) )*) => {$(
        impl<$($t: FromStack),+> FromStack for ($($t,)+) {
            const SLOTS: usize = 0 $(+ $t::SLOTS)+;
            #[allow(non_snake_case, unused_assignments)]
            unsafe fn take(slots: &[StableIValue]) -> Result<Self> {
                let mut at = 0;
                $(
                    // SAFETY: element slots follow one another, per the caller's contract.
                    let $t = unsafe { $t::take(&slots[at..]) };
                    at += $t::SLOTS;
                )+
                Ok(($($t?,)+))
            }

            #[allow(non_snake_case, unused_assignments)]
            fn each_tensor(&self, index: usize, f: &mut dyn FnMut(usize, &Tensor)) {
                let ($($t,)+) = self;
                let mut at = index;
                $( $t.each_tensor(at, f); at += $t::SLOTS; )+
            }
        }
        impl<$($t: IntoStack),+> IntoStack for ($($t,)+) {
            const SLOTS: usize = 0 $(+ $t::SLOTS)+;
            #[allow(non_snake_case, unused_assignments)]
            fn put(self, slots: &mut [StableIValue]) {
                let ($($t,)+) = self;
                let mut at = 0;
                $( $t.put(&mut slots[at..]); at += $t::SLOTS; )+
            }
        }
    )*};
}
tuple_impls! { (A) (A, B) (A, B, C) (A, B, C, D) (A, B, C, D, E) (A, B, C, D, E, F) (A, B, C, D, E, F, G) (A, B, C, D, E, F, G, H) }
