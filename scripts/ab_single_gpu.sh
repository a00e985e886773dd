#!/usr/bin/env bash
# A/B of the single-GPU engine in one device call: an older tree (ab_old: `mkdir ab_old && git archive REV | tar -x -C ab_old`,
# not committed; its tests/, docs/ and demo weights may be dropped to fit the device's 64 MiB) against the working tree,
# alternated twice (llama-3-8b, random weights, batch 1 and 32). Each tree is installed non-editable into its own folder.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
for tree in new old; do dir=.; [[ $tree == old ]] && dir=ab_old
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ab_$tree ./$dir >"$OUT/install_$tree.log" 2>&1 \
    || { echo "install $tree failed"; tail -5 "$OUT/install_$tree.log"; }
done
bench() { (cd /tmp && AUTODEPLOY_CONFIG= PYTHONPATH=/tmp/ab_${1%2}:/tmp/site timeout ${AB_S:-200} python3 -m autodeploy bench llama-3-8b \
  --set weights=random --batch 1,32 --input-len 128 --output-len 128 --repeats 1 --no-progress --out "$OUT/bench_$1.json" \
  > "$OUT/bench_$1.log" 2>&1); echo "== $1 rc=$?"; grep "autodeploy " "$OUT/bench_$1.log"; }
for tree in ${AB_ORDER:-new old new2 old2}; do bench $tree; done
