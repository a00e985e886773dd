"""GPU smoke check: deploy the Llama-3-8B config with random bf16 weights on CUDA and generate.

Not a benchmark (scripts/bench_gpu_generate.py is): it shows that export on meta, streaming
materialisation on the GPU and generation work on the device's torch/transformers.
Run: python scripts/gpu_smoke.py
"""

import time

import torch

from autodeploy import SamplingParams, autodeploy

start = time.perf_counter()
llm = autodeploy("llama-3-8b", weights="random")
build = time.perf_counter() - start
print(llm.pipeline_report())
print(f"deploy: {build:.1f}s on {llm.settings.device} ({llm.settings.dtype}), "
      f"GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
prompt = list(range(1000, 1128))
params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
llm.generate([prompt], params)
torch.cuda.synchronize()
start = time.perf_counter()
outputs = llm.generate([prompt] * 4, params)
torch.cuda.synchronize()
seconds = time.perf_counter() - start
print(f"generate: 4 x 16 tokens after a 128-token prompt in {seconds:.2f}s; same tokens per row: "
      f"{all(o.token_ids == outputs[0].token_ids for o in outputs)}")
