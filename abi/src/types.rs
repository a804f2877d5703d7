use crate::error::Result;
use crate::sys::api;
use std::fmt;

/// A tensor element type (c10::ScalarType), as far as Keel's ops need to tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalarType {
    /// float16
    F16,
    /// bfloat16
    BF16,
    /// float32
    F32,
    /// float64
    F64,
    /// int64
    I64,
    /// int32
    I32,
    /// bool
    Bool,
    /// Any other type, by its shim code.
    Other(i32),
}

impl ScalarType {
    /// From the shim's dtype code.
    pub fn from_code(code: i32) -> Result<Self> {
        let a = api()?;
        // SAFETY: these shim functions take no arguments and return a constant.
        let table = unsafe {
            [
                ((a.aoti_torch_dtype_float16)(), ScalarType::F16),
                ((a.aoti_torch_dtype_bfloat16)(), ScalarType::BF16),
                ((a.aoti_torch_dtype_float32)(), ScalarType::F32),
                ((a.aoti_torch_dtype_float64)(), ScalarType::F64),
                ((a.aoti_torch_dtype_int64)(), ScalarType::I64),
                ((a.aoti_torch_dtype_int32)(), ScalarType::I32),
                ((a.aoti_torch_dtype_bool)(), ScalarType::Bool),
            ]
        };
        Ok(table.iter().find(|(c, _)| *c == code).map_or(ScalarType::Other(code), |&(_, t)| t))
    }

    /// The shim's dtype code.
    pub fn code(self) -> Result<i32> {
        let a = api()?;
        // SAFETY: argument-less constant getters.
        Ok(unsafe {
            match self {
                ScalarType::F16 => (a.aoti_torch_dtype_float16)(),
                ScalarType::BF16 => (a.aoti_torch_dtype_bfloat16)(),
                ScalarType::F32 => (a.aoti_torch_dtype_float32)(),
                ScalarType::F64 => (a.aoti_torch_dtype_float64)(),
                ScalarType::I64 => (a.aoti_torch_dtype_int64)(),
                ScalarType::I32 => (a.aoti_torch_dtype_int32)(),
                ScalarType::Bool => (a.aoti_torch_dtype_bool)(),
                ScalarType::Other(c) => c,
            }
        })
    }

    /// torch's name of a dtype Keel does not compute with (`"torch.complex64"`),
    /// from the shim's getters; None where this torch has no getter for it.
    fn other_name(code: i32) -> Option<&'static str> {
        let a = api().ok()?;
        let named = [
            (a.aoti_torch_dtype_uint8, "torch.uint8"),
            (a.aoti_torch_dtype_uint16, "torch.uint16"),
            (a.aoti_torch_dtype_uint32, "torch.uint32"),
            (a.aoti_torch_dtype_uint64, "torch.uint64"),
            (a.aoti_torch_dtype_int8, "torch.int8"),
            (a.aoti_torch_dtype_int16, "torch.int16"),
            (a.aoti_torch_dtype_complex32, "torch.complex32"),
            (a.aoti_torch_dtype_complex64, "torch.complex64"),
            (a.aoti_torch_dtype_complex128, "torch.complex128"),
            (a.aoti_torch_dtype_float8_e5m2, "torch.float8_e5m2"),
            (a.aoti_torch_dtype_float8_e4m3fn, "torch.float8_e4m3fn"),
            (a.aoti_torch_dtype_float8_e5m2fnuz, "torch.float8_e5m2fnuz"),
            (a.aoti_torch_dtype_float8_e4m3fnuz, "torch.float8_e4m3fnuz"),
        ];
        named_code(code, named)
    }

    /// Bytes per element, for the types Keel computes with.
    pub fn size(self) -> Option<usize> {
        match self {
            ScalarType::F16 | ScalarType::BF16 => Some(2),
            ScalarType::F32 | ScalarType::I32 => Some(4),
            ScalarType::F64 | ScalarType::I64 => Some(8),
            ScalarType::Bool => Some(1),
            ScalarType::Other(_) => None,
        }
    }
}

impl fmt::Display for ScalarType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScalarType::F16 => f.write_str("torch.float16"),
            ScalarType::BF16 => f.write_str("torch.bfloat16"),
            ScalarType::F32 => f.write_str("torch.float32"),
            ScalarType::F64 => f.write_str("torch.float64"),
            ScalarType::I64 => f.write_str("torch.int64"),
            ScalarType::I32 => f.write_str("torch.int32"),
            ScalarType::Bool => f.write_str("torch.bool"),
            ScalarType::Other(c) => match ScalarType::other_name(*c).or(ScalarType::quantized_name(*c)) {
                Some(name) => f.write_str(name),
                None => write!(f, "dtype code {c}"),
            },
        }
    }
}

impl ScalarType {
    /// Whether this is one of torch's quantized dtypes (`torch.quint8`, ...).
    pub fn is_quantized(self) -> bool {
        matches!(self, ScalarType::Other(c) if Self::quantized_name(c).is_some())
    }

    /// torch's name of quantized dtype `code`. The shim has no getters for
    /// these; its dtype codes are c10's `ScalarType` values, which have held
    /// these numbers since quantization was added.
    fn quantized_name(code: i32) -> Option<&'static str> {
        Some(match code {
            12 => "torch.qint8",
            13 => "torch.quint8",
            14 => "torch.qint32",
            16 => "torch.quint4x2",
            17 => "torch.quint2x4",
            _ => return None,
        })
    }
}

/// The name paired with the shim's constant getter that returns `code`, among
/// those this torch has (a getter is None where it lacks one).
fn named_code<const N: usize>(
    code: i32,
    named: [(Option<unsafe extern "C-unwind" fn() -> i32>, &'static str); N],
) -> Option<&'static str> {
    // SAFETY: argument-less constant getters.
    named.into_iter().find_map(|(get, name)| get.filter(|g| unsafe { g() } == code).map(|_| name))
}

/// How a tensor's elements are laid out in memory (torch's `layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Dense, through sizes and strides: the only layout Keel's ops take.
    Strided,
    /// Any other layout, by torch's name (`"torch.sparse_coo"`), or by its
    /// shim code where this torch has no getter for it.
    Other(Option<&'static str>, i32),
}

impl Layout {
    /// From the shim's layout code.
    pub fn from_code(code: i32) -> Result<Self> {
        let a = api()?;
        let named = [
            (a.aoti_torch_layout_strided, "torch.strided"),
            (a.aoti_torch_layout_sparse_coo, "torch.sparse_coo"),
            (a.aoti_torch_layout_sparse_csr, "torch.sparse_csr"),
            (a.aoti_torch_layout_sparse_csc, "torch.sparse_csc"),
            (a.aoti_torch_layout_sparse_bsr, "torch.sparse_bsr"),
            (a.aoti_torch_layout_sparse_bsc, "torch.sparse_bsc"),
            (a.aoti_torch_layout__mkldnn, "torch._mkldnn"),
            (a.aoti_torch_layout_jagged, "torch.jagged"),
        ];
        Ok(match named_code(code, named) {
            Some("torch.strided") => Layout::Strided,
            name => Layout::Other(name, code),
        })
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::Strided => f.write_str("torch.strided"),
            Layout::Other(Some(name), _) => f.write_str(name),
            Layout::Other(None, code) => write!(f, "layout code {code}"),
        }
    }
}

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceType {
    /// Host memory.
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
    /// No memory: shapes only (fake tensors, `torch.compile` tracing).
    Meta,
    /// Any other device type, by its shim code.
    Other(i32),
}

impl DeviceType {
    /// From the shim's device-type code.
    pub fn from_code(code: i32) -> Result<Self> {
        let a = api()?;
        // SAFETY: argument-less constant getters.
        let (cpu, cuda, meta) = unsafe {
            ((a.aoti_torch_device_type_cpu)(), (a.aoti_torch_device_type_cuda)(), (a.aoti_torch_device_type_meta)())
        };
        Ok(match code {
            c if c == cpu => DeviceType::Cpu,
            c if c == cuda => DeviceType::Cuda,
            c if c == meta => DeviceType::Meta,
            c => DeviceType::Other(c),
        })
    }

    /// The shim's device-type code.
    pub fn code(self) -> Result<i32> {
        let a = api()?;
        // SAFETY: argument-less constant getters.
        Ok(unsafe {
            match self {
                DeviceType::Cpu => (a.aoti_torch_device_type_cpu)(),
                DeviceType::Cuda => (a.aoti_torch_device_type_cuda)(),
                DeviceType::Meta => (a.aoti_torch_device_type_meta)(),
                DeviceType::Other(c) => c,
            }
        })
    }
}

/// A device: type and index (-1 for "the current one" / not applicable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    /// The device type.
    pub kind: DeviceType,
    /// The device index.
    pub index: i32,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.kind {
            DeviceType::Cpu => "cpu".to_string(),
            DeviceType::Cuda => "cuda".to_string(),
            DeviceType::Meta => "meta".to_string(),
            DeviceType::Other(c) => format!("device type {c}"),
        };
        if self.index >= 0 && self.kind != DeviceType::Cpu {
            write!(f, "{name}:{}", self.index)
        } else {
            f.write_str(&name)
        }
    }
}
