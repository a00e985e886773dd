"""Where a speculative decoding step's time goes on the GPU (issue 42): the trained pair's shape (hidden 768, 24
layers, the demo model's tokenizer and vocabulary) with random weights and a random EAGLE-3 head, B requests
decoding with ``auto`` off, so every step drafts. For each B: the wall time per step with and without
speculation, then the torch profiler over a few steps with the engine's phases marked (drafting, planning and
staging, the forward, sampling, applying tokens): each phase's host time and the GPU time under it, then the
kernels by GPU time.
Run: python scripts/profile_speculation.py [B,...] [--tree-width W] [--num-tokens K] [--batch-invariant]
"""

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from autodeploy import SamplingParams, autodeploy
from autodeploy.runtime import engine as engine_module
from autodeploy.runtime.eagle3 import Eagle3Config, Eagle3Head, eagle3_config, save_eagle3_head

DEMO = Path(__file__).parent.parent / "autodeploy" / "assets" / "tiny-code-llama"


def target_folder(root: Path) -> Path:
    folder = root / "target"
    folder.mkdir()
    config = json.loads((DEMO / "config.json").read_text())
    config.update(hidden_size=768, intermediate_size=2048, num_hidden_layers=24, num_attention_heads=12,
                  num_key_value_heads=12, head_dim=64)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / name, folder / name)
    return folder


def head_folder(root: Path, target: Path) -> Path:
    config = LlamaConfig(**json.loads((target / "config.json").read_text()))
    head = Eagle3Head(Eagle3Config.from_dict(eagle3_config(config, layers=[2, 12, 21])), config.num_hidden_layers)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.02) if parameter.dim() > 1 else parameter.fill_(1.0)
    return save_eagle3_head(head, root / "head")


def steps(engine, batch: int, marked: bool) -> list[float]:
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    requests = [engine.add_request([(row * 7 + i) % 8000 + 10 for i in range(200)], params) for row in range(batch)]
    seconds = []
    while engine.has_unfinished():
        decoding = all(r.sequences[0].num_computed >= 200 for r in requests)
        torch.cuda.synchronize()
        began = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if decoding:
            seconds.append(time.perf_counter() - began)
    return seconds


def mark(obj, name: str, label: str) -> None:
    function = getattr(obj, name)

    def marked(*args, **kwargs):
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)

    setattr(obj, name, marked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", nargs="?", default="1,8,32")
    parser.add_argument("--tree-width", type=int, default=1)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--batch-invariant", action="store_true", help="both engines with batch_invariant: true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    root = Path(tempfile.mkdtemp())
    target = target_folder(root)
    head = head_folder(root, target)
    common = dict(weights="random", max_batch_size=max(batches), kv_cache={"memory_fraction": 0.2},
                  batch_invariant=args.batch_invariant)
    plain = autodeploy(str(target), **common)
    spec = autodeploy(str(target), **common,
                      speculative={"method": "eagle3", "model": str(head), "num_tokens": args.num_tokens,
                                   "tree_width": args.tree_width, "auto": False})
    engine = spec.engine
    speculator = engine.speculator
    mark(speculator, "extend", "speculator.extend (drafting)")
    mark(engine.runner, "stage", "runner.stage")
    mark(engine.tokens, "apply", "tokens.apply")
    mark(speculator, "observe", "speculator.observe")
    mark(engine_module, "launch_sampling", "launch_sampling")
    for batch in batches:
        base = statistics.median(steps(plain.engine, batch, False)[5:])
        spec_steps = steps(engine, batch, False)
        print(f"B={batch}: decode step {base * 1e3:.3f} ms; speculative step {statistics.median(spec_steps[5:]) * 1e3:.3f} ms "
              f"({len(spec_steps)} steps), acceptance length {speculator.stats.acceptance_length:.2f}")
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        requests = [engine.add_request([(row * 5 + i) % 8000 + 10 for i in range(200)], params) for row in range(batch)]
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished():
            engine.step()
        del requests
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=48))
        # The device's side: the kernels (those the drafting and verification graphs replay included) by GPU time.
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
