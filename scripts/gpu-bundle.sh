#!/usr/bin/env bash
# Builds here what scripts/gpu-run.sh needs on a GPU machine that has torch but
# no Rust toolchain (such as the lent device machines, which reach no network):
# the wheel and the CUDA test, bench and example binaries, stripped, in .gpu/
# (ignored by git, about 18 MB; carry it there). Then, on the GPU machine, in
# the repo root: bash scripts/gpu-run.sh [checks|bench|report|all] [OUT_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
bundle="$root/.gpu"
rm -rf "$bundle"
mkdir -p "$bundle"

build_wheel
cp "$WHEEL" "$bundle/"

# The executables cargo builds, by target name, from its JSON messages.
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}
{
  cargo test --release --no-run --test ops_cuda --test rms_norm_cuda --message-format=json
  cargo bench --no-run --bench cuda --message-format=json
  cargo build --release --example rms_norm --message-format=json
} 2>/dev/null | executables | while read -r name exe; do
  # The bench target is named "cuda"; the tests and the example keep their names.
  dest="$bundle/$name"
  [ "$name" = cuda ] && dest="$bundle/bench_cuda"
  cp "$exe" "$dest"
  strip "$dest" 2>/dev/null || true
done
for f in ops_cuda rms_norm_cuda bench_cuda rms_norm; do
  [ -x "$bundle/$f" ] || { echo "gpu-bundle: $f was not built" >&2; exit 1; }
done
ls -la "$bundle"
du -sh "$bundle"
