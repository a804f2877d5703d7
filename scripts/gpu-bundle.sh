#!/usr/bin/env bash
# Builds here what scripts/gpu-run.sh needs on a GPU machine that has torch but
# no Rust toolchain (such as the lent device machines, which reach no network):
# the wheel and the CUDA test, bench and example binaries, stripped, in .gpu/
# (ignored by git, about 21 MB; carry it there). Then, on the GPU machine, in
# the repo root: bash scripts/gpu-run.sh [checks|bench|report|all|verify|ab] [OUT_DIR]
#
# KEEL_BASELINE="REV ..." (git revisions or branch names) also builds each
# one's wheel, from a temporary worktree, into .gpu/baseline/NAME/ (NAME: the
# word as given, / made -; 5 MB each; the cargo builds are cached in
# target/baseline): gpu-run.sh's ab step then times each against this tree's
# on the same GPU. A kernel variant on a branch is measured the same way.
# .gpu/REV and .gpu/baseline/NAME/REV name them.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
bundle="$root/.gpu"
rm -rf "$bundle"
mkdir -p "$bundle"

build_wheel
cp "$WHEEL" "$bundle/"
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo +changes)" > "$bundle/REV"

# A temporary worktree per baseline, removed on exit.
trees=()
trap 'for t in "${trees[@]}"; do git worktree remove --force "$t"; done' EXIT
for want in ${KEEL_BASELINE:-}; do
  rev="$(git rev-parse --short "$want^{commit}")"
  name="${want//\//-}"
  tree="$(mktemp -d)/keel-$rev"
  git worktree add -q --detach "$tree" "$rev"
  trees+=("$tree")
  mkdir -p "$bundle/baseline/$name"
  CARGO_TARGET_DIR="$root/target/baseline" zig_wheel "$tree" "$bundle/baseline/$name"
  if [ "$name" = "$rev" ]; then echo "$rev"; else echo "$name ($rev)"; fi > "$bundle/baseline/$name/REV"
done

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
