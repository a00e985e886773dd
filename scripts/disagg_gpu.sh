#!/usr/bin/env bash
# Disaggregated serving on one GPU (issue 46), in one device call: the Llama-3-8B shape with random weights, Poisson
# arrivals of 1,024-in / 128-out requests, first on one aggregated `serve`, then through `autodeploy router` over a
# prefill and a decode worker (separate processes, the GPU's memory split between them), at the same rates; then the
# KV transfer's bytes/s against a device-to-device copy (scripts/kv_transfer_bench.py). JSON and logs under $OUT.
#   STAGE=build,agg bash scripts/disagg_gpu.sh; STAGE=disagg,transfer bash scripts/disagg_gpu.sh   # two calls, one warm machine
# (~5 and ~8 min on an H100: a server of the 8B shape takes ~4 min to start cold — tuning, verification, CUDA graphs;
# the autotuner's cache under $OUT/cache shortens the later starts). On an H100 (2026-12-08) the aggregated server's
# TPOT p99 stayed at 6–7 ms from 2 to 8 req/s (1,024 in / 128 out): the target's point lies at higher rates.
# The report (python3 scripts/disagg_report.py $OUT) finds the first rate where the aggregated server's TPOT p99 passes
# 50 ms and compares the two there: the target is TPOT p99 ≤ 0.6× with output tok/s within 10%.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$OUT/cache}"
export AUTODEPLOY_CONFIG=  # the full KV pool, as a deployment has (the test suite's small-pool settings off)
STAGE=${STAGE:-build,agg,disagg,transfer}
RATES=${RATES:-8,16,32,48,64}
REQUESTS=${REQUESTS:-128}
MODEL_DIR=${MODEL_DIR:-/tmp/llama-3-8b-random}
BENCH_MODEL=${BENCH_MODEL:-llama-3-8b}  # the config bench draws its prompts from (a checkpoint or shipped name)
INPUT_LEN=${INPUT_LEN:-1024}; OUTPUT_LEN=${OUTPUT_LEN:-128}
PIP=${PIP:-1}  # 0: the environment has the wheels already (a CPU rehearsal: MODEL_DIR=a saved tiny model PIP=0 …)
if [[ $PIP == 1 ]]; then
  python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1  # fastapi, uvicorn, httpx, grpcio, protobuf, etcd3gw, …
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
fi
python3 -c "import fastapi, uvicorn, httpx, grpc" || { echo "the serve/disagg wheels are missing from .whl/"; exit 1; }

wait_ready() {  # URL, seconds
  for _ in $(seq 1 "$2"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "not ready: $1"; return 1
}
bench() {  # URL, name
  timeout 420 python3 -m autodeploy bench "$BENCH_MODEL" --url "$1" --served-model-name m --workload poisson --rate "$RATES" \
    --num-requests "$REQUESTS" --input-dist fixed:$INPUT_LEN --output-dist fixed:$OUTPUT_LEN --no-progress \
    --out "$OUT/$2.json" > "$OUT/$2.log" 2>&1
  echo "$2 bench rc=$?"; grep -v -i warning "$OUT/$2.log" | tail -n 12 | cut -c1-300
}
stop_all() { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }

t0=$SECONDS
if [[ $STAGE == *build* && ! -d $MODEL_DIR ]]; then
  timeout 300 python3 -m autodeploy build llama-3-8b --set weights=random --out "$MODEL_DIR" > "$OUT/build.log" 2>&1
  echo "build rc=$? $((SECONDS - t0))s"
fi
if [[ ,$STAGE, == *,agg,* ]]; then
  python3 -m autodeploy -v serve "$MODEL_DIR" --served-model-name m --port 8100 > "$OUT/agg_server.log" 2>&1 &
  wait_ready http://127.0.0.1:8100 360 && echo "agg server ready $((SECONDS - t0))s" && bench http://127.0.0.1:8100 agg
  stop_all; echo "agg done $((SECONDS - t0))s"
fi
if [[ ,$STAGE, == *,disagg,* ]]; then
  # The prefill worker first, taking a third of what its weights leave for its KV pool; the decode worker then takes
  # most of the rest (each process holds its own copy of the weights).
  python3 -m autodeploy -v serve "$MODEL_DIR" --served-model-name m --role prefill --port 8101 \
    --set kv_cache.memory_fraction=${PREFILL_FRACTION:-0.3} > "$OUT/prefill.log" 2>&1 &
  wait_ready http://127.0.0.1:8101 360; echo "prefill worker ready $((SECONDS - t0))s"
  python3 -m autodeploy -v serve "$MODEL_DIR" --served-model-name m --role decode --port 8102 \
    --set kv_cache.memory_fraction=${DECODE_FRACTION:-0.85} > "$OUT/decode.log" 2>&1 &
  wait_ready http://127.0.0.1:8102 360; echo "decode worker ready $((SECONDS - t0))s"
  python3 -m autodeploy router --port 8100 --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102 > "$OUT/router.log" 2>&1 &
  wait_ready http://127.0.0.1:8100 30 && bench http://127.0.0.1:8100 disagg
  curl -s http://127.0.0.1:8102/disagg/load > "$OUT/decode_load.json"; cat "$OUT/decode_load.json"; echo
  curl -s http://127.0.0.1:8100/metrics | grep '^autodeploy_router' | grep -v _created
  stop_all; echo "disagg done $((SECONDS - t0))s"
fi
if [[ ,$STAGE, == *,transfer,* ]]; then
  timeout 300 python3 scripts/kv_transfer_bench.py --model "$MODEL_DIR" --tokens ${TRANSFER_TOKENS:-1024,4096} --blocks 2048 \
    --out "$OUT/kv_transfer.json" > "$OUT/kv_transfer.log" 2>&1
  echo "transfer rc=$?"; grep -v -i warning "$OUT/kv_transfer.log" | tail -n 6
fi
[[ -f $OUT/agg.json && -f $OUT/disagg.json ]] && python3 scripts/disagg_report.py "$OUT"
echo "total $((SECONDS - t0))s"
