#!/usr/bin/env bash
# The aarch64 wheel with torch: `build_wheel aarch64` (zig, glibc 2.28's symbols,
# the cross toolchain's libgcc_s), then Python tests run under qemu's user-mode
# emulation, on Debian 12's arm64 CPython 3.11 (unpacked from its .debs, glibc
# and libstdc++ with it, into .venv-aarch64/sysroot) with PyPI's aarch64 wheel of
# torch 2.10.0, the oldest torch Keel takes and the last whose aarch64 wheel
# needs no CUDA wheels (from 2.11 on PyPI's aarch64 torch requires CUDA 13's).
#
# Run: the Python tests but those that compile with Inductor (its C++ would
# need an aarch64 compiler and CPython's arm64 headers here, and qemu makes
# them slow) and those listed below. Where something cannot be had (qemu, the
# cross compiler, Debian's arm64 packages, the torch wheel), it says so and
# exits 0: skipped, as scripts/test-aarch64.sh does. A failing test fails.
#
#   scripts/test-aarch64-wheel.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
source scripts/aarch64-tools.sh
skip() { echo "SKIPPED (aarch64 wheel): $*"; exit 0; }
[ "$(uname -m)" = x86_64 ] || skip "this cross-tests from x86_64"
aarch64_tools || skip "$AARCH64_MISSING"

build_wheel aarch64
echo "$WHEEL"

env="$root/.venv-aarch64"
sysroot="$env/sysroot" site="$env/site"
# torch and the tests' tools, as aarch64 wheels for CPython 3.11 (.ready names
# them: a change rebuilds the environment).
wheels=(torch==2.10.0 filelock typing-extensions sympy mpmath networkx jinja2 markupsafe fsspec numpy
  pytest pluggy iniconfig packaging pygments expecttest pytest-xdist execnet)
if [ "$(cat "$env/.ready" 2>/dev/null)" != "${wheels[*]}" ]; then
  rm -rf "$env"
  mkdir -p "$env/debs"
  # Debian 12's arm64 CPython and what it and torch load, by Depends.
  # Packages whose files nothing here runs (configuration, data, the package tools).
  unneeded=debconf,debconf-2.0,tzdata,media-types,mime-support,perl-base,dpkg,install-info,readline-common,netbase,libc-bin,gcc-12-base
  python3 scripts/debian.py debs bookworm arm64 "$env/debs" --depends --unneeded "$unneeded" \
    python3.11-minimal libpython3.11-stdlib libc6 libstdc++6 libgcc-s1 ||
    skip "Debian's arm64 packages could not be downloaded"
  for deb in "$env"/debs/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done
  rm -rf "$env/debs"
  # No resolver: pip would judge the dependencies' markers by this x86_64 machine.
  plats=()
  for v in 17 24 27 28 31 34 35 36; do plats+=(--platform "manylinux_2_${v}_aarch64"); done
  PIP_NO_CACHE_DIR=1 python3 -m pip install -q --disable-pip-version-check --target "$site" "${plats[@]}" \
    --platform manylinux2014_aarch64 --python-version 3.11 --implementation cp --abi cp311 \
    --only-binary=:all: --no-deps "${wheels[@]}" ||
    skip "torch 2.10.0's aarch64 wheel and its dependencies could not be downloaded"
  echo "${wheels[*]}" > "$env/.ready"
fi
rm -rf "$env/keel"
python3 -m zipfile -e "$WHEEL" "$env/keel"

# The arm64 interpreter behind an x86_64 shell script, which this kernel can
# exec (an arm64 binary it cannot, without binfmt). A sitecustomize makes it
# every Python process's sys.executable, so that the tests that start Python
# processes (and those processes theirs) start it too.
printf '#!/bin/sh\nexec qemu-aarch64 -L "%s" "%s" "$@"\n' "$sysroot" "$sysroot/usr/bin/python3.11" > "$env/python"
chmod +x "$env/python"
mkdir -p "$env/qemu-site"
printf 'import os, sys\nsys.executable = os.environ.get("KEEL_QEMU_PYTHON", sys.executable)\n' > "$env/qemu-site/sitecustomize.py"
export KEEL_QEMU_PYTHON="$env/python" PYTHONPATH="$env/qemu-site:$env/keel:$site"
py() { "$env/python" -c "import sys
$1" "${@:2}"; }
py "import platform, torch, keel
assert sys.executable == '$env/python', sys.executable
print('torch', torch.__version__, 'on CPython', platform.python_version(), platform.machine(), 'under qemu: keel at', keel.LIBRARY_PATH)"
# Every Python test but those that cannot run under qemu-user here:
# test_capability (x86 levels); test_report, whose runs time torch.compile
# (its C++ would need an aarch64 toolchain and CPython's arm64 headers here);
# DataLoader's fork workers, which crash qemu 7.2 itself (assertions in its TCG
# vCPU code, exit 127), torch's own ops alone too; test_gloo_examples, the
# timing examples on up to four emulated processes each (their ops are
# test_dtensor*'s, which run here).
ignored=(test_capability test_report test_gloo_examples)
args=()
for t in "${ignored[@]}"; do args+=(--ignore "python/tests/$t.py"); done
args+=(--deselect python/tests/test_fork.py::test_dataloader_fork_workers_run_keel_ops_after_the_parent_did)
# pytest-xdist's workers (PYTEST_WORKERS): each its own qemu process, each
# emulated on one core.
py "import pytest; sys.exit(pytest.main(sys.argv[1:]))" -q -p no:cacheprovider "${PYTEST_WORKERS[@]}" "${args[@]}" \
  -k "not compile and not inductor and not aot" python/tests
