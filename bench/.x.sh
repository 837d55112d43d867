python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for w in .whl/optional/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null && break; done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WEFT_TEST_TOKENIZER=$PWD/.whl/tokenizer NCCL_NVLS_ENABLE=0
for e in uniproc mp; do
  echo "=== structured_output $e"
  timeout 200 python3 bench/structured_output.py --gpu --tokenizer .whl/tokenizer --executor $e > $OUT/structured_output_$e.log 2>&1; tail -8 $OUT/structured_output_$e.log
done
echo "=== step profile 8B"
timeout 170 python3 bench/gpu_step_profile.py --tokenizer $PWD/.whl/tokenizer > $OUT/step_profile_8b.log 2>&1; head -60 $OUT/step_profile_8b.log
echo "=== step profile 0.6B"
timeout 120 python3 bench/gpu_step_profile.py --shape qwen3-0.6b --tokenizer $PWD/.whl/tokenizer > $OUT/step_profile_06b.log 2>&1; head -45 $OUT/step_profile_06b.log
