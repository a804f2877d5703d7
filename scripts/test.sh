#!/usr/bin/env bash
# Every test, from nothing: Rust lint and tests, the CUDA build checks, then the
# wheel built once and tested under torch 2.10 and under the newest torch (and
# on the oldest and newest CPython here besides the machine's python3).
# CUDA tests skip (saying why) where no GPU is found.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
source scripts/apt.sh
# Each step says when it began (time since the script started), so that a slow
# CI run's log shows where its time went.
clock() { printf '%dm%02ds' $((SECONDS / 60)) $((SECONDS % 60)); }
step() { printf '\n=== %s (at %s)\n' "$*" "$(clock)"; }
# filtered WHAT PATTERN COMMAND...: runs COMMAND, shows its output without
# the lines PATTERN (grep -E) matches, and exits with its status, naming WHAT,
# where it failed.
filtered() {
  local what="$1" pattern="$2" out rc=0
  shift 2
  out="$("$@" 2>&1)" || rc=$?
  grep -Ev "$pattern" <<<"$out" || true
  [ "$rc" = 0 ] || { echo "$what failed (exit $rc)" >&2; exit "$rc"; }
}

# The Python test runs. Each entry is a torch version, with ":X.Y" to run it on
# that CPython (the wheel is py3-none: one build for all of them): torch 2.10 on
# the oldest CPython it takes, the newest torch on the newest CPython here
# (3.13; the free-threaded step below runs it on 3.14t), last, whose venv the
# steps after them use. Where the machine lacks that CPython, the entry runs on
# python3 unless another entry covers its torch: one that runs (plain, or its
# CPython is here), or an earlier one (which, lacking its CPython too, ran on
# python3).
runs="${KEEL_TORCH_VERSIONS:-2.10.0:3.10 latest:3.13}"
# Whether an entry of $runs other than RUN ($1) covers torch VERSION ($2).
covered_elsewhere() {
  local r earlier=1
  for r in $runs; do
    if [ "$r" = "$1" ]; then earlier=0; continue; fi
    [ "${r%%:*}" = "$2" ] || continue
    if [ "$earlier" = 1 ] || [ "$r" = "$2" ] || find_python "${r#*:}" >/dev/null; then return 0; fi
  done
  return 1
}
# Resolved once, up front: "VERSION|X.Y|PYTHON" per entry that runs (X.Y and
# PYTHON empty for python3), "VERSION|X.Y|skip" per entry skipped.
plan=()
for run in $runs; do
  ver="${run%%:*}" pyv="" python=""
  [ "$run" != "$ver" ] && pyv="${run#*:}"
  if [ -n "$pyv" ] && ! python="$(find_python "$pyv")"; then
    if covered_elsewhere "$run" "$ver"; then
      plan+=("$ver|$pyv|skip")
      continue
    fi
    echo "no CPython $pyv on this machine: torch $ver runs on python3 instead"
    pyv="" python=""
  fi
  plan+=("$ver|$pyv|$python")
done

# Their torch venvs (~3.5 GB of downloads each) are made in the background while
# the Rust steps below keep the CPUs busy, where the disk has room for them all
# with some to spare (else, and where this fails, the runs make them in turn, as
# they would anyway). Its output is shown when the runs begin.
prefetch_log="$(mktemp)"
prefetch_pid=""
# Where a step fails first, the background job (its pip too) is stopped.
trap 'rm -f "$prefetch_log"; [ -z "$prefetch_pid" ] || { pkill -P "$prefetch_pid"; kill "$prefetch_pid"; } 2>/dev/null || true' EXIT
need_mb=$(( (${#plan[@]} + 2) * KEEL_TORCH_NEED_MB ))
if [ "$(_free_mb)" -ge "$need_mb" ]; then
  (
    for entry in "${plan[@]}"; do
      IFS='|' read -r ver pyv python <<<"$entry"
      [ "$python" = skip ] && continue
      echo "torch $ver${pyv:+ on CPython $pyv}:"
      torch_env "$ver" $python || exit 1
    done
  ) > "$prefetch_log" 2>&1 &
  prefetch_pid=$!
else
  echo "not making the torch venvs ahead: under $need_mb MB free" > "$prefetch_log"
fi

step "cargo fmt / clippy"
rustup component add rustfmt clippy >/dev/null 2>&1 || true
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings

step "cargo test (CPU kernels, property tests, CUDA kernels emulated on the CPU; GPU tests skip without a GPU)"
# The emulated CUDA tests compile kernels-cuda/ with g++ and need the CUDA
# headers, which come with the pinned nvcc; in CI they must run, not skip.
command -v g++ >/dev/null || apt_install g++ || true
source scripts/nvcc-env.sh
export KEEL_REQUIRE_CUDA_EMU=1
# Once, not twice: the emulated CUDA tests alone take about a minute here.
filtered "cargo test" '^$|^running 0 tests' cargo test --workspace --profile ci -q

step "cargo test of the CPU kernels at each lower SIMD level (KEEL_CPU_CAPABILITY): the paths of CPUs without AVX-512, or without AVX2"
# Not the emulated CUDA tests (ops::emu_tests): they check the CUDA kernels'
# source against the CPU kernels, which the tests run here check against f64
# references at each level; once, above, is enough.
for cap in avx2 default; do
  filtered "cargo test at $cap" '^$|^running 0 tests' env KEEL_CPU_CAPABILITY="$cap" \
    cargo test --workspace --profile ci -q --lib --test '*_cpu' -- --skip ops::emu_tests
done

step "the CPU kernels for aarch64: clippy for that target, then the CPU unit and property tests under qemu"
bash scripts/test-aarch64.sh

step "the aarch64 wheel (manylinux_2_28, zig): its Python tests under qemu, on Debian's arm64 CPython with torch 2.10.0's aarch64 wheel"
bash scripts/test-aarch64-wheel.sh

step "the standalone Rust example (CPU; where there is no GPU it must say so and exit 0)"
cargo run --profile ci -q --example rms_norm

step "criterion benches, each run once (criterion's --test mode: every bench's inputs and kernel calls work)"
filtered "a criterion bench" '^(Testing .*|Success|)$' cargo bench --profile ci -q -- --test

step "ptx/ up to date with kernels-cuda/, no spills (pinned nvcc)"
scripts/check-ptx.sh

step "no multiply-add left to the compilers in the kernels that promise layout-independent bits"
scripts/check-contraction.sh

step "cargo check --features nvtx (NVTX ranges around launches; needs libclang)"
# libclang itself (libclang.so, libclang-14.so.1), not libclang-cpp, the C++
# library that Debian images carry without it: matched by a wider glob, it
# made this step skip the install and then skip the check (session 28), and
# a glob with no match must not fail the function under pipefail.
find_libclang() {
  local f
  for f in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/*-linux-gnu/libclang.so* /usr/lib/*-linux-gnu/libclang-[0-9]*.so*; do
    [ -e "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}
find_libclang >/dev/null || apt_install libclang-dev || true
if lib="$(find_libclang)"; then
  # Its own statement: as the left side of an `&&` a failure here would not
  # stop the script (set -e ignores it there).
  LIBCLANG_PATH="$(dirname "$lib")" cargo check -q -p keel-ops --features nvtx
  echo "nvtx feature builds (libclang: $lib)"
else
  echo "SKIPPED: no libclang on this machine and it could not be installed"
fi

step "cargo doc (public items documented)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -q

step "cargo package: the Rust crates as they would be published (keel-cpu, keel-abi, keel; keel-ops is the wheel's), each built alone from its package, keel from the committed ptx/"
KEEL_NO_NVCC=1 cargo package --workspace --exclude keel-ops --allow-dirty -q

step "build the sdist, and from it the wheel once (manylinux_2_28: linked against glibc 2.28's symbols, as torch's wheels are), and load its library under Debian 11's glibc 2.31"
build_wheel
echo "$SDIST"; echo "$WHEEL"
bash scripts/check-glibc-floor.sh "$WHEEL"

if [ -n "$prefetch_pid" ]; then
  step "the torch venvs made in the background"
  wait "$prefetch_pid" && echo "ready" || echo "(failed: the runs make what is missing)"
  prefetch_pid=""
fi
cat "$prefetch_log"
ran_ver=""
for entry in "${plan[@]}"; do
  IFS='|' read -r ver pyv python <<<"$entry"
  if [ "$python" = skip ]; then
    step "python tests under torch $ver on CPython $pyv"
    echo "SKIPPED: no CPython $pyv on this machine (neither python$pyv on PATH nor pyenv's $pyv.*)"
    continue
  fi
  step "python tests under torch $ver${pyv:+ on CPython $pyv}"
  torch_env "$ver" $python
  "$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL"
  "$PY" -c "import sys, torch; print('torch', torch.__version__, 'on CPython', sys.version.split()[0])"
  (cd "$root" && "$PY" -m pytest -q -p no:cacheprovider "${PYTEST_WORKERS[@]}" python/tests)
  ran_ver="$ver"
done

# The levels do not depend on torch: under the last torch that ran only. The op tests
# in one pytest run per level (its workers inherit the level; test_capability.py
# checks the level took).
for cap in avx2 default; do
  step "python op tests at KEEL_CPU_CAPABILITY=$cap (torch $ran_ver)"
  (cd "$root" && KEEL_CPU_CAPABILITY="$cap" "$PY" -m pytest -q -p no:cacheprovider "${PYTEST_WORKERS[@]}" \
    python/tests/test_capability.py python/tests/test_rms_norm.py python/tests/test_layer_norm.py \
    python/tests/test_softmax.py python/tests/test_cross_entropy.py python/tests/test_gated.py \
    python/tests/test_rotary.py python/tests/test_rotary_inplace.py python/tests/test_fused_add_rms_norm.py \
    python/tests/test_fused_add_rms_norm_inplace.py python/tests/test_layouts.py python/tests/test_mixed_precision.py)
done

step "python tests on free-threaded CPython with the GIL off (3.14t and the newest torch, built from Ubuntu's source of it, else 3.13t from Debian's; skipped, saying why, where it cannot be)"
bash scripts/test-freethreaded.sh "$WHEEL"

printf '\n=== every test passed, in %s\n' "$(clock)"
