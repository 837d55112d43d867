#!/usr/bin/env bash
# Compile requirements/test/<platform>.in (each `-r common.in` plus what that platform adds) into the
# lock file beside it, with uv (pip install uv): one universal resolution per platform, with markers,
# for Python 3.11 and later. torch is left out (requirements/test/torch-provided.txt). Run it after
# editing any .in file; tests/test_requirements.py fails until the locks match their inputs.
#   UV        the uv command (default: uv on PATH, else the one in .venv)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
uv=${UV:-$(command -v uv || echo "$root/.venv/bin/uv")}
cd "$root/requirements/test"
for platform in cpu cuda rocm xpu; do
    "$uv" pip compile --quiet --universal --python-version 3.11 --no-header --annotation-style line \
        --override torch-provided.txt --output-file "$platform.txt" "$platform.in"
    inputs=$(cat common.in "$platform.in" torch-provided.txt | sha256sum | cut -d' ' -f1)
    { echo "# Compiled from $platform.in by scripts/compile-test-requirements.sh; do not edit."
      echo "# inputs sha256: $inputs"
      cat "$platform.txt"; } >"$platform.txt.new"
    mv "$platform.txt.new" "$platform.txt"
done
