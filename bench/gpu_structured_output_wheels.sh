#!/usr/bin/env bash
# Fill .whl/ (git-ignored, carried to the GPU machine) for bench/structured_output.py --gpu and the
# structured-output GPU test: wheels of weft-core, weft-triton, weft-cuda and weft-xgrammar from this checkout, and
# xgrammar with the compiled pieces it needs for the image's Python 3.12 (apache-tvm-ffi, pydantic-core)
# and their pure-Python companions. SmolLM2's tokenizer files go in .whl/tokenizer (as for bench/gpu_session.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
cd "$root"
mkdir -p .whl
"$python" -m pip wheel -q --no-deps -w .whl ./core ./plugins/triton ./plugins-cuda ./plugins/xgrammar
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl xgrammar==0.2.9 "apache-tvm-ffi>=0.1.11" "pydantic==2.14.4" "pydantic-core==2.50.5" \
    annotated-types typing-inspection
du -sh .whl
