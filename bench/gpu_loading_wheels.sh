#!/usr/bin/env bash
# Fill .whl/ (git-ignored, carried to the GPU machine) for bench/gpu_loading.py and tests/test_loading_gpu.py:
# wheels of weft-core, weft-triton, weft-cuda, weft-fastsafetensors and weft-weight-cache from this checkout, and the
# fastsafetensors wheel for the image's Python 3.12 (the image has its typer dependency). Add the wheels
# bench/gpu_session.sh already carries for what else the image lacks, and SmolLM2's tokenizer in .whl/tokenizer.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
cd "$root"
mkdir -p .whl
"$python" -m pip wheel -q --no-deps -w .whl ./core ./plugins/triton ./plugins-cuda ./plugins/fastsafetensors ./plugins/weight-cache
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl fastsafetensors==0.5.0
du -sh .whl
