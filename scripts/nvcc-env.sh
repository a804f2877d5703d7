# Sourced by the scripts: makes the pinned nvcc (from PyPI) available as $KEEL_NVCC
# and $KEEL_PTXAS, and CUDA 12.0's ptxas as $KEEL_PTXAS_OLDEST, installing them
# into .venv-nvcc on first use.
# The nvcc pin decides the committed PTX byte for byte. nvcc 13.0 writes PTX ISA
# 9.0, which only drivers for CUDA 13.0 (R580) on can JIT; the scripts lower the
# declared ISA to kernels-cuda/ptx-isa.txt (8.0), and check-ptx.sh assembles the
# result with CUDA 12.0's ptxas (the JIT of an R525 driver). PyPI has no nvcc
# older than 13.0, only ptxas (nvidia-cuda-nvcc-cu12). nvdisasm ($KEEL_NVDISASM,
# for check-contraction.sh) only reads what ptxas wrote; PyPI's oldest is 13.2.
KEEL_NVCC_PINS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvcc-cu12==12.0.140 nvidia-cuda-nvdisasm==13.5.37"
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv-nvcc"
if [ ! -x "$_venv/bin/python" ] || [ "$(cat "$_venv/.pins" 2>/dev/null)" != "$KEEL_NVCC_PINS" ]; then
  python3 -m venv "$_venv"
  # shellcheck disable=SC2086
  PIP_NO_CACHE_DIR=1 "$_venv/bin/pip" install -q --disable-pip-version-check $KEEL_NVCC_PINS
  echo "$KEEL_NVCC_PINS" > "$_venv/.pins"
fi
_cu="$("$_venv/bin/python" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))")"
export KEEL_NVCC="$_cu/bin/nvcc" KEEL_PTXAS="$_cu/bin/ptxas" KEEL_PTXAS_OLDEST="$(dirname "$_cu")/cuda_nvcc/bin/ptxas"
export KEEL_NVDISASM="$_cu/bin/nvdisasm"
