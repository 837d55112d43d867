#!/usr/bin/env bash
# Fill .whl/ (git-ignored, carried to the GPU machine) for bench/gpu_pd_session.sh: wheels of weft-core,
# weft-cuda, weft-nixl and weft-disagg from this checkout, and NIXL for the GPU image (Python 3.12, CUDA 13).
# NIXL's wheel (about 68 MB) holds its expert-parallel library nixl_ep_* too, which weft-nixl does not use:
# it is dropped from the copy carried here so the working tree stays under the device's 64 MiB.
#   NIXL_BUILD=cu12 bash bench/gpu_pd_wheels.sh   # for an image whose torch is built for CUDA 12
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
build=${NIXL_BUILD:-cu13}
cd "$root"
mkdir -p .whl
"$python" -m pip wheel -q --no-deps -w .whl ./core ./plugins-cuda ./plugins/nixl ./plugins/disagg
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl/full "nixl-$build==1.5.1"
for wheel in .whl/full/*.whl; do
    cp "$wheel" .whl/
    zip -q -d ".whl/$(basename "$wheel")" "nixl_ep_$build/*" || true
done
rm -rf .whl/full
du -sh .whl
