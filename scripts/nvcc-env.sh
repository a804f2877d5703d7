# Sourced by the scripts: makes the pinned nvcc (from PyPI) available as $KEEL_NVCC
# and $KEEL_PTXAS, installing it into .venv-nvcc on first use.
# The pin decides the committed PTX byte for byte (and its ISA: 13.0 -> PTX 9.0,
# which needs a driver for CUDA 13.0 or newer to JIT).
KEEL_NVCC_PINS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.88 nvidia-cuda-cccl==13.0.85"
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv-nvcc"
if [ ! -x "$_venv/bin/python" ] || [ "$(cat "$_venv/.pins" 2>/dev/null)" != "$KEEL_NVCC_PINS" ]; then
  python3 -m venv "$_venv"
  # shellcheck disable=SC2086
  PIP_NO_CACHE_DIR=1 "$_venv/bin/pip" install -q --disable-pip-version-check $KEEL_NVCC_PINS
  echo "$KEEL_NVCC_PINS" > "$_venv/.pins"
fi
_cu="$("$_venv/bin/python" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))")"
export KEEL_NVCC="$_cu/bin/nvcc" KEEL_PTXAS="$_cu/bin/ptxas"
