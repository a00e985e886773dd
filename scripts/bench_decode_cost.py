"""Per-token decode cost against context length, on the CPU, with the embedded demo model.

Cost per output token = (time to generate 33 tokens − time to generate 1) / 32, greedy, one request,
median of 3 runs per context length. Uses only API that every runtime version has, so the same file
measures an older checkout too (``PYTHONPATH=<old checkout> python scripts/bench_decode_cost.py``).
Prints one JSON line per context length.
"""

import json
import statistics
import sys
import time

import torch

from autodeploy import SamplingParams, autodeploy

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
llm = autodeploy(device="cpu", dtype="float32")
generator = torch.Generator().manual_seed(0)


def seconds(prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params)
    return time.perf_counter() - start


seconds([5] * 8, 4)  # warm-up
for context in (32, 128, 256, 512, 960):
    prompt = torch.randint(10, 1000, (context,), generator=generator).tolist()
    runs = [(seconds(prompt, 33) - seconds(prompt, 1)) / 32 for _ in range(3)]
    print(json.dumps({"context": context, "ms_per_token": round(1000 * statistics.median(runs), 2)}), flush=True)
