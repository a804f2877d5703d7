# Sourced by the scripts: `torch_env VERSION` makes (once) and activates a venv
# .venv-torch-VERSION holding that torch ("latest" = newest on PyPI) and the
# test tools, and sets $PY to its python; `find_python X.Y` finds a CPython.
#
# torch with its CUDA libraries is ~5.5 GB installed, and a plain `pip install`
# holds every downloaded wheel (~3.5 GB more) until the end, plus a cached copy.
# A CI machine's free disk varies (one run died here with ENOSPC), so the install
# is frugal: no pip cache, one wheel at a time (peak = installed + the largest
# wheel), and when the disk is short the other torch venvs go first.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KEEL_TORCH_NEED_MB="${KEEL_TORCH_NEED_MB:-7000}"

_free_mb() { df -Pm "$_root" | awk 'NR==2 {print $4}'; }

# Frees room for a new torch venv: removes the other .venv-torch-* venvs (they are
# rebuilt when next used) and the debug build, only while space is short.
_make_room() {
  local keep="$1" v
  for v in "$_root"/.venv-torch-*; do
    [ "$(_free_mb)" -ge "$KEEL_TORCH_NEED_MB" ] && return 0
    [ -d "$v" ] && [ "$v" != "$keep" ] || continue
    echo "low disk ($(_free_mb) MB free): removing $v"
    rm -rf "$v"
  done
  if [ "$(_free_mb)" -lt "$KEEL_TORCH_NEED_MB" ] && [ -d "$_root/target/debug" ]; then
    echo "low disk ($(_free_mb) MB free): removing target/debug"
    rm -rf "$_root/target/debug"
  fi
  if [ "$(_free_mb)" -lt "$KEEL_TORCH_NEED_MB" ]; then
    echo "warning: $(_free_mb) MB free, torch needs about $KEEL_TORCH_NEED_MB MB; trying anyway" >&2
  fi
}

# Installs the resolved set one wheel at a time into the venv at $1. Fails at the
# first step that fails, also where its caller tests it (`|| ...`, where set -e
# stops nothing).
_install_frugal() {
  local venv="$1"; shift
  local report="$venv/.resolve.json" url
  PIP_NO_CACHE_DIR=1 "$venv/bin/pip" install -q --disable-pip-version-check \
    --dry-run --ignore-installed --report "$report" "$@" || return 1
  "$venv/bin/python" - "$report" > "$venv/.urls" <<'EOF' || return 1
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["download_info"]["url"])
EOF
  while read -r url; do
    PIP_NO_CACHE_DIR=1 "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$url" || return 1
  done < "$venv/.urls"
}

# True when PyPI has a newer torch than the venv at $1 holds (offline: false).
_newer_torch() {
  local out
  out="$("$1/bin/pip" install -q --disable-pip-version-check --dry-run --upgrade \
    --no-deps --report - torch 2>/dev/null)" || return 1
  "$1/bin/python" -c 'import json, sys; sys.exit(0 if json.loads(sys.argv[1])["install"] else 1)' "$out"
}

# The interpreter for CPython X.Y ("3.13") that runs and can make a venv:
# python3.13 on PATH (a pyenv shim there may refuse to run), else pyenv's
# newest 3.13.*; prints its path, or fails where this machine has none.
find_python() {
  local want="$1" p
  for p in "$(command -v "python$want")" \
    $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want".*/bin/"python$want" 2>/dev/null | sort -V -r); do
    [ -n "$p" ] && "$p" -c 'import venv, ensurepip' 2>/dev/null && { echo "$p"; return 0; }
  done
  return 1
}

# `torch_env VERSION [PYTHON]`: PYTHON (an interpreter's path) makes the venv
# with that CPython, named .venv-torch-VERSION-pyX.Y (X.Yt for a free-threaded
# build); without it, python3's. A free-threaded CPython gets wheels only, and no
# matplotlib, which has none for every such build (the report's tests then skip
# their plots). Returns non-zero, leaving no venv marked ready, where the
# install fails.
torch_env() {
  local ver="$1" python="${2:-python3}" venv="$_root/.venv-torch-$1" spec
  local extras=(numpy pytest pytest-xdist expecttest matplotlib tqdm)
  if [ -n "${2:-}" ]; then
    venv="$venv-py$("$python" -c 'import sys; print("%d.%d%s" % (*sys.version_info[:2], sys.abiflags))')"
  fi
  if "$python" -c 'import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_GIL_DISABLED"))'; then
    extras=(--only-binary=:all: numpy pytest pytest-xdist expecttest tqdm)
  fi
  if [ "$ver" = latest ]; then spec="torch"; else spec="torch==$ver"; fi
  if [ "$ver" = latest ] && [ -f "$venv/.ready" ] && _newer_torch "$venv"; then
    echo "a newer torch is out: rebuilding $venv"
    rm -f "$venv/.ready"
  fi
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    _make_room "$venv"
    "$python" -m venv "$venv" || return 1
    _install_frugal "$venv" "$spec" "${extras[@]}" || return 1
    echo "${extras[*]}" > "$venv/.ready"
  elif [ "$(cat "$venv/.ready")" != "${extras[*]}" ]; then
    # A venv made before the tools changed: the tools added, torch kept.
    PIP_NO_CACHE_DIR=1 "$venv/bin/pip" install -q --disable-pip-version-check "${extras[@]}" || return 1
    echo "${extras[*]}" > "$venv/.ready"
  fi
  PY="$venv/bin/python"
}

# pytest's arguments that spread a suite over pytest-xdist's workers, one per
# CPU: the suites are mostly single-threaded Python, so on CI's 2 cores this
# nearly halves them. KEEL_TEST_WORKERS sets the count (0: one process).
PYTEST_WORKERS=(-n "${KEEL_TEST_WORKERS:-auto}")
# The glibc whose symbol versions the wheel's library is linked against: torch's
# own wheels' floor (manylinux_2_28) since torch 2.6, so Keel installs wherever
# torch does, not only where glibc is as new as the machine that built it.
KEEL_GLIBC="${KEEL_GLIBC:-2.28}"

# The tools build_wheel links with, pinned, in .venv-build (made once, and again
# when the pins change): cargo-zigbuild and zig (which carries every glibc's
# symbol versions), auditwheel, which reads the built wheel's platform back, and
# build, which makes the sdist. Sets $BUILD_VENV.
_BUILD_PINS="cargo-zigbuild==0.24.1 ziglang==0.17.1 auditwheel==6.8.2 build==1.6.1"
_build_tools() {
  BUILD_VENV="$_root/.venv-build"
  [ "$(cat "$BUILD_VENV/.ready" 2>/dev/null)" = "$_BUILD_PINS" ] && return 0
  rm -rf "$BUILD_VENV"
  python3 -m venv "$BUILD_VENV" || return 1
  # shellcheck disable=SC2086 # the pins are words
  "$BUILD_VENV/bin/pip" install -q --disable-pip-version-check $_BUILD_PINS || return 1
  echo "$_BUILD_PINS" > "$BUILD_VENV/.ready"
}

# `zig_wheel SRC OUT [ARCH]`: the wheel of the tree SRC, into OUT (emptied
# first), for ARCH (this machine's by default; "aarch64" on x86_64 through the
# cross compiler scripts/test-aarch64.sh installs); sets $WHEEL. Its library is
# linked by zig against glibc $KEEL_GLIBC's symbols, and against the target's
# libgcc_s for unwinding: zig would link its own unwinder in, whose calls on
# torch's C++ exceptions, unwound by libgcc_s through Keel's frames on every
# error an op raises, crash the process. build_wheel builds this tree's with it;
# scripts/gpu-bundle.sh its baselines, so that they are linked as this tree's is.
zig_wheel() {
  local src="$1" out="$2" arch="${3:-}" host cc libgcc
  host="$(uname -m)"
  arch="${arch:-$host}"
  if [ "$arch" = "$host" ]; then cc="${CC:-cc}"; else cc="$arch-linux-gnu-gcc"; fi
  _build_tools || return 1
  libgcc="$("$cc" -print-file-name=libgcc_s.so.1)" || return 1
  case "$libgcc" in /*) ;; *) echo "zig_wheel: $cc finds no libgcc_s.so.1" >&2; return 1 ;; esac
  # setuptools' build/ keeps files of earlier builds, which it packs again.
  rm -rf "$out" "$src/build"
  CARGO="$BUILD_VENV/bin/cargo-zigbuild" CARGO_ZIGBUILD_PYTHON_PATH="$BUILD_VENV/bin/python" \
    CARGO_BUILD_TARGET="$arch-unknown-linux-gnu.$KEEL_GLIBC" \
    RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C link-arg=$libgcc" \
    KEEL_WHEEL_PLATFORM="manylinux_${KEEL_GLIBC/./_}_$arch" \
    python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "$src" || return 1
  WHEEL="$(ls "$out"/keel-*.whl)"
}

# `build_wheel [ARCH]` builds this tree's sdist, then from it the wheel (Rust
# cdylib inside, tied to no torch or Python version), as `python -m build` does,
# so that every wheel tested proves the sdist complete; sets $SDIST and $WHEEL:
# for this machine, dist/keel-0.1.0.tar.gz and
# dist/keel-0.1.0-py3-none-manylinux_2_28_<arch>.whl; for another ARCH, the
# wheel under target/wheel-ARCH/. It fails unless auditwheel agrees with the tag.
build_wheel() {
  local arch="${1:-$(uname -m)}" out plat src="$_root/target/sdist"
  out="$_root/dist"
  [ "$arch" = "$(uname -m)" ] || out="$_root/target/wheel-$arch"
  plat="manylinux_${KEEL_GLIBC/./_}_$arch"
  _build_tools || return 1
  # setuptools adds to the sdist every file its last SOURCES.txt listed: only what
  # MANIFEST.in names now, so that a file it lacks fails the build here.
  rm -rf "$src" "$_root/python/keel.egg-info" && mkdir -p "$src/tree" || return 1
  "$BUILD_VENV/bin/python" -m build -q --sdist --outdir "$src" "$_root" > "$src/log" 2>&1 ||
    { cat "$src/log" >&2; echo "build_wheel: the sdist did not build" >&2; return 1; }
  SDIST="$(ls "$src"/keel-*.tar.gz)"
  # Unpacked in one place (tar keeps the files' times), so that cargo finds its
  # earlier build of the same sources in target/ and compiles only what changed.
  tar -xzf "$SDIST" -C "$src/tree" --strip-components=1 || return 1
  CARGO_TARGET_DIR="$_root/target" zig_wheel "$src/tree" "$out" "$arch" || return 1
  if [ "$arch" = "$(uname -m)" ]; then cp "$SDIST" "$out/" && SDIST="$out/$(basename "$SDIST")"; fi
  # auditwheel's verdict on the tag the wheel claims (it fails where it disagrees).
  "$BUILD_VENV/bin/auditwheel" show "$WHEEL" 2>/dev/null | tr '\n' ' ' |
    grep -q "is consistent with the following platform tag: \"$plat\"" || {
    "$BUILD_VENV/bin/auditwheel" show "$WHEEL" >&2
    echo "build_wheel: auditwheel does not find $WHEEL consistent with $plat" >&2
    return 1
  }
}

# Builds the wheel and installs it into the torch venv for VERSION (sets $PY).
install_wheel_in() {
  build_wheel
  torch_env "$1"
  "$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL"
}
