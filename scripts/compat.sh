#!/usr/bin/env bash
# One wheel, every torch release: builds the wheel once, then for each torch
# version (default: every release on PyPI from 2.10 on, newest patch of each
# minor) makes a venv, installs the wheel beside that torch, and runs the Python
# tests. Ends with a markdown table: one row per version (pass or FAIL and
# pytest's counts); exits non-zero when any version failed.
#
# A torch venv is ~7 GB; each one this script made is removed after its run
# unless KEEL_COMPAT_KEEP=1 (the ones scripts/test.sh keeps, 2.10.0 and latest,
# are left alone).
#
#   scripts/compat.sh                 # every minor release from 2.10
#   scripts/compat.sh 2.11.0 2.13.0   # these versions only
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh

# The newest patch release of each minor version from 2.10 on, oldest first.
all_versions() {
  python3 -m pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' | tr ',' '\n' |
    python3 -c '
import sys
best = {}
for v in (s.strip() for s in sys.stdin):
    parts = v.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        continue  # pre-releases and local versions
    major, minor, patch = map(int, parts)
    if (major, minor) < (2, 10):
        continue
    if patch >= best.get((major, minor), -1):
        best[(major, minor)] = patch
for (major, minor), patch in sorted(best.items()):
    print(f"{major}.{minor}.{patch}")
'
}

versions=("$@")
[ "${#versions[@]}" -gt 0 ] || mapfile -t versions < <(all_versions)
[ "${#versions[@]}" -gt 0 ] || { echo "no torch versions found (is PyPI reachable?)" >&2; exit 1; }
echo "torch versions: ${versions[*]}"

build_wheel
echo "wheel: $WHEEL"

summary=()
failed=0
for ver in "${versions[@]}"; do
  printf '\n=== torch %s\n' "$ver"
  venv="$root/.venv-torch-$ver"
  made=0
  [ -f "$venv/.ready" ] || made=1
  torch_env "$ver"
  "$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL"
  got="$("$PY" -c 'import torch; print(torch.__version__)')"
  log="$(mktemp)"
  rc=0
  "$PY" -m pytest -q -p no:cacheprovider "${PYTEST_WORKERS[@]}" python/tests 2>&1 | tee "$log" || rc=$?
  result="$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -n1 | sed 's/=//g; s/^ *//; s/ *$//')"
  rm -f "$log"
  [ "$rc" = 0 ] || failed=1
  summary+=("| $got | $([ "$rc" = 0 ] && echo pass || echo FAIL) | $result |")
  if [ "$made" = 1 ] && [ "${KEEL_COMPAT_KEEP:-0}" != 1 ]; then
    rm -rf "$venv"
  fi
done

printf '\n| torch | result | pytest |\n|---|---|---|\n'
printf '%s\n' "${summary[@]}"
exit "$failed"
