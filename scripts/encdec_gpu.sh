#!/bin/bash
# Issue 44 on the device: an encoder–decoder's GPU tests and check, then the BART-large- and T5-large-shape benchmarks
# (random weights; MODELS picks): 512-token inputs, 128 tokens out, batch 1 and 64 against HF eager and compiled
# `generate` in the same run, and 64 concurrent; STAGE=profile profiles a batch-64 decode step. DTYPE (default bfloat16:
# the checkpoints' config says float32, which nobody serves on a GPU) sets the dtype of every run, HF's included;
# EXTRA='--set scheduler.max_num_tokens=8192' adds settings to the bench stage's autodeploy runs.
#   OUT=/tmp/o STAGE=tests,check,bench bash scripts/encdec_gpu.sh; tar czf $OUT/o.tgz -C /tmp o
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site AUTODEPLOY_CONFIG=
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p "$OUT"
for stage in $(echo ${STAGE:-check,bench} | tr , ' '); do
case $stage in
tests)  # the GPU tests of the encoder-decoder path: the dense cross-attention captured, tiny BART's and T5's decode
  # graphs, the Triton paged kernels with T5's distance_bias
  AUTODEPLOY_CONFIG=tests/gpu.yaml timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -x \
    ${TESTS:-tests/custom_ops/test_cached_cross_attention.py tests/test_encoder_decoder.py tests/runtime/test_cuda_graphs.py} \
    tests/custom_ops/test_paged_attention_triton.py tests/custom_ops/test_cached_attention_rope.py \
    -k "gpu or cuda or captured or distance_bias" > "$OUT/encdec-tests.log" 2>&1; echo "tests rc=$?"; tail -5 "$OUT/encdec-tests.log" ;;
check)  # tiny BART and mBART on the GPU (bf16 and float32): greedy against HF generate, the build verified
  timeout ${CHECK_S:-120} python3 - <<'PY' 2>&1 | grep -E "^(bart|mbart)|Error" | tee "$OUT/encdec-check.log"
import tempfile, torch
from autodeploy import autodeploy, SamplingParams
from tests.tiny_seq2seq_models import hf_generate_greedy, lively
for kind in ("bart", "mbart"):
    model = lively(kind)
    folder = tempfile.mkdtemp(); model.save_pretrained(folder)
    llm = autodeploy(folder, device="cuda", dtype="float32", max_batch_size=8)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 60))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    same = [o.outputs[0].token_ids == hf_generate_greedy(model, p, 12) for p, o in zip(prompts, outs)]
    print(kind, "greedy identical:", same, llm.verification)
    llm.shutdown()
PY
  ;;
bench)
  common="--set weights=random --set dtype=${DTYPE:-bfloat16} --repeats 1 --no-progress ${EXTRA:-}"
  for MODEL in ${MODELS:-bart-large t5-large}; do
  timeout ${BENCH_S:-300} python3 -m autodeploy bench $MODEL $common --workload synthetic --batch 1,64 --input-len 512 --output-len 128 \
    --compare hf-eager,hf-compile --out "$OUT/$MODEL-synthetic.json" > "$OUT/$MODEL-synthetic.log" 2>&1; echo "synthetic rc=$?"
  grep -E "/autodeploy|/hf-|×" "$OUT/$MODEL-synthetic.log" | head -20
  timeout ${CONC_S:-200} python3 -m autodeploy bench $MODEL $common --workload concurrency --concurrency 1,64 --num-requests ${NUM_REQUESTS:-128} \
    --input-dist fixed:512 --output-dist fixed:128 --out "$OUT/$MODEL-c64.json" > "$OUT/$MODEL-c64.log" 2>&1; echo "concurrency rc=$?"
  grep -E "/autodeploy" "$OUT/$MODEL-c64.log" | head
  done ;;
profile)  # where a batch-64 decode step's time goes (host against kernels; which cross kernel ran)
  timeout ${PROFILE_S:-200} python3 scripts/profile_encdec_decode.py ${PROFILE_MODEL:-bart-large} 64 --set dtype=${DTYPE:-bfloat16} ${PROFILE_ARGS:-} > "$OUT/encdec-profile.log" 2>&1
  echo "profile rc=$?"; grep -E "^steps|steps at batch|steps encoding|cross_attention" "$OUT/encdec-profile.log" | head -8 ;;
esac
done
