#!/usr/bin/env bash
# The CPU kernels as an aarch64 (ARM64) machine builds and runs them: the
# workspace linted for that target (its code paths differ: no x86 kernels,
# pulp's NEON level), then the CPU unit and property tests cross-compiled and
# run under qemu's user-mode emulation. Installs what it needs (the Rust
# target, a cross linker, qemu) where it can; where it cannot, it says so and
# skips, as the GPU tests do without a GPU. A failing lint or test fails.
#
# Then a few of the tests that run the CUDA kernels' source on the CPU
# emulation (src/cuda/emu.rs), built by the aarch64 C++ cross compiler and
# loaded into the aarch64 test binary: there the emulated threads switch
# through glibc's ucontext (x86-64 has its own switch), and the kernels'
# source builds for another host. Three fast tests (10-15 s); all seven took
# 870 s under qemu (session 68, all passed), so CI runs them natively only.
#
# Under qemu two prefault tests are skipped: qemu-user takes `madvise` as a
# hint it may ignore (MADV_POPULATE_WRITE returns success and populates
# nothing), so the pages those tests look for are not there. Real aarch64
# kernels populate (Linux 5.14 on).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/aarch64-tools.sh
target=aarch64-unknown-linux-gnu
# Tests that cannot pass under qemu-user (see above).
qemu_skips=(prefault::tests::populates_fresh_memory prefault::tests::probe_faults_the_frame_at_the_chosen_end)
skip() { echo "SKIPPED (aarch64): $*"; exit 0; }

aarch64_tools || skip "$AARCH64_MISSING"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# The emulated CUDA tests build their library with the host's compiler,
# which an aarch64 process cannot load: in a cross build they skip, saying so
# (src/cuda/emu.rs), unless KEEL_EMU_CXX names a compiler for the target (the
# subset at the end). They all run natively in scripts/test.sh.
require_emu="${KEEL_REQUIRE_CUDA_EMU:-0}"
unset KEEL_REQUIRE_CUDA_EMU KEEL_EMU_CXX

echo "clippy, $target"
cargo clippy --workspace --all-targets -q --target "$target" -- -D warnings
echo "CPU unit and property tests, $target, under $(qemu-aarch64 --version | head -n 1)"
skip_args=()
for t in "${qemu_skips[@]}"; do skip_args+=(--skip "$t"); done
out="$(cargo test --workspace --profile ci -q --target "$target" --lib --test '*_cpu' -- "${skip_args[@]}" 2>&1)" \
  || { echo "$out"; echo "aarch64 tests failed" >&2; exit 1; }
grep -E '^test result' <<<"$out"
echo "skipped under qemu (madvise ignored): ${qemu_skips[*]}"

emu_tests=(emulated_norms_and_rotary_give_the_same_bits_without_vectors emulated_rms_norm_of_zero_width_rows_is_a_no_op
  emulated_rms_norm_teams_give_the_bits_of_a_warp)
if command -v aarch64-linux-gnu-g++ >/dev/null; then
  echo "CUDA kernels' source on the emulation, built by aarch64-linux-gnu-g++, under qemu: ${emu_tests[*]}"
  out="$(KEEL_EMU_CXX=aarch64-linux-gnu-g++ KEEL_REQUIRE_CUDA_EMU="$require_emu" \
    cargo test -p keel --profile ci -q --target "$target" --lib -- --exact "${emu_tests[@]/#/ops::emu_tests::layouts::}" 2>&1)" \
    || { echo "$out"; echo "aarch64 emulated CUDA tests failed" >&2; exit 1; }
  grep -E '^test result' <<<"$out"
  grep -q "^test result: ok. ${#emu_tests[@]} passed" <<<"$out" || { echo "$out"; echo "expected ${#emu_tests[@]} tests to run" >&2; exit 1; }
else
  echo "SKIPPED (aarch64): the emulated CUDA tests (no aarch64-linux-gnu-g++, and it could not be installed)"
fi
