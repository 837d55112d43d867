python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for w in .whl/optional/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null && break; done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WEFT_TEST_TOKENIZER=$PWD/.whl/tokenizer
unset TRITON_INTERPRET
timeout 540 python3 bench/gpu_dsv4.py --out $OUT --part hisparse --requests 13 --kv-gib 0.1 --new-tokens 64 > $OUT/hisparse.log 2>&1; tail -c 3000 $OUT/hisparse.log
