#!/usr/bin/env bash
# Issue 42 on the device, one call: the speculative tests on the GPU (verification CUDA graphs), the
# Llama-3-8B shape with the benchmark-only replay drafter, and the demo model with prompt lookup and auto on.
#   OUT=$OUT bash scripts/spec_gpu_checks.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site; python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -n 4 -x tests/runtime/test_speculative.py tests/runtime/test_eagle3.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -5 "$OUT/tests.log"
bench() { local name=$1 model=$2; shift 2; AUTODEPLOY_CONFIG= timeout ${BENCH_S:-200} python3 -m autodeploy bench $model "$@" \
  --repeats 1 --no-progress --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; grep -E "autodeploy |no-speculation|speculation|drafted|accept|Error" "$OUT/$name.log" | head -20; }
bench replay llama-3-8b --set weights=random --speculative-method replay --speculative-num-tokens 4 \
  --set speculative.options.acceptance_length=3 --set speculative.auto=false --batch 1,32 --input-len 128 --output-len 128
bench demo-ngram autodeploy/assets/tiny-code-llama --speculative-method ngram --speculative-num-tokens 4 \
  --batch 1,8,32 --input-len 128 --output-len 128
