#!/usr/bin/env bash
# CI check: the kernels that promise the same bits whatever a row's layout
# (a vector loop and an element-wise one) leave no f32 multiply-add for the
# compiler to fuse, so the GPU rounds exactly where the source says (fmaf,
# mul_rn, add_rn) and the CPU emulation's same-bits test
# (emulated_norms_and_rotary_give_the_same_bits_without_vectors, built without
# FMA contraction) holds on a GPU too. An H200 run found rms_norm's backward
# differing by one bit between the two loops where nvcc had fused them
# differently (docs/GPU.md).
#
# Both compilers are asked:
# - nvcc: the PTX with -fmad=false equals the default build's once `.rn` is
#   dropped (with -fmad=false nvcc marks every product and sum `.rn`, which
#   ptxas never fuses; any other difference is an FMA nvcc made on its own);
# - ptxas: that default PTX (what ptx/ holds, check-ptx.sh checks) assembles,
#   for sm_80 and sm_90, to the same SASS with --fmad=true as with
#   --fmad=false (nvdisasm; the options string aside). nvcc leaves most fusing
#   to ptxas: a plain `a * c - b * s` passes the first check and fails this one.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/nvcc-env.sh"
files="rms_norm fused_add_rms_norm layer_norm rotary"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mapfile -t flags < "$root/kernels-cuda/nvcc-flags.txt"
status=0
for f in $files; do
  src="$root/kernels-cuda/$f.cu"
  "$KEEL_NVCC" "${flags[@]}" -I"$root/kernels-cuda" "$src" -o "$tmp/default.ptx"
  "$KEEL_NVCC" "${flags[@]}" -fmad=false -I"$root/kernels-cuda" "$src" -o "$tmp/nofmad.ptx"
  if ! diff <(sed 's/\.rn\.f32/.f32/g' "$tmp/nofmad.ptx") <(sed 's/\.rn\.f32/.f32/g' "$tmp/default.ptx") > "$tmp/d"; then
    echo "nvcc fuses a multiply-add in kernels-cuda/$f.cu that the source leaves to the compiler:" >&2
    head -8 "$tmp/d" >&2
    status=1
  fi
  for arch in sm_80 sm_90; do
    for fmad in true false; do
      "$KEEL_PTXAS" -arch=$arch --fmad=$fmad "$tmp/default.ptx" -o "$tmp/$fmad.cubin"
      "$KEEL_NVDISASM" "$tmp/$fmad.cubin" | grep -v '\.string.*-fmad' > "$tmp/$fmad.sass"
    done
    if ! diff "$tmp/true.sass" "$tmp/false.sass" > "$tmp/d"; then
      echo "ptxas -arch=$arch fuses a multiply-add in kernels-cuda/$f.cu:" \
        "$(grep -c FFMA "$tmp/true.sass") FFMA with --fmad=true, $(grep -c FFMA "$tmp/false.sass") without" >&2
      grep -E '^[<>].*F(FMA|MUL|ADD)' "$tmp/d" | head -6 >&2 || true
      status=1
    fi
  done
  [ "$status" = 0 ] && echo "$f: no multiply-add left to nvcc or ptxas (sm_80, sm_90)"
done
exit $status
