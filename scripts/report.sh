#!/usr/bin/env bash
# The comparison report: builds and installs the wheel beside the newest torch,
# then times every op as Keel / torch eager / torch.compile (CPU, and CUDA where
# a GPU is found), with and without THP_MEM_ALLOC_ENABLE=1, and writes
# docs/report/REPORT.md with its plots. Extra arguments go to report.py
# (e.g. --out /tmp/r, --ops softmax,rms_norm, --size small).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/torch-env.sh
install_wheel_in "${KEEL_TORCH_VERSION:-latest}"
PIP_NO_CACHE_DIR=1 "$PY" -m pip install -q --disable-pip-version-check matplotlib tqdm
"$PY" benches/report/report.py --out docs/report "$@"
