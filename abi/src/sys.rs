//! The raw C functions of the stable ABI, resolved at run time.
//!
//! `dlsym(RTLD_DEFAULT, ..)` cannot see torch's symbols (torch loads its
//! libraries `RTLD_LOCAL`), so the libraries are reopened by soname with
//! `RTLD_NOLOAD`, which returns the copy Python already loaded, and each
//! function is looked up in that handle. CUDA-only functions live in
//! `libtorch_cuda.so`, which CPU builds of torch do not have.
#![allow(missing_docs)]
use crate::error::{Error, Result};
use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

pub type AtenTensorHandle = *mut c_void;
pub type TorchLibraryHandle = *mut c_void;
pub type DeviceGuardHandle = *mut c_void;
pub type StableListHandle = *mut c_void;
pub type StringHandle = *mut c_void;
pub type ErrorCode = i32;
pub type BoxedKernel = unsafe extern "C-unwind" fn(*mut u64, u64, u64);
pub type ParallelFunc = unsafe extern "C" fn(i64, i64, *mut c_void);

macro_rules! api {
    (
        required { $($name:ident : fn($($arg:ty),*) $(-> $ret:ty)?;)* }
        optional { $($oname:ident : fn($($oarg:ty),*) $(-> $oret:ty)?;)* }
    ) => {
        #[allow(non_snake_case)]
        /// The stable-ABI functions Keel uses. Required ones exist in torch 2.10;
        /// optional ones are `None` where this torch (or a CPU-only build) lacks them.
        pub struct Api {
            $(pub $name: unsafe extern "C-unwind" fn($($arg),*) $(-> $ret)?,)*
            $(pub $oname: Option<unsafe extern "C-unwind" fn($($oarg),*) $(-> $oret)?>,)*
        }

        impl Api {
            fn load(libs: &Libs) -> Result<Api> {
                Ok(Api {
                    // SAFETY: each symbol is a C function with exactly this
                    // signature in torch's headers (shim.h, stable/c/shim.h).
                    $($name: unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C-unwind" fn($($arg),*) $(-> $ret)?>(libs.required(concat!(stringify!($name), "\0"))?) },)*
                    $($oname: libs.optional(concat!(stringify!($oname), "\0")).map(|p| unsafe {
                        std::mem::transmute::<*mut c_void, unsafe extern "C-unwind" fn($($oarg),*) $(-> $oret)?>(p)
                    }),)*
                })
            }
        }
    };
}

api! {
    required {
        aoti_torch_check: fn(bool, *const c_char, *const c_char, u32, *const c_char);
        aoti_torch_delete_tensor_object: fn(AtenTensorHandle) -> ErrorCode;
        aoti_torch_get_data_ptr: fn(AtenTensorHandle, *mut *mut c_void) -> ErrorCode;
        aoti_torch_get_dim: fn(AtenTensorHandle, *mut i64) -> ErrorCode;
        aoti_torch_get_sizes: fn(AtenTensorHandle, *mut *mut i64) -> ErrorCode;
        aoti_torch_get_strides: fn(AtenTensorHandle, *mut *mut i64) -> ErrorCode;
        aoti_torch_get_dtype: fn(AtenTensorHandle, *mut i32) -> ErrorCode;
        aoti_torch_get_device_type: fn(AtenTensorHandle, *mut i32) -> ErrorCode;
        aoti_torch_get_device_index: fn(AtenTensorHandle, *mut i32) -> ErrorCode;
        aoti_torch_is_contiguous: fn(AtenTensorHandle, *mut bool) -> ErrorCode;
        aoti_torch_is_defined: fn(AtenTensorHandle, *mut bool) -> ErrorCode;
        aoti_torch_empty_strided: fn(i64, *const i64, *const i64, i32, i32, i32, *mut AtenTensorHandle) -> ErrorCode;
        aoti_torch_copy_: fn(AtenTensorHandle, AtenTensorHandle, i32) -> ErrorCode;
        aoti_torch_dtype_float16: fn() -> i32;
        aoti_torch_dtype_bfloat16: fn() -> i32;
        aoti_torch_dtype_float32: fn() -> i32;
        aoti_torch_dtype_float64: fn() -> i32;
        aoti_torch_dtype_int64: fn() -> i32;
        aoti_torch_dtype_int32: fn() -> i32;
        aoti_torch_dtype_bool: fn() -> i32;
        aoti_torch_device_type_cpu: fn() -> i32;
        aoti_torch_device_type_cuda: fn() -> i32;
        aoti_torch_device_type_meta: fn() -> i32;
        aoti_torch_library_init_def: fn(*const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> ErrorCode;
        aoti_torch_library_init_impl: fn(*const c_char, *const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> ErrorCode;
        aoti_torch_library_def: fn(TorchLibraryHandle, *const c_char) -> ErrorCode;
        torch_library_impl: fn(TorchLibraryHandle, *const c_char, BoxedKernel, u64) -> ErrorCode;
        torch_list_size: fn(StableListHandle, *mut usize) -> ErrorCode;
        torch_list_get_item: fn(StableListHandle, usize, *mut u64) -> ErrorCode;
        torch_delete_list: fn(StableListHandle) -> ErrorCode;
        torch_string_c_str: fn(StringHandle, *mut *const c_char) -> ErrorCode;
        torch_string_length: fn(StringHandle, *mut usize) -> ErrorCode;
        torch_delete_string: fn(StringHandle) -> ErrorCode;
        torch_parallel_for: fn(i64, i64, i64, ParallelFunc, *mut c_void) -> ErrorCode;
        torch_get_num_threads: fn(*mut u32) -> ErrorCode;
        aoti_torch_create_device_guard: fn(i32, *mut DeviceGuardHandle) -> ErrorCode;
        aoti_torch_delete_device_guard: fn(DeviceGuardHandle) -> ErrorCode;
    }
    optional {
        // C++ `operator delete(void*)`: frees the heap StableIValue behind a
        // `T?` argument on torch < 2.13.
        _ZdlPv: fn(*mut c_void);
        // 2.13+
        torch_delete_stable_ivalue: fn(*mut u64) -> ErrorCode;
        torch_exception_get_what_without_backtrace: fn() -> *const c_char;
        // 2.12+: op tags, passed as the values their getters return.
        torch_library_def_with_tags: fn(TorchLibraryHandle, *const c_char, *const i32, i32) -> ErrorCode;
        torch_tag_pt2_compliant_tag: fn() -> i32;
        // In every torch Keel supports; optional all the same, as `numel`
        // can fall back to the product of the sizes.
        aoti_torch_get_numel: fn(AtenTensorHandle, *mut i64) -> ErrorCode;
        // libtorch_cuda only
        aoti_torch_get_current_cuda_stream: fn(i32, *mut *mut c_void) -> ErrorCode;
        // The dtypes Keel does not compute with, only names in its errors.
        aoti_torch_dtype_uint8: fn() -> i32;
        aoti_torch_dtype_uint16: fn() -> i32;
        aoti_torch_dtype_uint32: fn() -> i32;
        aoti_torch_dtype_uint64: fn() -> i32;
        aoti_torch_dtype_int8: fn() -> i32;
        aoti_torch_dtype_int16: fn() -> i32;
        aoti_torch_dtype_complex32: fn() -> i32;
        aoti_torch_dtype_complex64: fn() -> i32;
        aoti_torch_dtype_complex128: fn() -> i32;
        aoti_torch_dtype_float8_e5m2: fn() -> i32;
        aoti_torch_dtype_float8_e4m3fn: fn() -> i32;
        aoti_torch_dtype_float8_e5m2fnuz: fn() -> i32;
        aoti_torch_dtype_float8_e4m3fnuz: fn() -> i32;
        // Layouts: only to name, in an error, a tensor Keel's ops do not take
        // (see `refuse`).
        aoti_torch_get_layout: fn(AtenTensorHandle, *mut i32) -> ErrorCode;
        aoti_torch_layout_strided: fn() -> i32;
        aoti_torch_layout_sparse_coo: fn() -> i32;
        aoti_torch_layout_sparse_csr: fn() -> i32;
        aoti_torch_layout_sparse_csc: fn() -> i32;
        aoti_torch_layout_sparse_bsr: fn() -> i32;
        aoti_torch_layout_sparse_bsc: fn() -> i32;
        aoti_torch_layout__mkldnn: fn() -> i32;
        aoti_torch_layout_jagged: fn() -> i32;
    }
}

// SAFETY: the table holds only function pointers into libraries that stay loaded.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

struct Libs {
    cpu: *mut c_void,
    cuda: *mut c_void,
}

impl Libs {
    fn open() -> Result<Libs> {
        let open = |name: &CStr| {
            // SAFETY: RTLD_NOLOAD only returns an already-loaded library (or null).
            unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) }
        };
        let cpu = open(c"libtorch_cpu.so");
        if cpu.is_null() {
            return Err(Error::Load(
                "libtorch_cpu.so is not loaded in this process: import torch before loading keel's library".into(),
            ));
        }
        Ok(Libs { cpu, cuda: open(c"libtorch_cuda.so") })
    }

    fn lookup(&self, name: &str) -> Option<*mut c_void> {
        [self.cuda, self.cpu].into_iter().filter(|h| !h.is_null()).find_map(|h| {
            // SAFETY: `name` is NUL-terminated (built with concat!(.., "\0")) and `h` is a live handle.
            let p = unsafe { libc::dlsym(h, name.as_ptr().cast()) };
            (!p.is_null()).then_some(p)
        })
    }

    fn required(&self, name: &str) -> Result<*mut c_void> {
        self.lookup(name).ok_or_else(|| {
            Error::Load(format!(
                "this torch lacks the stable-ABI function {}; keel needs torch >= 2.10",
                name.trim_end_matches('\0')
            ))
        })
    }

    fn optional(&self, name: &str) -> Option<*mut c_void> {
        self.lookup(name)
    }
}

static API: OnceLock<std::result::Result<Api, Error>> = OnceLock::new();

/// The function table, loaded on first use.
///
/// Every tensor query goes through here, a dozen times per op call, so the
/// loaded case is inlined and the loading kept out of line.
#[inline]
pub fn api() -> Result<&'static Api> {
    match API.get() {
        Some(Ok(a)) => Ok(a),
        _ => load_api(),
    }
}

#[cold]
fn load_api() -> Result<&'static Api> {
    API.get_or_init(|| Libs::open().and_then(|l| Api::load(&l))).as_ref().map_err(Clone::clone)
}

/// Turns a shim error code into an [`Error`], with torch's message where this
/// torch can give it.
#[inline]
pub fn check(call: &'static str, code: ErrorCode) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(failure(call))
    }
}

/// The error for a failed shim call, with torch's message where it has one.
#[cold]
fn failure(call: &'static str) -> Error {
    let detail = last_error_message().map(|m| format!(": {m}")).unwrap_or_default();
    Error::Torch { call, detail }
}

/// The message of the exception that made the last shim call on this thread
/// fail, without its backtrace; None where this torch cannot tell it (before
/// 2.13: it printed it to stderr instead).
pub fn last_error_message() -> Option<String> {
    let f = api().ok()?.torch_exception_get_what_without_backtrace?;
    // SAFETY: returns null or a NUL-terminated string owned by torch.
    let p = unsafe { f() };
    // SAFETY: non-null, NUL-terminated, alive until the next failing call.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
