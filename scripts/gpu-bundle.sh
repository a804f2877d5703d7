#!/usr/bin/env bash
# Builds here what scripts/gpu-run.sh needs on a GPU machine that has torch but
# no Rust toolchain (such as the lent device machines, which reach no network):
# the wheel and the CUDA test, bench and example binaries, stripped, in .gpu/
# (ignored by git, about 21 MB; carry it there). Then, on the GPU machine, in
# the repo root: bash scripts/gpu-run.sh [checks|bench|report|all|verify|ab] [OUT_DIR]
#
# KEEL_BASELINE=REV (a git revision) also builds REV's wheel, from a temporary
# worktree, into .gpu/baseline/ (5 MB more; its cargo build is cached in
# target/baseline): gpu-run.sh's ab step then times it against this tree's on
# the same GPU. .gpu/REV and .gpu/baseline/REV name the two.
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

if [ -n "${KEEL_BASELINE:-}" ]; then
  rev="$(git rev-parse --short "$KEEL_BASELINE^{commit}")"
  tree="$(mktemp -d)/keel-$rev"
  git worktree add -q --detach "$tree" "$rev"
  trap 'git worktree remove --force "$tree"' EXIT
  mkdir -p "$bundle/baseline"
  CARGO_TARGET_DIR="$root/target/baseline" \
    python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$bundle/baseline" "$tree"
  echo "$rev" > "$bundle/baseline/REV"
fi

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
