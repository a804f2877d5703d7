//! Test-only: the kernels of `kernels-cuda/` run on the CPU, as a [`Target`].
//!
//! Each module's `.cu` is compiled by the host C++ compiler against
//! `kernels-cuda/emu/` (blocks one after another, the threads of a block as
//! fibers that switch at `__syncthreads` and warp shuffles; see `emu.h`), with
//! NVIDIA's `cuda_fp16.h` / `cuda_bf16.h` for the element types. The entry
//! points' own launch code (checks, grid shapes, argument lists, the order of
//! launches, scratch sizes) then runs unchanged against it, on host memory
//! from [`Buf`], which has guard pages on both sides.
//!
//! This runs the kernels' source, not the PTX that nvcc makes from it, and
//! no CUDA driver, stream or memory: it is not a test on a GPU.
use super::{Arg, Module, NormKeep, Target};
use crate::error::{Error, Result};
use cudarc::driver::LaunchConfig;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// `keel_emu_launch(name, signature, grid, block, params, reverse, err, err_len)`.
type LaunchFn =
    unsafe extern "C" fn(*const c_char, *const c_char, u32, u32, *mut *mut c_void, c_int, *mut c_char, usize) -> c_int;

/// A compiled module: its `keel_emu_launch` (the library stays loaded).
struct Lib {
    launch: LaunchFn,
}

/// The emulated device: its SM count sizes the grids, as a GPU's does;
/// `reverse` runs each block's threads in the opposite order between barriers;
/// `capturing` plays a stream being captured into a CUDA graph, on which a
/// read back fails as the driver's would; `checks_targets` is
/// [`Target::checks_targets`]'s setting (off, a read back fails too);
/// `norm_keep` is [`Target::norm_keep`]'s choice (the environment's on a GPU).
pub(crate) struct Emu {
    pub(crate) sm_count: u32,
    pub(crate) reverse: bool,
    pub(crate) capturing: bool,
    pub(crate) checks_targets: bool,
    pub(crate) norm_keep: NormKeep,
}

impl Emu {
    /// A device of `sm_count` SMs, threads in order, not capturing,
    /// checking cross_entropy's targets, the norms' reload backward kernels.
    pub(crate) fn new(sm_count: u32) -> Self {
        Emu { sm_count, reverse: false, capturing: false, checks_targets: true, norm_keep: NormKeep::Reload }
    }
}

/// Why the emulation cannot run here (no C++ compiler, no CUDA headers), or
/// `None` when it can. With `KEEL_REQUIRE_CUDA_EMU=1` (CI) that is a failure
/// rather than a skip.
pub(crate) fn unavailable() -> Option<String> {
    let why = toolchain().as_ref().err().cloned();
    if let Some(why) = &why {
        assert!(std::env::var_os("KEEL_REQUIRE_CUDA_EMU").is_none_or(|v| v == "0"), "CUDA emulation required: {why}");
    }
    why
}

/// The C++ compiler with the flags its sanitizer runtime needs, and the CUDA
/// include directory, looked for once per process (every test, proptest case
/// and module build asks).
fn toolchain() -> &'static std::result::Result<(Cxx, PathBuf), String> {
    static FOUND: OnceLock<std::result::Result<(Cxx, PathBuf), String>> = OnceLock::new();
    FOUND.get_or_init(|| Ok((cxx()?, cuda_include()?)))
}

/// A C++ compiler (`$KEEL_EMU_CXX`, else `$CXX`, else g++; in a cross build
/// only `$KEEL_EMU_CXX`, since the others build for the host) and what a
/// shared library built with `-fsanitize=alignment` must be linked with to
/// load.
#[derive(Clone)]
struct Cxx {
    path: String,
    link_args: Vec<String>,
}

fn cxx() -> std::result::Result<Cxx, String> {
    let cross = env!("KEEL_CROSS_BUILD");
    let path = match std::env::var("KEEL_EMU_CXX") {
        Ok(path) => path,
        Err(_) if cross.is_empty() => std::env::var("CXX").unwrap_or_else(|_| "g++".into()),
        Err(_) => {
            let why = "the C++ compiler builds for the host (set KEEL_EMU_CXX to one for this target)";
            return Err(format!("a cross build ({cross}): {why}"));
        }
    };
    let version = match Command::new(&path).arg("--version").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        _ => return Err(format!("no C++ compiler ({path}; set KEEL_EMU_CXX or CXX)")),
    };
    // g++ links a shared library to its sanitizer runtime (libubsan.so, on
    // the loader's path). clang leaves the runtime to the executable, so a
    // library loaded into a Rust test fails with undefined __ubsan_handle_*
    // symbols: link clang's shared runtime, and find it where clang keeps it.
    let mut link_args = Vec::new();
    if version.contains("clang") {
        link_args.push("-shared-libsan".to_string());
        match Command::new(&path).arg("-print-runtime-dir").output() {
            Ok(o) if o.status.success() => {
                link_args.push(format!("-Wl,-rpath,{}", String::from_utf8_lossy(&o.stdout).trim()))
            }
            _ => {}
        }
    }
    Ok(Cxx { path, link_args })
}

/// The directory holding `cuda_bf16.h`: `$KEEL_CUDA_INCLUDE`, beside
/// `$KEEL_NVCC` (scripts/nvcc-env.sh), the repo's `.venv-nvcc`, `$CUDA_HOME`.
fn cuda_include() -> std::result::Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("KEEL_CUDA_INCLUDE") {
        candidates.push(p.into());
    }
    if let Some(nvcc) = std::env::var_os("KEEL_NVCC") {
        candidates.extend(Path::new(&nvcc).parent().and_then(Path::parent).map(|p| p.join("include")));
    }
    if let Ok(libs) = std::fs::read_dir(root.join(".venv-nvcc/lib")) {
        candidates.extend(libs.flatten().map(|d| d.path().join("site-packages/nvidia/cu13/include")));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        candidates.push(Path::new(&home).join("include"));
    }
    candidates
        .into_iter()
        .find(|d| d.join("cuda_bf16.h").is_file())
        .ok_or_else(|| "no cuda_bf16.h (run scripts/nvcc-env.sh, or set KEEL_CUDA_INCLUDE)".into())
}

/// The `.entry` names of a PTX module.
fn entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap_or(l).trim())
        .collect()
}

/// Compiles `kernels-cuda/{module.0}.cu` with a launch table of the entries of
/// its PTX (so every kernel that Rust can ask for exists in C++).
fn build(module: Module) -> std::result::Result<Lib, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (Cxx { path: cxx, link_args }, include) = toolchain().clone()?;
    let dir = Path::new(env!("OUT_DIR")).join("cuda-emu");
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let stem = module.0;
    let rows: String = entries(module.1)
        .iter()
        .map(|k| format!("    {{\"{k}\", keel_emu::Call<&{k}>::signature, &keel_emu::Call<&{k}>::run}},\n"))
        .collect();
    let src = format!(
        r#"#include "{stem}.cu"
extern "C" int keel_emu_launch(const char* name, const char* signature, unsigned grid, unsigned block,
                               void** params, int reverse, char* err, size_t err_len) {{
  static const struct {{ const char* name; const char* signature; keel_emu::Invoker run; }} kernels[] = {{
{rows}  }};
  for (const auto& k : kernels) {{
    if (strcmp(k.name, name) != 0) continue;
    if (strcmp(k.signature, signature) != 0) {{
      snprintf(err, err_len, "%s takes (%s), launched with (%s)", name, k.signature, signature);
      return 1;
    }}
    return keel_emu::run_grid(name, k.run, grid, block, params, reverse, err, err_len);
  }}
  snprintf(err, err_len, "no kernel %s in {stem}.cu", name);
  return 1;
}}
"#
    );
    let tag = format!("{stem}-{}", std::process::id());
    let (cpp, so) = (dir.join(format!("{tag}.cpp")), dir.join(format!("lib{tag}.so")));
    std::fs::write(&cpp, src).map_err(|e| format!("writing {}: {e}", cpp.display()))?;
    let (cuda_dir, emu_dir) = (root.join("kernels-cuda"), root.join("kernels-cuda/emu"));
    let out = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Wno-unknown-pragmas",
            "-fsanitize=alignment",
            "-fno-sanitize-recover=alignment",
            "-include",
            "emu.h",
            "-I",
        ])
        .arg(&emu_dir)
        .arg("-I")
        .arg(&cuda_dir)
        .arg("-I")
        .arg(&include)
        .arg(&cpp)
        .arg(emu_dir.join("runtime.cpp"))
        .args(&link_args)
        .arg("-o")
        .arg(&so)
        .output()
        .map_err(|e| format!("running {cxx}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cxx} failed on {stem}.cu:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    let c_so = CString::new(so.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: a library we just built; its initialisers only set globals.
    let handle = unsafe { libc::dlopen(c_so.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: no arguments; it returns this thread's last dl* error.
        let why = unsafe { libc::dlerror() };
        let why = match why.is_null() {
            true => "no reason given".into(),
            // SAFETY: a NUL-terminated message, valid until the next dl* call.
            false => unsafe { CStr::from_ptr(why) }.to_string_lossy(),
        };
        return Err(format!("dlopen {} failed: {why}", so.display()));
    }
    // The mapping outlives the files.
    let _ = std::fs::remove_file(&cpp);
    let _ = std::fs::remove_file(&so);
    // SAFETY: a valid handle; the symbol name is NUL-terminated.
    let sym = unsafe { libc::dlsym(handle, c"keel_emu_launch".as_ptr()) };
    if sym.is_null() {
        return Err("keel_emu_launch missing".into());
    }
    // SAFETY: the symbol is the function defined above, with this signature.
    Ok(Lib { launch: unsafe { std::mem::transmute::<*mut c_void, LaunchFn>(sym) } })
}

/// A compiled module, built once per process. Each module has its own cell,
/// so that two modules build at once (a few seconds of the C++ compiler
/// each) while a launch of a third runs.
fn lib(module: Module) -> &'static std::result::Result<Lib, String> {
    type Cell = OnceLock<std::result::Result<Lib, String>>;
    static CELLS: OnceLock<Mutex<HashMap<&'static str, &'static Cell>>> = OnceLock::new();
    let cell: &'static Cell = {
        let mut cells = CELLS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        cells.entry(module.0).or_insert_with(|| Box::leak(Box::default()))
    };
    cell.get_or_init(|| build(module))
}

/// Serialises launches: a block's shared memory is a static in its library,
/// and each launch sets process-wide signal handlers and a timer.
static LAUNCH: Mutex<()> = Mutex::new(());

fn emu_error(kernel: &str, msg: impl Into<String>) -> Error {
    Error::Emu { kernel: kernel.into(), msg: msg.into() }
}

/// The most threads a block of `kernel` may have, read from its PTX in
/// `ptx`: its `.maxntid` (`__launch_bounds__`), which a GPU refuses a larger
/// block for, or 1024 (the hardware's) where it declares none.
/// (scripts/check-ptx.sh holds every kernel without one to 64 registers, so
/// that a block of 1024 fits: a layer_norm forward that took 79 would have
/// failed to launch for rows of more than about 12800 f32.) `None` where
/// the PTX has no such kernel.
fn max_block(ptx: &str, kernel: &str) -> Option<u32> {
    let entry = ptx.find(&format!(".entry {kernel}("))?;
    let head = &ptx[entry..];
    let head = &head[..head.find('{').unwrap_or(head.len())];
    let bound = head.lines().find_map(|l| l.trim().strip_prefix(".maxntid "));
    Some(bound.map_or(1024, |b| b.split(',').map(|n| n.trim().parse::<u32>().unwrap_or(0)).product()))
}

impl Target for Emu {
    fn sm_count(&self) -> u32 {
        self.sm_count
    }

    fn norm_keep(&self, _op: &'static str) -> Result<NormKeep> {
        Ok(self.norm_keep)
    }

    unsafe fn launch(&self, module: Module, kernel: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        if (g.1, g.2, b.1, b.2, cfg.shared_mem_bytes) != (1, 1, 1, 1, 0) {
            return Err(emu_error(kernel, format!("only 1-D launches without dynamic shared memory: {cfg:?}")));
        }
        // A block over the kernel's declared bound, which a GPU refuses.
        match max_block(module.1, kernel) {
            Some(max) if b.0 <= max => {}
            Some(max) => {
                return Err(emu_error(
                    kernel,
                    format!("a block of {} threads, where its PTX's __launch_bounds__ allow {max}", b.0),
                ))
            }
            None => return Err(emu_error(kernel, format!("no such kernel in the PTX of {}", module.0))),
        }
        // Each argument in an 8-byte slot (little-endian), as kernelParams points to.
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(v) => v,
                Arg::I64(v) => v as u64,
                Arg::I32(v) => v as u32 as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let signature: String = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(_) => 'p',
                Arg::I64(_) => 'l',
                Arg::I32(_) => 'i',
                Arg::F32(_) => 'f',
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
        let lib = lib(module).as_ref().map_err(|e| emu_error(kernel, e.clone()))?;
        let _launch = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
        let (name, signature) = (CString::new(kernel).unwrap(), CString::new(signature).unwrap());
        let mut err = vec![0 as c_char; 512];
        // SAFETY: params point to one slot per argument, which the signature
        // check matches to the kernel's parameters; pointers per our contract.
        let status = unsafe {
            (lib.launch)(
                name.as_ptr(),
                signature.as_ptr(),
                g.0,
                b.0,
                params.as_mut_ptr(),
                self.reverse as c_int,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if status != 0 {
            // SAFETY: the library wrote a NUL-terminated message into `err`.
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            return Err(emu_error(kernel, msg));
        }
        Ok(())
    }

    fn capturing(&self) -> Result<bool> {
        Ok(self.capturing)
    }

    fn checks_targets(&self) -> bool {
        self.checks_targets
    }

    unsafe fn read_i32s(&self, what: &str, src: u64, dst: &mut [i32]) -> Result<()> {
        if self.capturing {
            return Err(emu_error(what, "a synchronising read during stream capture (it would invalidate the graph)"));
        }
        if !self.checks_targets {
            return Err(emu_error(what, "a synchronising read with the target checks off"));
        }
        // SAFETY: `src` is host memory holding `dst.len()` i32s (our contract).
        unsafe { std::ptr::copy_nonoverlapping(src as *const i32, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

/// Host memory standing in for a device buffer: `len` elements that end where
/// an inaccessible page begins (rounded up to 16 bytes), with another such
/// page before. The bytes between the elements and the 16-byte boundaries
/// around them hold a pattern that [`Buf::to_vec`] checks.
pub(crate) struct Buf<T> {
    map: *mut c_void,
    map_len: usize,
    data: *mut T,
    len: usize,
    _t: PhantomData<T>,
}

const PAGE: usize = 4096;
const SLACK: u8 = 0xA5;

impl<T: Copy> Buf<T> {
    /// A buffer holding a copy of `v` that starts `shift` elements after a
    /// 16-byte boundary (as a view into a larger tensor may). The elements
    /// before it are readable, the end is still at the guard page.
    pub(crate) fn shifted(v: &[T], shift: usize) -> Self {
        let size = std::mem::size_of::<T>();
        let bytes = std::mem::size_of_val(v);
        let padded = (shift * size + bytes).div_ceil(16) * 16;
        let pages = padded.div_ceil(PAGE).max(1);
        let map_len = (pages + 2) * PAGE;
        // SAFETY: an anonymous private mapping; checked below.
        let map = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(map, libc::MAP_FAILED, "mmap");
        // SAFETY: the pages between the two guards are ours to open.
        let body = unsafe { (map as *mut u8).add(PAGE) };
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: `body .. body + pages * PAGE` lies inside the mapping.
        assert_eq!(unsafe { libc::mprotect(body as *mut c_void, pages * PAGE, rw) }, 0, "mprotect");
        // SAFETY: `start .. start + padded` lies in the opened pages and starts
        // on a 16-byte boundary; `v` does not overlap a fresh mapping.
        let data = unsafe {
            let start = body.add(pages * PAGE - padded);
            std::ptr::write_bytes(start, SLACK, padded);
            let data = start.add(shift * size);
            std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, data, bytes);
            data as *mut T
        };
        Buf { map, map_len, data, len: v.len(), _t: PhantomData }
    }

    /// The device address the kernels see.
    pub(crate) fn addr(&self) -> u64 {
        self.data as u64
    }

    /// The contents; panics when a kernel wrote into the slack past the end.
    pub(crate) fn to_vec(&self) -> Vec<T> {
        let bytes = self.len * std::mem::size_of::<T>();
        let (at, end) = (self.data as usize, self.data as usize + bytes);
        let (lead, slack) = (at % 16, end.next_multiple_of(16) - end);
        // SAFETY: from the 16-byte boundary before `data` to the one after its
        // end is the opened, initialised region.
        let all = unsafe { std::slice::from_raw_parts((at - lead) as *const u8, lead + bytes + slack) };
        let outside = all[..lead].iter().chain(&all[lead + bytes..]);
        assert!(outside.into_iter().all(|&b| b == SLACK), "a kernel wrote outside a buffer");
        // SAFETY: the first `len` elements were written as `T`s.
        unsafe { std::slice::from_raw_parts(self.data as *const T, self.len) }.to_vec()
    }
}

impl<T> Drop for Buf<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `shifted`, unmapped once.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::max_block;

    /// `.maxntid` between an entry's parameters and its body, else 1024; a
    /// kernel the PTX lacks is `None`. Then the committed PTX's own.
    #[test]
    fn max_block_reads_the_entrys_bound_or_allows_1024() {
        let ptx = ".visible .entry a_f32(\n\t.param .u64 a_f32_param_0\n)\n.maxntid 1024, 1, 1\n{\n}\n\
                   .visible .entry b_f32(\n\t.param .u64 b_f32_param_0\n)\n{\n}\n\
                   .visible .entry c_f32(\n)\n.maxntid 16, 2, 1\n{\n}\n";
        assert_eq!(max_block(ptx, "a_f32"), Some(1024));
        assert_eq!(max_block(ptx, "b_f32"), Some(1024));
        assert_eq!(max_block(ptx, "c_f32"), Some(32));
        assert_eq!(max_block(ptx, "d_f32"), None);
        assert_eq!(max_block(crate::ptx::SOFTMAX, "softmax_fwd_f32"), Some(1024));
        assert_eq!(max_block(crate::ptx::LAYER_NORM, "layer_norm_bwd2h_f32"), Some(256));
        assert_eq!(max_block(crate::ptx::ROTARY, "rotary_f32"), Some(1024));
    }
}
