#!/usr/bin/env bash
# The GPU machine's run: install the carried wheels, then run the named parts, logging to $OUT.
#   bash bench/gpu_session.sh tests decode prefill throughput attention
# Needs .whl (weft-core, weft-triton, weft-cuda and the pure-Python dependencies the image lacks) and
# .whl/tokenizer (SmolLM2's tokenizer files), both carried.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WEFT_TEST_TOKENIZER=$PWD/.whl/tokenizer
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null
for part in "$@"; do
    echo "=== $part"
    case $part in
        tests) python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_triton_attention.py tests/test_cuda_ops.py \
                   tests/test_cuda_graphs.py tests/test_gpu_parity.py tests/test_decode_topk.py tests/test_platforms.py -s 2>&1 \
                   | tee "$out/gpu_tests.log" ;;
        decode_topk) python3 bench/gpu_decode_topk.py 2>&1 | tee "$out/gpu_decode_topk.log" ;;
        fp8-tests) { python3 bench/bounded_attention.py
                     python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fp8_gpu.py tests/test_triton_attention.py \
                         tests/test_cuda_ops.py -k "fp8 or float8" -s; } 2>&1 | tee "$out/gpu_fp8_tests.log" ;;
        fp8) python3 bench/fp8.py --tokenizer .whl/tokenizer 2>&1 | tee "$out/gpu_fp8.log" ;;
        decode_overlap) python3 bench/gpu_decode_overlap.py 2>&1 | tee "$out/gpu_decode_overlap.log" ;;
        tp-tests) python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_distributed_gpu.py -s 2>&1 | tee "$out/gpu_tp_tests.log" ;;
        attention) python3 bench/gpu_attention.py --tokenizer .whl/tokenizer 2>&1 | tee "$out/gpu_attention.log" ;;
        throughput-profile) python3 bench/gpu_throughput.py --profile --tokenizer .whl/tokenizer 2>&1 | tee "$out/gpu_throughput.log" ;;
        serve) python3 bench/gpu_engine.py --tokenizer .whl/tokenizer --part serve 2>&1 | tee "$out/gpu_serve.log" ;;
        prefill-sweep) python3 bench/gpu_prefill.py --sweep --tokenizer .whl/tokenizer 2>&1 | tee "$out/gpu_prefill.log" ;;
        spec) python3 bench/spec_decode.py --part gpu --tokenizer .whl/tokenizer --rounds 2 2>&1 | tee "$out/spec_decode.log" ;;
        moe) python3 bench/moe.py --tokenizer .whl/tokenizer 2>&1 | tee "$out/moe.log" ;;
        *) python3 "bench/gpu_$part.py" --tokenizer .whl/tokenizer 2>&1 | tee "$out/gpu_$part.log" ;;
    esac
done
