#!/usr/bin/env bash
# Fill .whl/ (git-ignored, carried to the GPU machine) for bench/gpu_dsv4_session.sh:
# wheels of weft-core, weft-triton, weft-cuda, weft-dsv4 and weft-hisparse from this checkout, and the transformers stack the
# DeepSeek V4 parity tests pin (5.24.0; the GPU image's 5.17 has an older DeepSeek V4).
# (huggingface_hub stays the image's: 2.x needs httpx2, which the image lacks; transformers 5.24 takes >=1.31.)
# regex is compiled per Python version, so one wheel per version goes to .whl/optional/ and the
# session installs the one that fits. Add any other wheel the image lacks to .whl/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
cd "$root"
mkdir -p .whl/optional
"$python" -m pip wheel -q --no-deps -w .whl ./core ./plugins/triton ./plugins-cuda ./plugins/dsv4 ./plugins/hisparse
"$python" -m pip download -q --no-deps -d .whl transformers==5.24.0
"$python" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.11 \
    -d .whl tokenizers==0.23.3 safetensors==0.8.0
for version in 3.10 3.11 3.12 3.13; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version "$version" \
        -d .whl/optional "regex>=2025.10.22"
done
du -sh .whl
