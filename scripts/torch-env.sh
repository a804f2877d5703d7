# Sourced by the scripts: `torch_env VERSION` makes (once) and activates a venv
# .venv-torch-VERSION holding that torch ("latest" = newest on PyPI) and the
# test tools, and sets $PY to its python.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
torch_env() {
  local ver="$1" venv="$_root/.venv-torch-$1" spec
  if [ "$ver" = latest ]; then spec="torch"; else spec="torch==$ver"; fi
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "$spec" numpy pytest expecttest
    touch "$venv/.ready"
  elif [ "$ver" = latest ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check --upgrade torch
  fi
  PY="$venv/bin/python"
}
# Builds the wheel once (Rust cdylib inside, not tied to a torch or Python version)
# and sets $WHEEL.
build_wheel() {
  rm -rf "$_root/dist"
  python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$_root/dist" "$_root"
  WHEEL="$(ls "$_root"/dist/keel-*.whl)"
}
