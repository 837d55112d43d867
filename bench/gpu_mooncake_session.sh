#!/usr/bin/env bash
# The GPU machine's weft-mooncake run (one H200): install the carried wheels (bench/gpu_mooncake_wheels.sh), supply
# the shared libraries Mooncake needs that the image lacks (from .whl/mooncake-libs.tar.xz), then the two-process
# GPU test (tests/test_mooncake_gpu.py) and the TTFT and load-bandwidth bench (bench/kv_store_ttft.py --gpu:
# Llama-3-8B shape, 4k-token prefix), logging to $OUT.
#   bash bench/gpu_mooncake_session.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WEFT_TEST_TOKENIZER=$PWD/.whl/tokenizer
out=${OUT:-/tmp}
mooncake=/tmp/site/mooncake
libs=/tmp/mooncake-libs
mkdir -p "$libs/carried" "$libs/supplied"
tar -xJf .whl/mooncake-libs.tar.xz -C "$libs/carried"
export LD_LIBRARY_PATH=$libs/supplied${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for _ in 1 2 3 4 5 6 7 8; do  # each round supplies what the previous round's copies need in turn
    missing=$(ldd "$mooncake"/*.so "$mooncake/mooncake_master" "$mooncake/mooncake_client" 2>/dev/null \
              | awk '/not found/ {print $1}' | sort -u)
    [ -z "$missing" ] && break
    for name in $missing; do cp "$libs/carried/$name" "$libs/supplied/" 2>/dev/null || echo "no carried copy of $name"; done
done
echo "supplied from the carried libraries: $(ls "$libs/supplied" | tr '\n' ' ')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null
echo "=== test"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/test_mooncake_gpu.py 2>&1 \
    | tee "$out/gpu_mooncake_tests.log"
echo "=== bench: a 16-token tail; asynchronous, synchronous, and synchronous layer by layer (8 layers per object)"
timeout 210 python3 bench/kv_store_ttft.py --gpu --tokenizer .whl/tokenizer --variants async,sync,sync:8 2>&1 \
    | grep -v '^[IWE][0-9]\{4\} ' | tee "$out/gpu_mooncake_ttft.log"
echo "=== bench: a 2,048-token tail, synchronous whole and layer by layer (the tail's compute overlaps the load)"
timeout 150 python3 bench/kv_store_ttft.py --gpu --tokenizer .whl/tokenizer --tail 2048 --rounds 3 \
    --variants sync,sync:8 2>&1 | grep -v '^[IWE][0-9]\{4\} ' | tee "$out/gpu_mooncake_ttft_long_tail.log"
