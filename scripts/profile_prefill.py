"""One long prompt's prefill on the GPU: are its GEMMs near the card's matmul rate?

Llama-3-8B-shaped config, random bf16 weights, one prompt of N tokens (default 4096) and one output
token. Measures the card's bf16 matmul rate first (an 8192³ ``torch.mm``, median of 20), then profiles
the prefill step: the GEMM kernels' time and the FLOPs they must do (2 · N · the weights of every linear
but the LM head, which runs on the last position only), their rate against the measured one, and the
top CUDA ops. Run: python scripts/profile_prefill.py [N] [--set key=value ...]
"""

import statistics
import sys

import torch

from autodeploy import SamplingParams, autodeploy

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4096
SETS = [a for a in sys.argv[1:] if a != "--set" and not a.isdigit()]
GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "matmul", "_mm_")


def matmul_tflops(size: int = 8192, repeats: int = 20) -> float:
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * size**3 / statistics.median(times) / 1e12


rate = matmul_tflops()
print(f"measured bf16 matmul rate: {rate:.0f} TFLOP/s (8192^3 torch.mm, median of 20)")
llm = autodeploy("llama-3-8b", weights="random", max_batch_size=1,
                 set_arguments=[f"scheduler.max_num_tokens={TOKENS}", *SETS])
engine = llm.engine
matrices = [p for p in llm.graph.parameters() if p.dim() == 2]
vocab_matrices = [p for p in matrices if p.shape[0] == llm.vocab_size]  # the embedding table and the LM head
linear_weights = sum(p.numel() for p in matrices) - sum(p.numel() for p in vocab_matrices)
gemm_flops = 2 * TOKENS * linear_weights + 2 * vocab_matrices[-1].numel()  # the LM head: the last position only
def prompt(run: int) -> list[int]:
    """A different prompt per run: a repeated one would be served from the prefix cache, not prefilled."""
    return [(7 * i + 1000 * run) % 30000 + 10 for i in range(TOKENS)]


params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
for run in range(2):  # warm-up: Triton compiles, autotuned kernels load
    llm.generate([prompt(run)], params)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    llm.generate([prompt(2)], params)
    torch.cuda.synchronize()
events = prof.key_averages()
print(events.table(sort_by="self_cuda_time_total", row_limit=16))
cuda = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
gemm_us = sum(e.self_device_time_total for e in cuda if any(k in e.key.lower() for k in GEMM_NAMES))
total_us = sum(e.self_device_time_total for e in cuda)
achieved = gemm_flops / (gemm_us / 1e6) / 1e12
print(f"prefill of {TOKENS} tokens: CUDA kernels {total_us / 1000:.1f} ms, GEMMs {gemm_us / 1000:.1f} ms for "
      f"{gemm_flops / 1e12:.1f} TFLOP: {achieved:.0f} TFLOP/s = {100 * achieved / rate:.0f}% of the measured matmul rate")
