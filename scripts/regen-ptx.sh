#!/usr/bin/env bash
# Regenerates ptx/ from kernels-cuda/*.cu with the pinned nvcc (scripts/nvcc-env.sh),
# using the same flags as build.rs (kernels-cuda/nvcc-flags.txt), and like build.rs
# lowers each file's `.version` to kernels-cuda/ptx-isa.txt where nvcc wrote a newer
# one (so that drivers from that CUDA release on can JIT it; check-ptx.sh proves it).
# Usage: scripts/regen-ptx.sh [OUT_DIR]   (default: ptx/)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/ptx}"
source "$root/scripts/nvcc-env.sh"
mkdir -p "$out"
isa="$(tr -d '[:space:]' < "$root/kernels-cuda/ptx-isa.txt")"
for src in "$root"/kernels-cuda/*.cu; do
  name="$(basename "${src%.cu}")"
  # shellcheck disable=SC2046
  "$KEEL_NVCC" $(cat "$root/kernels-cuda/nvcc-flags.txt") -I "$root/kernels-cuda" -o "$out/$name.ptx" "$src"
  declared="$(sed -n 's/^\.version //p' "$out/$name.ptx" | head -n1)"
  if [ "$(printf '%s\n' "$declared" "$isa" | sort -V | tail -n1)" != "$isa" ]; then
    sed -i "0,/^\.version $declared\$/s//.version $isa/" "$out/$name.ptx"
  fi
done
echo "PTX written to $out"
