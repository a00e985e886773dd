"""Output tokens/s on the GPU: autodeploy's engine against Hugging Face eager ``generate``, same run.

Llama-3-8B-shaped config with random bf16 weights; every request has a 128-token random prompt and
produces exactly 128 tokens (greedy, EOS ignored). For each concurrency B, B requests are submitted at
once; tokens/s = B·128 / wall time (prefill included). HF runs first and is freed before autodeploy
builds, so each gets the whole GPU. Prints a table; writes JSON to $OUT/bench_gpu_generate.json.
Run: python scripts/bench_gpu_generate.py [model] [batch,...]
"""

import gc
import json
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from autodeploy import SamplingParams, autodeploy
from autodeploy.models.source import resolve_model_source

MODEL = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
BATCHES = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,32,256").split(",")]
PROMPT_LEN = OUTPUT_LEN = 128


def prompts(batch: int, vocab: int) -> torch.Tensor:
    return torch.randint(10, vocab - 10, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


config = AutoConfig.from_pretrained(resolve_model_source(MODEL, "random").directory)
results = {"model": MODEL, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "hf_eager": {}, "autodeploy": {}}


def measure_hf() -> None:
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    for batch in BATCHES:
        ids = prompts(batch, config.vocab_size).cuda()

        def hf_generate():
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                            min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)

        if batch == BATCHES[0]:
            timed(hf_generate)  # warm-up
        seconds = timed(hf_generate)
        results["hf_eager"][batch] = batch * OUTPUT_LEN / seconds
        print(f"hf eager   B={batch:<4} {seconds:7.2f} s  {batch * OUTPUT_LEN / seconds:9.1f} tok/s", flush=True)


measure_hf()  # the model is freed on return
gc.collect()
torch.cuda.empty_cache()

start = time.perf_counter()
llm = autodeploy(MODEL, weights="random", max_batch_size=max(BATCHES))
results["deploy_seconds"] = time.perf_counter() - start
engine = llm.engine
results["kv_blocks"] = engine.pool.num_blocks
print(f"deploy {results['deploy_seconds']:.1f} s; KV pool {engine.pool.num_blocks} blocks of {engine.pool.block_size}", flush=True)
params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
timed(lambda: llm.generate(prompts(4, config.vocab_size).tolist(), params))  # warm-up: kernel compilation
for batch in BATCHES:
    batch_prompts = prompts(batch, config.vocab_size).tolist()
    seconds = timed(lambda: llm.generate(batch_prompts, params))
    results["autodeploy"][batch] = batch * OUTPUT_LEN / seconds
    print(f"autodeploy B={batch:<4} {seconds:7.2f} s  {batch * OUTPUT_LEN / seconds:9.1f} tok/s", flush=True)

print("\n| concurrent requests | HF eager tok/s | autodeploy tok/s | ratio |\n|---|---|---|---|")
for batch in BATCHES:
    hf_rate, ours = results["hf_eager"][batch], results["autodeploy"][batch]
    print(f"| {batch} | {hf_rate:.0f} | {ours:.0f} | {ours / hf_rate:.2f}× |")
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "bench_gpu_generate.json"), "w") as f:
        json.dump(results, f, indent=1)
