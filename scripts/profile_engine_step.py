"""Where serving steps spend their time on the GPU, through ``engine.step()`` as the bench calls it.

Llama-3-8B-shaped config, random bf16 weights; B requests of 128 prompt tokens, 64 output tokens each.
For each B: the median wall time of a decode step, then the torch profiler over three consecutive decode
steps: CUDA kernel time against wall time (how much of the step the GPU is busy: the rest is the host),
host launch calls, and the top CUDA ops. Decode steps replay CUDA graphs unless run with
``--set compile.backend=none``; the overlapped runtime unless ``--set scheduler.overlap=false``; the
Triton kernels with programmatic dependent launch unless ``--no-pdl`` (custom_ops/triton/launch.py).
Run: python scripts/profile_engine_step.py [B,...] [--no-pdl] [--set key=value ...]
"""

import statistics
import sys
import time

import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.custom_ops.triton import launch

BATCHES = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,256").split(",")]
SETS = [a for a in sys.argv[2:] if a not in ("--set", "--no-pdl")]
launch.DEPENDENT_LAUNCH = "--no-pdl" not in sys.argv[2:]
PROFILED_STEPS = 3
llm = autodeploy("llama-3-8b", weights="random", max_batch_size=max(BATCHES), set_arguments=SETS)
engine = llm.engine
activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

for batch in BATCHES:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    requests = [engine.add_request([(row * 7 + i) % 30000 + 10 for i in range(128)], params) for row in range(batch)]
    decode_ms = []
    while engine.has_unfinished():
        decoding = all(r.sequences[0].num_computed >= 128 for r in requests)
        began = time.perf_counter()
        if decoding and len(decode_ms) == 20:
            torch.cuda.synchronize()
            began = time.perf_counter()
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(PROFILED_STEPS):
                    engine.step()
                torch.cuda.synchronize()
            wall_ms = 1000 * (time.perf_counter() - began) / PROFILED_STEPS
            events = prof.key_averages()
            print(events.table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=110))
            print(events.table(sort_by="self_cpu_time_total", row_limit=10))
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"))
            kernel_ms = sum(getattr(e, "self_device_time_total", 0) for e in events
                            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA) / 1000 / PROFILED_STEPS
            print(f"B={batch}: per decode step (profiled, {PROFILED_STEPS} steps): wall {wall_ms:.2f} ms, CUDA kernels "
                  f"{kernel_ms:.2f} ms (GPU busy {100 * kernel_ms / wall_ms:.0f}%), {launches / PROFILED_STEPS:.0f} host launch calls")
            decode_ms.append(wall_ms)
            continue
        engine.step()
        if decoding:
            decode_ms.append(1000 * (time.perf_counter() - began))
    ttft_ms = statistics.median(1000 * r.metrics().time_to_first_token for r in requests)
    print(f"B={batch}{'' if launch.DEPENDENT_LAUNCH else ' (no PDL)'}: decode step wall ms median {statistics.median(decode_ms):.2f} over {len(decode_ms)} steps, "
          f"TTFT median {ttft_ms:.1f} ms", flush=True)
