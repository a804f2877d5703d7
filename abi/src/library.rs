use crate::error::{invalid_cstr, Result};
use crate::sys::{api, check, Api, BoxedKernel, TorchLibraryHandle};
use crate::EXTENSION_BUILD_VERSION;
use std::ffi::CString;

/// The dispatch keys Keel registers kernels for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchKey {
    /// Host tensors.
    Cpu,
    /// CUDA tensors.
    Cuda,
    /// Meta tensors (also what fake tensors and `torch.compile` use for shapes).
    Meta,
    /// Any other key, by torch's name (`c"SparseCPU"`).
    Named(&'static std::ffi::CStr),
}

impl DispatchKey {
    fn name(self) -> &'static std::ffi::CStr {
        match self {
            DispatchKey::Cpu => c"CPU",
            DispatchKey::Cuda => c"CUDA",
            DispatchKey::Meta => c"Meta",
            DispatchKey::Named(name) => name,
        }
    }
}

/// A tag that an op's definition can carry (torch's `at::Tag`), as
/// `torch.library.define(..., tags=...)` gives one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tag {
    /// `pt2_compliant_tag`: the op's registrations (schema, Meta kernel,
    /// autograd) pass `torch.library.opcheck`, so `torch.compile` keeps it in
    /// its graph even under `torch._dynamo.config.only_allow_pt2_compliant_ops`.
    /// `torch.library.custom_op` gives every op it defines this tag.
    Pt2Compliant,
}

impl Tag {
    /// The tag's value in this torch (read from its getter, so that the
    /// enum's order in torch is no part of the ABI); None where this torch
    /// has no getter for it.
    fn value(self, api: &Api) -> Option<i32> {
        let getter = match self {
            Tag::Pt2Compliant => api.torch_tag_pt2_compliant_tag?,
        };
        // SAFETY: a getter with no arguments that returns an int.
        Some(unsafe { getter() })
    }
}

/// A torch library fragment: either the one that defines a namespace's
/// schemas, or one that implements them for one dispatch key.
///
/// Registrations last as long as the handle; Keel's handles are kept for the
/// life of the process (dropping one would unregister its ops).
pub struct Library {
    handle: TorchLibraryHandle,
}

// SAFETY: the handle is only used to register, under torch's own locking.
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

impl Library {
    /// The defining fragment of namespace `ns` (`TORCH_LIBRARY(ns, m)`).
    pub fn define_namespace(ns: &str) -> Result<Library> {
        let ns = invalid_cstr(ns)?;
        let mut h = std::ptr::null_mut();
        // SAFETY: valid C strings; `h` receives a new library handle.
        check("aoti_torch_library_init_def", unsafe {
            (api()?.aoti_torch_library_init_def)(ns.as_ptr(), c"keel-ops".as_ptr(), line!(), &mut h)
        })?;
        Ok(Library { handle: h })
    }

    /// The implementing fragment of namespace `ns` for `key` (`TORCH_LIBRARY_IMPL(ns, key, m)`).
    pub fn implement(ns: &str, key: DispatchKey) -> Result<Library> {
        let ns = invalid_cstr(ns)?;
        let mut h = std::ptr::null_mut();
        // SAFETY: as above.
        check("aoti_torch_library_init_impl", unsafe {
            (api()?.aoti_torch_library_init_impl)(
                ns.as_ptr(),
                key.name().as_ptr(),
                c"keel-ops".as_ptr(),
                line!(),
                &mut h,
            )
        })?;
        Ok(Library { handle: h })
    }

    /// Defines an op from its schema string (`"rms_norm(Tensor input, ...) -> Tensor"`).
    pub fn def(&self, schema: &str) -> Result<()> {
        let s = invalid_cstr(schema)?;
        // SAFETY: live handle, valid C string.
        check("aoti_torch_library_def", unsafe { (api()?.aoti_torch_library_def)(self.handle, s.as_ptr()) })
    }

    /// Defines an op from its schema string with `tags`. A torch that takes
    /// no tags at definition (before 2.12) gets the op without them: tags
    /// tell torch's tooling what holds of the op, and the op works the same
    /// without them.
    pub fn def_with_tags(&self, schema: &str, tags: &[Tag]) -> Result<()> {
        let a = api()?;
        let values: Option<Vec<i32>> = tags.iter().map(|t| t.value(a)).collect();
        let (Some(def), Some(values)) = (a.torch_library_def_with_tags, values) else {
            return self.def(schema);
        };
        let s = invalid_cstr(schema)?;
        // A handful of tags: the count fits.
        let n = values.len() as i32;
        // SAFETY: live handle, valid C string, `values` holds `n` tag values.
        check("torch_library_def_with_tags", unsafe { def(self.handle, s.as_ptr(), values.as_ptr(), n) })
    }

    /// Registers the boxed kernel of op `name` (see [`crate::boxed`]).
    pub fn impl_kernel(&self, name: &str, kernel: BoxedKernel) -> Result<()> {
        let n: CString = invalid_cstr(name)?;
        // SAFETY: live handle, valid C string, kernel has the boxed signature.
        check("torch_library_impl", unsafe {
            (api()?.torch_library_impl)(self.handle, n.as_ptr(), kernel, EXTENSION_BUILD_VERSION)
        })
    }
}
