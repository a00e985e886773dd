#!/usr/bin/env bash
# Issue 42 on the device: the trained pair. STAGE=train trains the target (the demo model's tokenizer and corpus,
# ~153M parameters), its EAGLE-3 head and an MTP layer (a copy of the target with it) into build/spec-pair/ (ignored: a warm machine keeps it for the next
# call; the weights never travel back); STAGE=bench measures eagle3, mtp, draft (the demo model) and n-gram against the
# same engine without speculation on prompts that quote code (scripts/code_rewrite_prompts.py), and STAGE=identity
# checks greedy identity on 100 prompts (BATCH_INVARIANT=1: both runs with batch_invariant: true).
#   OUT=$OUT STAGE=train,bench,identity bash scripts/spec_pair_gpu.sh  (or one stage a call on a warm machine)
# STAGE=tests runs the GPU tests of the speculative paths and the kernels they use (TESTS_S seconds at most).
# The device returns at most 8 files from $OUT: write to another folder and pack it, e.g.
#   OUT=/tmp/o STAGE=... bash scripts/spec_pair_gpu.sh; tar czf $OUT/o.tgz -C /tmp o
# One call of at most 10 minutes (machine starts are scarce; a warm machine goes back after 30 s idle):
#   OUT=$OUT STAGE=tests,train,identity,bench TESTS_S=90 TRAIN_MINUTES=1.2 EAGLE_MINUTES=1.0 HEADS=eagle3 \
#     METHODS=eagle3 BATCH_INVARIANT=1 IDENTITY_S=110 AUTO=true CONCURRENCY=1,8 NUM_REQUESTS=16 BENCH_S=100 \
#     bash scripts/spec_pair_gpu.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
python3 -c "import omegaconf" 2>/dev/null || PYTHONPATH=/tmp/site python3 -c "import omegaconf" 2>/dev/null || \
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site; python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
DEMO=autodeploy/assets/tiny-code-llama PAIR=build/spec-pair; TARGET=$PAIR/target HEAD=$PAIR/eagle3 PROMPTS=$PAIR/code-rewrite.jsonl
mkdir -p $PAIR
# STAGE may name several stages, comma-separated, run in order in one call (e.g. train,bench: the weights never
# have to outlive a machine's idle release).
for stage in $(echo ${STAGE:-train} | tr , ' '); do
case $stage in
tests)
  AUTODEPLOY_CONFIG= timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -n 8 tests/custom_ops/test_batch_invariant.py \
    tests/runtime/test_batch_invariant.py tests/custom_ops/test_slot_attention.py tests/runtime/test_eagle3.py tests/runtime/test_mtp.py \
    tests/runtime/test_tree_drafts.py tests/runtime/test_speculative.py tests/runtime/test_structured_output.py \
    -k "gpu or cuda or invariant" > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -12 "$OUT/tests.log" ;;
train)
  limit() { python3 -c "print(int(float('$1') * 60 + 120))"; }  # minutes may be fractional
  timeout $(limit ${TRAIN_MINUTES:-3}) python3 scripts/train_demo_model.py --device cuda --compile --seed 0 \
    --tokenizer $DEMO --hidden-size 768 --intermediate-size 2048 --layers 24 --batch-size 64 --seq-len 512 \
    --minutes ${TRAIN_MINUTES:-3} --metrics-json "$OUT/train.json" --out $TARGET > "$OUT/train.log" 2>&1
  echo "target rc=$?"; grep -E "^model:|best|eval" "$OUT/train.log" | tail -3
  # HEADS: which heads to train (default both; "eagle3" alone leaves the MTP benchmark out).
  case " ${HEADS:-eagle3 mtp} " in *" eagle3 "*)
    timeout $(limit ${EAGLE_MINUTES:-2}) python3 scripts/train_eagle3_head.py --target $TARGET --out $HEAD \
      --minutes ${EAGLE_MINUTES:-2} --seed 0 --metrics-json "$OUT/eagle3.json" > "$OUT/eagle3.log" 2>&1
    echo "eagle3 rc=$?"; tail -1 "$OUT/eagle3.log" ;; esac
  case " ${HEADS:-eagle3 mtp} " in *" mtp "*)
    timeout $(limit ${MTP_MINUTES:-1}) python3 scripts/train_eagle3_head.py --kind mtp --target $TARGET \
      --out $PAIR/target-mtp --minutes ${MTP_MINUTES:-1} --seed 0 --metrics-json "$OUT/mtp.json" > "$OUT/mtp.log" 2>&1
    echo "mtp rc=$?"; tail -1 "$OUT/mtp.log" ;; esac
  python3 scripts/code_rewrite_prompts.py --out $PROMPTS --count 200 --output-len 128 ;;
bench)
  bench() { local name=$1 model=$2; shift 2; AUTODEPLOY_CONFIG= timeout ${BENCH_S:-170} python3 -m autodeploy bench $model "$@" \
    --workload concurrency --concurrency ${CONCURRENCY:-1,8,32} --num-requests ${NUM_REQUESTS:-32} --dataset $PROMPTS \
    --repeats 1 --no-progress --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"
    grep -E "/autodeploy: output|drafted a step|pays|Error" "$OUT/$name.log"; }
  # METHODS: eagle3, mtp, draft, ngram; eagle3-tree and mtp-tree draft trees TREE_WIDTH wide (default 2).
  for name in ${METHODS:-eagle3 mtp draft ngram}; do
    method=${name%-tree}; tree=; [ "$method" != "$name" ] && tree="--speculative-tree-width ${TREE_WIDTH:-2}"
    target=$TARGET; case $method in eagle3) draft="--speculative-model $HEAD" ;; draft) draft="--speculative-model $DEMO" ;;
      mtp) draft= target=$PAIR/target-mtp ;; *) draft= ;; esac
    # AUTOS: run each method with each auto setting named ("false true"); AUTO: one; neither: the default.
    for auto in ${AUTOS:-${AUTO:-default}}; do
      [ "$auto" = default ] && auto=
      bench $name${auto:+-auto-$auto} $target --speculative-method $method $draft $tree --speculative-num-tokens ${K:-4} \
        ${auto:+--set speculative.auto=$auto}
    done
  done ;;
identity)
  for name in ${METHODS:-eagle3 mtp draft}; do
    method=${name%-tree}; tree=; [ "$method" != "$name" ] && tree="--tree-width ${TREE_WIDTH:-2}"
    target=$TARGET; case $method in eagle3) model=$HEAD ;; draft) model=$DEMO ;; mtp) model= target=$PAIR/target-mtp ;; *) model= ;; esac
    timeout ${IDENTITY_S:-200} python3 scripts/spec_identity.py $target --dataset $PROMPTS --count 100 --method $method \
      ${model:+--draft $model} $tree ${DTYPE:+--dtype $DTYPE} ${BATCH_INVARIANT:+--batch-invariant} \
      --out "$OUT/identity-$name${DTYPE:+-$DTYPE}${BATCH_INVARIANT:+-invariant}.json" 2>&1 | grep -E "^identity|Error" | cut -c1-600
  done ;;
esac
done
