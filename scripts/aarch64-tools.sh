# Sourced by the aarch64 test scripts (test-aarch64.sh, test-aarch64-wheel.sh).
# aarch64_tools: what cross-testing for aarch64 takes, installed where missing
# and possible (rustup's target; Debian's cross gcc and g++ with the target's
# libc and libgcc_s; qemu's user-mode emulator). Returns 1 with the reason in
# AARCH64_MISSING where the target, aarch64-linux-gnu-gcc or qemu-aarch64 is
# still missing; g++ (the emulated CUDA tests' compiler) is optional.
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"
aarch64_tools() {
  AARCH64_MISSING=""
  rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu ||
    rustup target add aarch64-unknown-linux-gnu >/dev/null 2>&1 ||
    { AARCH64_MISSING="rustup could not add the aarch64-unknown-linux-gnu target"; return 1; }
  if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null \
    || ! command -v qemu-aarch64 >/dev/null; then
    apt_install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user || true
  fi
  command -v aarch64-linux-gnu-gcc >/dev/null ||
    { AARCH64_MISSING="no aarch64-linux-gnu-gcc (cross linker, libgcc_s), and it could not be installed"; return 1; }
  command -v qemu-aarch64 >/dev/null ||
    { AARCH64_MISSING="no qemu-aarch64, and it could not be installed"; return 1; }
}
