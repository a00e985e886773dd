#!/bin/bash
# The OpenAI server's stream interval on the CPU demo model: for each interval a server
# (`autodeploy serve --stream-interval N`, float32, one torch thread) and `autodeploy bench --url` against it
# (the client in its own process), ROUNDS times. Figures: notes/bench-server.md, "Stream interval".
#   bash scripts/bench_stream_interval.sh            # INTERVALS="1 4" ROUNDS=2
set -euo pipefail
cd "$(dirname "$0")/.."
INTERVALS=${INTERVALS:-"1 4"}
ROUNDS=${ROUNDS:-2}
for round in $(seq "$ROUNDS"); do
  for n in $INTERVALS; do
    port=$((18700 + n + 10 * round))
    OMP_NUM_THREADS=1 .venv/bin/autodeploy serve --port "$port" --set device=cpu --set dtype=float32 --stream-interval "$n" \
      > "/tmp/autodeploy-serve-$n.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    echo "== round $round, stream interval $n"
    .venv/bin/autodeploy bench --url "http://127.0.0.1:$port" --workload concurrency --concurrency 1,64 --num-requests 64 \
      --input-dist fixed:64 --output-dist fixed:32 --repeats 2 2>&1 | grep -v Warning | tail -6
    kill "$server"
    wait "$server" 2>/dev/null || true
  done
done
