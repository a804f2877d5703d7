//! Keel's PyTorch operators (namespace `keel`), registered through the stable
//! C ABI when torch loads this library (`torch.ops.load_library`).
//!
//! The only crate that knows both torch (`keel-abi`) and the kernels (`keel`).
//! Each op is one file: schema, argument checks, and one body that serves the
//! CPU, CUDA and Meta dispatch keys (Meta allocates outputs only, after the
//! same checks, so fake tensors and `torch.compile` see the same errors).
#![warn(missing_docs)]

mod abi_selftest;
mod capability;
mod checks;
mod cross_entropy;
mod device;
mod fused_add_rms_norm;
mod gated;
mod layer_norm;
mod registry;
mod rms_norm;
mod rotary;
mod softmax;
mod target_checks;
mod torch_pool;

/// Runs when the library is loaded: registers every op. Must not unwind.
/// Not in this crate's unit-test binary, which runs without torch (it would
/// only print that registering failed).
#[cfg_attr(test, allow(dead_code))]
extern "C" fn init() {
    match std::panic::catch_unwind(registry::register_all) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("keel: registering ops failed: {e}"),
        Err(_) => eprintln!("keel: registering ops panicked"),
    }
}

#[cfg(not(test))]
#[used]
#[cfg_attr(target_os = "linux", link_section = ".init_array")]
static INIT: extern "C" fn() = init;
