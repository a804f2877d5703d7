#!/usr/bin/env bash
# The CPU kernels as an aarch64 (ARM64) machine builds and runs them: the
# workspace linted for that target (its code paths differ: no x86 kernels,
# pulp's NEON level), then the CPU unit and property tests cross-compiled and
# run under qemu's user-mode emulation. Installs what it needs (the Rust
# target, a cross linker, qemu) where it can; where it cannot, it says so and
# skips, as the GPU tests do without a GPU. A failing lint or test fails.
#
# Under qemu two prefault tests are skipped: qemu-user takes `madvise` as a
# hint it may ignore (MADV_POPULATE_WRITE returns success and populates
# nothing), so the pages those tests look for are not there. Real aarch64
# kernels populate (Linux 5.14 on).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/apt.sh
target=aarch64-unknown-linux-gnu
# Tests that cannot pass under qemu-user (see above).
qemu_skips=(prefault::tests::populates_fresh_memory prefault::tests::probe_faults_the_frame_at_the_chosen_end)
skip() { echo "SKIPPED (aarch64): $*"; exit 0; }

if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" >/dev/null 2>&1 || skip "rustup could not add the $target target"
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  apt_install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user || true
  command -v aarch64-linux-gnu-gcc >/dev/null || skip "no aarch64-linux-gnu-gcc (cross linker), and it could not be installed"
  command -v qemu-aarch64 >/dev/null || skip "no qemu-aarch64, and it could not be installed"
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# The emulated CUDA tests build their library with the host's compiler,
# which an aarch64 process cannot load: in a cross build they skip, saying so
# (src/cuda/emu.rs), and they run natively in scripts/test.sh.
unset KEEL_REQUIRE_CUDA_EMU

echo "clippy, $target"
cargo clippy --workspace --all-targets -q --target "$target" -- -D warnings
echo "CPU unit and property tests, $target, under $(qemu-aarch64 --version | head -n 1)"
skip_args=()
for t in "${qemu_skips[@]}"; do skip_args+=(--skip "$t"); done
out="$(cargo test --workspace --release -q --target "$target" --lib --test '*_cpu' -- "${skip_args[@]}" 2>&1)" \
  || { echo "$out"; echo "aarch64 tests failed" >&2; exit 1; }
grep -E '^test result' <<<"$out"
echo "skipped under qemu (madvise ignored): ${qemu_skips[*]}"
