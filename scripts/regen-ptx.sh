#!/usr/bin/env bash
# Regenerates ptx/ from kernels-cuda/*.cu with the pinned nvcc (scripts/nvcc-env.sh).
# It runs build.rs itself (`cargo check` with NVCC set), so the committed files are
# exactly what a build with that nvcc embeds: same flags (kernels-cuda/nvcc-flags.txt),
# same lowering of each file's `.version` to kernels-cuda/ptx-isa.txt (so that drivers
# from that CUDA release on can JIT it; check-ptx.sh proves it). CI's check-ptx.sh
# calls this, which is also what exercises build.rs's nvcc branch there.
# Usage: scripts/regen-ptx.sh [OUT_DIR]   (default: ptx/)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/ptx}"
source "$root/scripts/nvcc-env.sh"
mkdir -p "$out"
# A target dir of its own: switching NVCC on and off in the main one would
# rebuild the root crate at every switch.
target="$root/target/regen-ptx"
msgs="$(NVCC="$KEEL_NVCC" cargo check -q -p keel --lib --target-dir "$target" --message-format=json)"
gen="$(python3 -c '
import json, os, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "build-script-executed" and os.path.isfile(os.path.join(msg["out_dir"], "ptx.rs")):
        print(msg["out_dir"])
' <<<"$msgs")"
[ -n "$gen" ] || { echo "regen-ptx: build.rs did not run (no ptx.rs in any OUT_DIR)" >&2; exit 1; }
grep -q "^pub const ORIGIN: &str = \"nvcc (" "$gen/ptx.rs" || {
  echo "regen-ptx: build.rs did not use nvcc:" >&2
  grep ORIGIN "$gen/ptx.rs" >&2
  exit 1
}
for src in "$root"/kernels-cuda/*.cu; do
  name="$(basename "${src%.cu}")"
  cp "$gen/$name.ptx" "$out/$name.ptx"
done
echo "PTX written to $out (by build.rs with $KEEL_NVCC)"
