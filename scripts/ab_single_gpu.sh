#!/usr/bin/env bash
# A/B of the single-GPU engine in one device call: an older tree (ab_old: `mkdir ab_old && git archive REV | tar -x -C ab_old`,
# not committed) against the working tree, alternated twice (llama-3-8b, random weights, batch 1 and 32).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1
bench() { AUTODEPLOY_CONFIG= timeout 200 python3 -m autodeploy bench llama-3-8b --set weights=random --batch 1,32 --input-len 128 \
  --output-len 128 --repeats 1 --no-progress --out "$OUT/bench_$1.json" > "$OUT/bench_$1.log" 2>&1; echo "== $1 rc=$?"; grep "autodeploy " "$OUT/bench_$1.log"; }
for tree in new old new2 old2; do
  dir=.; [[ $tree == old* ]] && dir=ab_old
  python3 -m pip install -q --no-deps --no-build-isolation -e $dir >/dev/null 2>&1
  (cd $dir && bench $tree)
done
