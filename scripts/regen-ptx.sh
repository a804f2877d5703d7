#!/usr/bin/env bash
# Regenerates ptx/ from kernels-cuda/*.cu with the pinned nvcc (scripts/nvcc-env.sh),
# using the same flags as build.rs (kernels-cuda/nvcc-flags.txt).
# Usage: scripts/regen-ptx.sh [OUT_DIR]   (default: ptx/)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/ptx}"
source "$root/scripts/nvcc-env.sh"
mkdir -p "$out"
for src in "$root"/kernels-cuda/*.cu; do
  name="$(basename "${src%.cu}")"
  # shellcheck disable=SC2046
  "$KEEL_NVCC" $(cat "$root/kernels-cuda/nvcc-flags.txt") -I "$root/kernels-cuda" -o "$out/$name.ptx" "$src"
done
echo "PTX written to $out"
