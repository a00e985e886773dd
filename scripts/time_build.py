"""How long a build takes: ``autodeploy(model)`` until the engine can serve (KV pool, CUDA graphs).

Prints the total and the time of each stage, then serves one token. Run it twice over the same cache
folders for the warm figure (the autotuner's decisions, Triton's compiled kernels):
    XDG_CACHE_HOME=/tmp/c TRITON_CACHE_DIR=/tmp/c/triton python scripts/time_build.py   # cold, then warm
"""

import sys
import time
from collections import defaultdict

from autodeploy import SamplingParams, autodeploy

MODEL = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
began = time.perf_counter()
llm = autodeploy(MODEL, weights="random")
built = time.perf_counter()
llm.engine
ready = time.perf_counter()
stages: dict[str, float] = defaultdict(float)
for record in llm.records:
    stages[record.stage] += record.seconds
print(f"build {ready - began:.1f} s: pipeline + verification {built - began:.1f} s, engine (KV pool, CUDA graphs) "
      f"{ready - built:.1f} s; stages: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
