#!/usr/bin/env bash
# Issue 42 on the device, one call: train the speculative-decoding target on the demo model's tokenizer (its
# weights do not travel back: trained and measured in the same call), then bench it without speculation, with
# the demo model as its draft, and with prompt lookup, each against the same engine without speculation.
#   OUT=$OUT TRAIN_MINUTES=4 bash scripts/spec_pair_gpu.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site; python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
DEMO=autodeploy/assets/tiny-code-llama TARGET=/tmp/spec-target
timeout $(( ${TRAIN_MINUTES:-4} * 60 + 120 )) python3 scripts/train_demo_model.py --device cuda --compile --seed 0 \
  --tokenizer $DEMO --hidden-size 768 --intermediate-size 2048 --layers 12 --batch-size 64 --seq-len 512 \
  --minutes ${TRAIN_MINUTES:-4} --metrics-json "$OUT/train.json" --out $TARGET > "$OUT/train.log" 2>&1
echo "train rc=$?"; grep -E "^model:|best|eval" "$OUT/train.log" | tail -3
bench() { local name=$1; shift; AUTODEPLOY_CONFIG= timeout ${BENCH_S:-150} python3 -m autodeploy bench $TARGET "$@" \
  --batch ${BATCHES:-1,8,32} --input-len 256 --output-len 128 --repeats 1 --no-progress --out "$OUT/$name.json" \
  > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"; grep -E "autodeploy |no-speculation |/no-speculation|drafted a step" "$OUT/$name.log"; }
bench draft --speculative-method draft --speculative-model $DEMO --speculative-num-tokens ${K:-4}
bench ngram --speculative-method ngram --speculative-num-tokens ${K:-4}
