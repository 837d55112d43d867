#!/usr/bin/env bash
# The GPU machine's DeepSeek V4 run: install the carried wheels (bench/gpu_dsv4_wheels.sh), then the
# GPU tests (tests/test_dsv4_gpu.py, the GPU marks of tests/test_dsv4.py, the decode_topk kernel and its
# CUDA-graph replay) and the decode-throughput bench against transformers' generate(), logging to $OUT.
#   bash bench/gpu_dsv4_session.sh [extra arguments for bench/gpu_dsv4.py]
#   SKIP_TESTS=1 bash bench/gpu_dsv4_session.sh --part hisparse   (the HiSparse concurrency case only)
#   bash bench/gpu_dsv4_session.sh --part prefill                  (the tests, then prefill: kernel against einsum)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
for wheel in .whl/optional/*.whl; do  # the one regex wheel that fits this Python
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" 2>/dev/null && break
done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__); assert transformers.__version__ == '5.24.0', 'the parity reference must be transformers 5.24.0'" || exit 1
if [ -z "${SKIP_TESTS:-}" ]; then
    echo "=== tests"
    python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/test_dsv4_gpu.py tests/test_dsv4.py tests/test_decode_topk.py 2>&1 | tee "$out/gpu_dsv4_tests.log"
fi
echo "=== bench"
python3 bench/gpu_dsv4.py --out "$out" "$@" 2>&1 | tee "$out/gpu_dsv4.log"
