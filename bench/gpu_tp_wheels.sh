#!/usr/bin/env bash
# Fill .whl/ (git-ignored, carried to the GPU machine) for bench/gpu_tp.py and tests/test_distributed_gpu.py:
# wheels of weft-core, weft-triton and weft-cuda from this checkout. Add the wheels bench/gpu_session.sh already
# carries for what else the image lacks, and SmolLM2's tokenizer in .whl/tokenizer. Then, on two GPUs of one host:
#   bash bench/gpu_session.sh tp-tests tp
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
cd "$root"
mkdir -p .whl
"$python" -m pip wheel -q --no-deps -w .whl ./core ./plugins/triton ./plugins-cuda
du -sh .whl
