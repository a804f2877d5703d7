#!/usr/bin/env bash
# The wheel on free-threaded CPython with the GIL off (PYTHON_GIL=0): the Python
# tests, under the newest torch that ships a wheel for that CPython.
#
# No free-threaded interpreter comes from PyPI or from this machine's packages,
# and python.org is out of reach here, so this builds one (`./configure
# --disable-gil`, about 5 minutes on 2 cores) from a Debian-format archive's
# source of CPython, the first orig tarball that downloads of: Debian's
# python3.14 (sid, trixie), Ubuntu's python3.14 (resolute), Debian's python3.13.
# With 3.14t the tests run under torch 2.15 on; with 3.13t, 2.12 (the last
# torch with cp313t wheels). The interpreter and its torch venv are kept (.venv-freethreaded/,
# and torch_env's .venv-torch-latest-py3.Xt/) for the next run. Where no source downloads or the
# build fails, it says so and exits 0: the step is skipped, not failed.
#
#   scripts/test-freethreaded.sh WHEEL
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
source scripts/apt.sh
wheel="${1:?usage: scripts/test-freethreaded.sh WHEEL}"
prefix="$root/.venv-freethreaded"
skip() { echo "SKIPPED: $*"; exit 0; }

# The interpreter: bin/python3.Xt under $prefix, built once.
interpreter() { ls "$prefix"/bin/python3.*t 2>/dev/null | head -n1; }
if [ -z "$(interpreter)" ] || [ ! -f "$prefix/.ready" ]; then
  rm -rf "$prefix"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # Newest first: the Sources index of each suite names the orig tarballs.
  # Debian's python3.14 tarballs are named in its index but missing from its
  # mirror (sessions 72-74), so Ubuntu's (the same archive layout) comes next.
  # One run, so that each suite's Sources index is downloaded once.
  python3 scripts/debian.py orig "$work/src.tar.xz" python3.14:sid,trixie \
    python3.14:resolute@http://archive.ubuntu.com/ubuntu python3.13:sid,trixie > "$work/found" ||
    skip "no CPython source could be downloaded from Debian or Ubuntu"
  echo "building free-threaded CPython from $(cat "$work/found")"
  # The modules pip and the tests need (ssl, zlib, ctypes, lzma, bz2, sqlite3).
  apt_install libssl-dev zlib1g-dev libffi-dev liblzma-dev libbz2-dev libsqlite3-dev >/dev/null 2>&1 || true
  tar -xf "$work/src.tar.xz" -C "$work"
  src="$(ls -d "$work"/Python-3.*/ | head -n1)"
  if ! (cd "$src" && ./configure -q --disable-gil --prefix="$prefix" --with-ensurepip=install > "$work/build.log" 2>&1 &&
        make -s -j"$(nproc)" >> "$work/build.log" 2>&1 && make -s install >> "$work/build.log" 2>&1); then
    tail -n 20 "$work/build.log"
    skip "the free-threaded CPython did not build"
  fi
  "$(interpreter)" -c 'import ssl, zlib, ctypes, lzma, bz2, sqlite3' ||
    skip "the free-threaded CPython lacks a module pip or the tests need"
  touch "$prefix/.ready"
fi
python="$(interpreter)"

# The newest torch with a wheel for it (torch_env: wheels only, no matplotlib).
torch_env latest "$python" ||
  skip "no torch wheel for $("$python" -c 'import sys; print(sys.version.split()[0])') free-threaded"
py="$PY"
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
PYTHON_GIL=0 "$py" -c "import sys, torch, keel
assert not sys._is_gil_enabled()
print('torch', torch.__version__, 'on CPython', sys.version.split()[0], 'free-threaded, GIL disabled')"
PYTHON_GIL=0 "$py" -m pytest -q -p no:cacheprovider "${PYTEST_WORKERS[@]}" python/tests
