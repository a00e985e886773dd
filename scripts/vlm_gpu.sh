#!/bin/bash
# Issue 43 on the device: the vision-language GPU tests, then the LLaVA-1.5-7B-shape benchmarks (random weights):
# 256 requests of one 336×336 image and a 64-token question, 128 tokens out, at most 64 in flight — each its own image
# and one image for all (encoder cache hits) — HF eager generate at batch 64 on the same images, and the vision tower's
# images/s at batch 1 and 32 against HF's. One call:
#   OUT=/tmp/o STAGE=tests,bench,hf,profile,tower bash scripts/vlm_gpu.sh; tar czf $OUT/o.tgz -C /tmp o
# EXTRA='--set scheduler.max_num_tokens=8192' adds settings to the bench and hf stages; PROFILE_SETS='--set k=v' to the profile.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site AUTODEPLOY_CONFIG=
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p "$OUT"
MODEL=llava-1.5-7b
for stage in $(echo ${STAGE:-tests,bench,hf,tower} | tr , ' '); do
case $stage in
tests)
  AUTODEPLOY_CONFIG=tests/gpu.yaml timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/test_vision_language.py tests/test_vision_language_gemma3.py \
    tests/bench/test_multimodal_bench.py -x > "$OUT/vlm-tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/vlm-tests.log" ;;
bench)
  common="--set weights=random ${EXTRA:-} --images-per-request 1 --image-size 336 --repeats 1 --no-progress"
  for same in "" "--same-image"; do
    timeout ${BENCH_S:-200} python3 -m autodeploy bench $MODEL $common $same --workload concurrency --concurrency 64 \
      --num-requests ${NUM_REQUESTS:-256} --input-dist fixed:64 --output-dist fixed:128 --out "$OUT/vlm-c64${same:+-same}.json" \
      > "$OUT/vlm-c64${same:+-same}.log" 2>&1; echo "c64 $same rc=$?"; grep -E "autodeploy  |/autodeploy" "$OUT/vlm-c64${same:+-same}.log"
  done ;;
hf)
  common="--set weights=random ${EXTRA:-} --images-per-request 1 --image-size 336 --repeats 1 --no-progress"
  timeout ${HF_S:-240} python3 -m autodeploy bench $MODEL $common --workload synthetic --batch 64 --input-len 64 --output-len 128 \
    --compare hf-eager --out "$OUT/vlm-hf.json" > "$OUT/vlm-hf.log" 2>&1; echo "hf rc=$?"; grep -E "/autodeploy|/hf-eager|×" "$OUT/vlm-hf.log" ;;
profile)  # where 64 simultaneous prompts' prefill time goes (the 2.98× against HF eager: TTFT)
  timeout ${PROFILE_S:-240} python3 scripts/profile_vlm_prefill.py 64 ${PROFILE_SETS:-} > "$OUT/vlm-profile.log" 2>&1; echo "profile rc=$?"
  grep -E "prompt tokens/s|profiled burst" "$OUT/vlm-profile.log" ;;
tower)
  timeout ${TOWER_S:-150} python3 scripts/vision_tower_bench.py $MODEL --batch 1,32 --out "$OUT/vlm-tower.json" 2>&1 | grep -E "images/s|Error" ;;
esac
done
