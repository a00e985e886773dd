#!/usr/bin/env bash
# Server overhead on the H200 (issue 14) in one device call: `autodeploy bench --compare server` on the Llama-3-8B
# config with random weights. Every concurrency point runs in-process, then the same requests over HTTP through the
# OpenAI server on the same engine (uvicorn in a thread of the bench process, the client in its own process),
# repeat after repeat; the table's last block gives the server / in-process ratios. Logs and JSON under $OUT.
#   bash scripts/bench_server_gpu.sh                   # concurrency 1 and 64, 128 requests, 128 in / 128 out, 2 repeats
#   REQUESTS=256 REPEATS=1 CONCURRENCY=64 bash scripts/bench_server_gpu.sh
#   STREAM_INTERVAL=4 bash scripts/bench_server_gpu.sh  # the server streams 4 tokens an event (serve --stream-interval)
# Time: concurrency 1 is the long part (each request alone: ~0.55 s at ~240 tok/s, twice per repeat), ~5 min for the
# defaults plus the build; BENCH_S bounds the bench command (default 540 s, under a device call's 10 minutes).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$OUT/cache}"  # the autotuner's decisions
python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1  # the serve wheels: fastapi, uvicorn, httpx, …
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import fastapi, uvicorn, httpx" || { echo "the serve wheels are missing from .whl/"; exit 1; }
t0=$SECONDS
# AUTODEPLOY_CONFIG= : the full KV pool, as a deployment has (the test suite's small-pool settings off).
AUTODEPLOY_CONFIG= timeout "${BENCH_S:-540}" python3 -m autodeploy bench llama-3-8b --set weights=random ${AD_SET:-} \
  --workload concurrency --concurrency "${CONCURRENCY:-1,64}" --num-requests "${REQUESTS:-128}" \
  --input-dist fixed:128 --output-dist fixed:128 --repeats "${REPEATS:-2}" --compare server --no-progress \
  --server-stream-interval "${STREAM_INTERVAL:-1}" \
  --out "$OUT/bench_server.json" > "$OUT/bench_server.log" 2>&1
echo "rc=$? wall=$((SECONDS - t0))s"
grep -v -i "warning" "$OUT/bench_server.log" | tail -n 20 | cut -c1-400
