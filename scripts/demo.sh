#!/usr/bin/env bash
# The main job: build the wheel, install it beside the newest torch, and run the
# demo, which checks every Keel op against torch and prints the speed of each,
# with and without torch's huge-page allocator.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
install_wheel_in "${KEEL_TORCH_VERSION:-latest}"
"$PY" examples/demo.py
THP_MEM_ALLOC_ENABLE=1 "$PY" examples/demo.py --thp
