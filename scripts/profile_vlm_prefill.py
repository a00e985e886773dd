"""Where a vision-language model's prefill time goes on the GPU (issue 43: 64 simultaneous LLaVA requests waited
3.4 s for their first token, ~12k prompt tokens/s, where the GEMMs alone should give ~45 ms a 2,048-token step).

LLaVA-1.5-7B shape, random weights: ``N`` requests (default 64) of one 336×336 image and a 64-token question arrive
together and each generates one token, so every step is prefill. Prints each step's wall time and tokens, then a
profile of the whole burst: the CUDA kernels by time, the GEMMs' share, and the host time the steps took beyond the
device's (an eager step — a prefill carrying image rows replays no graph — pays every launch on the host).

    python3 scripts/profile_vlm_prefill.py [N] [--set key=value ...]
"""

import sys
import time

import numpy as np
import torch
from PIL import Image

from autodeploy import SamplingParams, autodeploy

REQUESTS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 64
SETS = [a for a in sys.argv[1:] if a != "--set" and not a.isdigit()]
GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "matmul", "_mm_")

llm = autodeploy("llava-1.5-7b", weights="random", max_batch_size=REQUESTS, set_arguments=SETS)
engine = llm.engine
rng = np.random.default_rng(0)


def burst(seed: int) -> list:
    """``REQUESTS`` new requests, each its own image (no encoder-cache or prefix-cache hits) and question."""
    prompts = []
    for index in range(REQUESTS):
        pixels = rng.integers(0, 255, (336, 336, 3), dtype=np.uint8)
        question = [(7 * i + 131 * index + 1000 * seed) % 30000 + 10 for i in range(64)]
        prompts.append({"prompt": [1, llm.deployment.image_token_id, *question], "images": [Image.fromarray(pixels)]})
    return prompts


params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
llm.generate(burst(0)[:4], params)  # warm-up: kernels compile, graphs capture
steps = []
requests = [engine.add_request(prompt, params) for prompt in burst(1)]
torch.cuda.synchronize()
began = time.perf_counter()
while engine.has_unfinished():
    start = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    steps.append(time.perf_counter() - start)
total = time.perf_counter() - began
tokens = sum(len(r.prompt_token_ids) for r in requests)
print(f"{REQUESTS} requests, {tokens} prompt tokens in {len(steps)} steps, {total:.2f} s: {tokens / total:.0f} prompt tokens/s; "
      f"steps (ms): {', '.join(f'{1e3 * s:.0f}' for s in steps)}")

requests = [engine.add_request(prompt, params) for prompt in burst(2)]
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    wall = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
events = prof.key_averages()
print(events.table(sort_by="self_cuda_time_total", row_limit=20))
cuda = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
gemm_us = sum(e.self_device_time_total for e in cuda if any(k in e.key.lower() for k in GEMM_NAMES))
total_us = sum(e.self_device_time_total for e in cuda)
print(f"profiled burst: wall {wall:.2f} s, CUDA kernels {total_us / 1e6:.2f} s (GEMMs {gemm_us / 1e6:.2f} s); "
      f"the rest, {wall - total_us / 1e6:.2f} s, is host time the device waited for")
