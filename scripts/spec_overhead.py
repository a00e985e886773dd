"""What speculation costs where it drafts nothing (issue 42's "never slower" at 128 concurrent requests).

A random-weight target of the trained pair's shape (768 wide, 24 layers, the demo model's tokenizer) and a random
EAGLE-3 head: the head's drafts are never accepted, so ``auto`` should stop drafting and the engine should decode as
fast as without speculation. Runs the same requests through the engine without speculation and with EAGLE-3
``auto`` on, at each ``--batch``, and prints output tok/s, steps, mean host time a step spent in the speculation code,
and the functions that took the host's time (cProfile, cumulative) in the speculative run.

    python3 scripts/spec_overhead.py --device cuda --batch 32,128 --requests 512
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autodeploy import SamplingParams, autodeploy
from autodeploy.runtime.eagle3 import Eagle3Config, Eagle3Head, eagle3_config, save_eagle3_head

DEMO = Path(__file__).resolve().parents[1] / "autodeploy" / "assets" / "tiny-code-llama"


def random_pair(folder: Path) -> tuple[Path, Path]:
    demo = LlamaConfig.from_pretrained(DEMO)
    config = LlamaConfig(vocab_size=demo.vocab_size, hidden_size=768, intermediate_size=2048, num_hidden_layers=24,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                         bos_token_id=demo.bos_token_id, eos_token_id=demo.eos_token_id, torch_dtype="bfloat16")
    torch.manual_seed(0)
    target = folder / "target"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, target / name)
    head = Eagle3Head(Eagle3Config.from_dict(eagle3_config(config, 8192, [2, 12, 21])), config.num_hidden_layers)
    return target, save_eagle3_head(head, folder / "eagle3")


def run(target: Path, speculative, batch: int, prompts: list[list[int]], device: str, profile: bool) -> str:
    llm = autodeploy(str(target), device=device, max_batch_size=batch, speculative=speculative)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(prompts[:batch], params)  # warm-up
    engine = llm.engine
    took: list[float] = []
    kinds: dict[str, list[float]] = {}  # "decode" (decodes alone) or "mixed" (a prefill chunk in the step): wall times
    step, schedule = engine.step, engine.scheduler.schedule
    planned: list = []

    def scheduled():
        plan = schedule()
        planned.append(plan)
        return plan

    def timed():
        planned.clear()
        began = time.perf_counter()
        try:
            return step()
        finally:
            took.append(time.perf_counter() - began)
            mixed = any(chunk.length > 1 + len(getattr(chunk, "draft", ())) for plan in planned for chunk in plan.chunks)
            kinds.setdefault("mixed" if mixed else "decode", []).append(took[-1])

    engine.step, engine.scheduler.schedule = timed, scheduled
    prof = cProfile.Profile() if profile else None
    began = time.perf_counter()
    if prof:
        prof.enable()
    outputs = llm.generate(prompts, params)
    if prof:
        prof.disable()
    wall = time.perf_counter() - began
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    took.sort()
    line = (f"batch {batch} {'eagle3 auto' if speculative else 'no speculation'}{' (profiled)' if prof else ''}: "
            f"{tokens / wall:.0f} output tok/s, {len(took)} steps, {1e3 * wall / max(1, len(took)):.2f} ms a step; "
            f"step() p50 {1e3 * took[len(took) // 2]:.2f} ms, p99 {1e3 * took[int(0.99 * len(took))]:.2f}, max {1e3 * took[-1]:.1f}; "
            + ", ".join(f"{kind} {len(t)} steps {1e3 * sum(t):.0f} ms (mean {1e3 * sum(t) / len(t):.2f})" for kind, t in sorted(kinds.items())))
    if prof:
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(r"speculative|hidden_state_heads|engine|model_runner|scheduler|sampled_tokens", 30)
        line += "\n" + "\n".join(l for l in text.getvalue().splitlines() if "/" in l or "ncalls" in l)
    del engine.step, engine.scheduler.schedule
    llm.shutdown()
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", default="32,128")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="spec-overhead-"))
    target, head = random_pair(folder)
    prompts = [[(37 * i + 101 * r) % 8000 + 10 for i in range(128)] for r in range(args.requests)]
    speculative = {"method": "eagle3", "model": str(head), "num_tokens": 4, "auto": True}
    for batch in (int(b) for b in args.batch.split(",")):
        print(run(target, None, batch, prompts, args.device, False), flush=True)
        print(run(target, speculative, batch, prompts, args.device, not args.no_profile), flush=True)
        print(run(target, None, batch, prompts, args.device, True), flush=True)


if __name__ == "__main__":
    main()
