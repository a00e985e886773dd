#!/bin/bash
# Issue 45 on the device: the embedding path's GPU tests (the packed bidirectional_attention kernels, a tiny BERT in
# bfloat16), then the BERT-base-shape throughput against sentence-transformers (scripts/embed_bench.py); STAGE=batch: a
# batch job against the same requests online, Llama-3-8B shape (scripts/batch_vs_online.py). One call:
#   R=$OUT; export OUT=/tmp/o; STAGE=tests,bench,batch bash scripts/embed_gpu.sh; tar czf $R/o.tgz -C /tmp o
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site AUTODEPLOY_CONFIG=
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p "$OUT"
for stage in $(echo ${STAGE:-tests,bench} | tr , ' '); do
case $stage in
tests)
  timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/custom_ops/test_bidirectional_attention_varlen.py \
    tests/test_embeddings.py -k "gpu or cuda" > "$OUT/embed-tests.log" 2>&1; echo "tests rc=$?"; tail -4 "$OUT/embed-tests.log" ;;
bench)
  for shape in ${SHAPES:-bert-base qwen3-embedding-0.6b}; do
    timeout ${BENCH_S:-240} python3 scripts/embed_bench.py --shape $shape --device cuda --dtype ${DTYPE:-bfloat16} \
      --texts ${TEXTS:-8192} --max-num-tokens ${BUDGET:-16384} > "$OUT/embed-bench-$shape.log" 2>&1; echo "$shape rc=$?"
    grep -vE "Writing|Loading|DEBUG" "$OUT/embed-bench-$shape.log" | tail -9
  done ;;
batch)
  timeout ${BATCH_S:-300} python3 scripts/batch_vs_online.py ${BATCH_MODEL:-llama-3-8b} --set weights=random --set dtype=bfloat16 \
    --requests ${REQUESTS:-2000} --concurrency ${CONCURRENCY:-64,128,256} > "$OUT/batch-vs-online.log" 2>&1; echo "batch rc=$?"
  grep -E "requests|online|batch:|ratio|Error" "$OUT/batch-vs-online.log" | tail -8 ;;
esac
done
