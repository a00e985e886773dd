"""Where one engine step spends its time on the GPU: schedule, forward (inputs + graph), sampling.

Llama-3-8B-shaped config, random bf16 weights; B requests of 128 prompt tokens. Prints, for decode
steps, the median milliseconds of each phase (device synchronised between phases), then the torch
profiler's top CUDA and CPU ops for one decode step. Decode steps replay CUDA graphs unless run with
``--set compile.backend=none``. Run: python scripts/profile_engine_step.py [B,...] [--set key=value ...]
"""

import statistics
import sys
import time

import torch

from autodeploy import SamplingParams, autodeploy

BATCHES = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,256").split(",")]
SETS = [a for a in sys.argv[2:] if a != "--set"]
llm = autodeploy("llama-3-8b", weights="random", max_batch_size=max(BATCHES), set_arguments=SETS)
engine = llm.engine


def clock() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


for batch in BATCHES:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for row in range(batch):
        engine.add_request([(row * 7 + i) % 30000 + 10 for i in range(128)], params)
    phases = {"schedule": [], "forward": [], "advance": []}
    step = 0
    while engine.has_unfinished():
        t0 = clock()
        plan = engine.scheduler.schedule()
        t1 = clock()
        with torch.inference_mode():
            if step == 20:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                    logits, completing = engine.forward(plan.chunks)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
                events = prof.key_averages()
                launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"))
                kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in events
                                if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
                print(f"B={batch} step 20: {launches} host launch calls, {kernel_us / 1000:.2f} ms of CUDA kernel time, "
                      f"graph replayed: {engine.decode_graphs is not None and engine.decode_graphs.serves(plan.chunks)}")
            else:
                logits, completing = engine.forward(plan.chunks)
        t3 = clock()
        for chunk in plan.chunks:
            chunk.sequence.num_computed = chunk.start + chunk.length
            engine.pool.register_full_blocks(chunk.sequence.seq_id, chunk.sequence.token_ids, chunk.sequence.num_computed)
        engine._advance([plan.chunks[i].sequence for i in completing], logits)
        t4 = clock()
        if all(c.length == 1 for c in plan.chunks):
            for name, seconds in zip(phases, (t1 - t0, t3 - t1, t4 - t3)):
                phases[name].append(1000 * seconds)
        step += 1
    print(f"B={batch}: decode step ms (median) " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in phases.items()), flush=True)
