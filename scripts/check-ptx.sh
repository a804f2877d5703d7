#!/usr/bin/env bash
# CI check: ptx/ matches kernels-cuda/ under the pinned nvcc, ptxas reports no
# register spills for sm_80 and sm_90, and CUDA 12.0's ptxas (the PTX JIT of the
# oldest driver a torch >= 2.10 CUDA build runs on, R525) assembles every file.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/regen-ptx.sh" "$tmp" >/dev/null
source "$root/scripts/nvcc-env.sh"
if ! diff -r "$tmp" "$root/ptx" >/dev/null; then
  echo "ptx/ is stale: run scripts/regen-ptx.sh and commit the result" >&2
  diff -r "$tmp" "$root/ptx" | head -20 >&2
  exit 1
fi
status=0
# The kernels of a PTX file (argv[1]) that declare no .maxntid and use more
# than 56 registers in ptxas -v's report (stdin), rotary's excepted.
unbounded_near_64='
import re, sys
ptx = open(sys.argv[1]).read()
bounded = set(re.findall(r"\.entry (\w+)\([^)]*\)\s*\.maxntid", ptx))
report = sys.stdin.read()
for name, regs in re.findall(r"entry function .(\w+). for .*?Used (\d+) registers", report, re.S):
    if name not in bounded and int(regs) > 56 and not name.startswith("rotary_"):
        print(f"{name}: {regs} registers without __launch_bounds__ (56 at most)")
'
for ptx in "$root"/ptx/*.ptx; do
  for arch in sm_80 sm_90; do
    report="$("$KEEL_PTXAS" -v -arch=$arch "$ptx" -o /dev/null 2>&1)"
    spills="$(grep -E '[1-9][0-9]* bytes spill (stores|loads)' <<<"$report" || true)"
    if [ -n "$spills" ]; then
      echo "ptxas $arch $(basename "$ptx"): register spills" >&2
      echo "$spills" >&2
      status=1
    fi
    # A kernel without __launch_bounds__ (.maxntid) may be launched with
    # blocks of 1024 threads (rows_config), which fit an SM's 65536 registers
    # only at 64 a thread or fewer; past that the launch fails on a GPU
    # (rotary's blocks are 256 threads, ops/rotary.rs: at most 255 fit). The
    # driver compiles the PTX again for the GPU at hand with its own ptxas,
    # whose count may differ from this one's: an unbounded kernel keeps one
    # allocation step (8 registers a thread) below 64, a bounded one must fit.
    over="$(python3 -c "$unbounded_near_64" "$ptx" <<<"$report")"
    if [ -n "$over" ]; then
      echo "ptxas $arch $(basename "$ptx"): kernels too near the 64 registers a block of 1024 threads allows" >&2
      echo "$over" >&2
      status=1
    fi
    kernels=$(grep -c "Compiling entry function" <<<"$report")
    echo "ptxas -arch=$arch $(basename "$ptx"): $kernels kernels, no spills"
    if ! old="$("$KEEL_PTXAS_OLDEST" -arch=$arch "$ptx" -o /dev/null 2>&1)"; then
      echo "CUDA 12.0's ptxas refuses $(basename "$ptx") for $arch (see kernels-cuda/ptx-isa.txt):" >&2
      echo "$old" | head -5 >&2
      status=1
    fi
  done
done
[ "$status" = 0 ] && echo "CUDA 12.0's ptxas assembles every file for sm_80 and sm_90 (PTX ISA $(tr -d '[:space:]' < "$root/kernels-cuda/ptx-isa.txt"))"
exit $status
