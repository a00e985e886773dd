#!/usr/bin/env bash
# One device call for the select stage (issue 10): install, pre-tune the 8B config, engine vs HF eager at
# 1/32/256 concurrent, a profiled decode step, the backends against their references at 8B shapes.
# Run on the GPU machine:  bash scripts/gpu_select_run.sh   (writes logs under $OUT)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export AUTODEPLOY_CONFIG= XDG_CACHE_HOME="$OUT/cache"
python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "rc=$rc wall=$((SECONDS - t0))s"; tail -n 30 "$OUT/$name.log" | cut -c1-300; }
step tune ${TUNE_S:-150} python3 -m autodeploy tune llama-3-8b --set weights=random
step bench ${BENCH_S:-240} python3 scripts/bench_gpu_generate.py llama-3-8b 1,32,256
step backends_gpu ${TESTS_S:-90} python3 -m pytest -q -x -p no:cacheprovider -n 8 tests/custom_ops/test_backends_gpu.py
step profile ${PROFILE_S:-90} python3 scripts/profile_engine_step.py 1,256
