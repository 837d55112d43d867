#!/usr/bin/env bash
# The GPU machine's prefill/decode run on the x2 kind (prefill on GPU 0, decode on GPU 1, VRAM to VRAM):
# install the carried wheels (bench/gpu_pd_wheels.sh) and SmolLM2's tokenizer (.whl/tokenizer), then the
# output check (tests/test_disagg_gpu.py: Llama-3-8B shape, float32) and the bf16 timings (bench/pd.py),
# logging to $OUT.
#   bash bench/gpu_pd_session.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WEFT_TEST_TOKENIZER=$PWD/.whl/tokenizer
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null
echo "=== check"
python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/test_disagg_gpu.py 2>&1 | tee "$out/gpu_pd_tests.log"
echo "=== timings"
python3 bench/pd.py --llama8b --tokenizer .whl/tokenizer --prefill-gpu 0 --decode-gpu 1 --dtype bfloat16 \
    --part latency --part bandwidth --part overhead --prompt 2048 --output 128 2>&1 | tee "$out/gpu_pd.log"
