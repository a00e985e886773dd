"""The Triton path's overhead against in-process generation, on the same deployed model and workload.

    .venv/bin/python scripts/bench_triton.py                        # the demo model, CPU float32, c1 and c16
    .venv/bin/python scripts/bench_triton.py --concurrency 1,16 --num-requests 32 --prompt-len 64 --max-tokens 32

Writes a Triton repository (``autodeploy triton-repo --out DIR --set device=cpu --set dtype=float32``, the demo
model), starts tritonserver on it from ``.venv-triton`` on free loopback ports (as tests/serve/test_triton_server.py
does, ``OMP_NUM_THREADS=1``), and loads the repository's own deployment in this process (one torch thread too).
Each point is a closed loop of at most C requests in flight, measured three ways, back to back:

- in-process: ``AsyncLLM.stream`` over the deployment, C asyncio seats; a token's time is when its output arrives;
- triton llm: ``client.stream_generate`` to the ``llm`` model (gRPC decoupled stream), C client threads;
- triton ensemble: the same to ``ensemble`` (preprocessing → llm → postprocessing);
- triton llm/N, for each N > 1 of ``--stream-interval``: the llm path with a response every N tokens.

Every request: a fixed text prompt (random demo-tokenizer ids decoded; the same prompts for all three), greedy,
``max_tokens`` tokens with ``ignore_eos``; a Triton request counts only if it ends with finish_reason "length"
(so it produced all ``max_tokens``). Prints output tok/s, TTFT p50, TPOT p50 and the ratios Triton / in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: the server gets one thread as well

import torch

from autodeploy import AsyncLLM, SamplingParams, autodeploy
from autodeploy.bench.metrics import RequestTiming, percentile
from autodeploy.cli.main import main as cli
from autodeploy.serve.triton.client import stream_generate
from autodeploy.serve.triton.launch import running_server

ROOT = Path(__file__).resolve().parent.parent
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"


def in_process(async_llm: AsyncLLM, prompts: list[str], concurrency: int, max_tokens: int) -> list[RequestTiming]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> list[RequestTiming]:
        timings, queue = [], iter(prompts)

        async def seat() -> None:
            for prompt in queue:
                arrival, times, produced = time.perf_counter(), [], 0
                async for output in async_llm.stream(prompt, params):
                    new = len(output.outputs[0].new_token_ids)
                    if new:
                        times.append(time.perf_counter())
                        produced += new
                timings.append(RequestTiming(arrival, times, 0, num_output_tokens=produced))

        await asyncio.gather(*(seat() for _ in range(concurrency)))
        return timings

    return asyncio.run(run())


STALLS: list[float] = []  # gaps of 100 ms a response's tokens or more between a Triton request's responses (notes/triton.md)


def over_triton(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, interval: int = 1) -> list[RequestTiming]:
    timings, lock, queue = [], threading.Lock(), iter(prompts)
    STALLS.clear()

    def seat() -> None:
        while True:
            with lock:
                prompt = next(queue, None)
            if prompt is None:
                return
            arrival = time.perf_counter()
            pieces = list(stream_generate(url, prompt, model=model, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                          stream_interval=interval))
            STALLS.extend(gap for a, b in zip(pieces, pieces[1:]) if (gap := b.time - a.time) >= 0.1 * interval)
            if pieces[-1].finish_reason != "length":
                raise RuntimeError(f"{model}: finish_reason {pieces[-1].finish_reason!r}, not 'length'")
            with lock:  # a response per engine step (its text may be empty: a partial character)
                timings.append(RequestTiming(arrival, [p.time for p in pieces], 0, num_output_tokens=max_tokens))

    threads = [threading.Thread(target=seat) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return timings


def figures(timings: list[RequestTiming]) -> dict[str, float]:
    duration = max(t.token_times[-1] for t in timings) - min(t.arrival for t in timings)
    return {"tok/s": sum(t.output_len for t in timings) / duration,
            "ttft_ms": 1e3 * percentile([t.ttft for t in timings], 50),
            "tpot_ms": 1e3 * percentile([t.tpot for t in timings], 50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64, help="random token ids per prompt, before decoding")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-ensemble", action="store_true")
    parser.add_argument("--stream-interval", default="1", help="comma-separated; each N > 1 adds the path 'triton llm/N'")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "repo"
        assert cli(["triton-repo", "--out", str(repository), "--set", "device=cpu", "--set", "dtype=float32"]) == 0
        with running_server(TRITON_PYTHON, repository, Path(tmp) / "tritonserver.log") as endpoints:
            url = endpoints.grpc
            llm = autodeploy(str(next((repository / "llm" / "1").glob("*/manifest.json")).parent))
            async_llm = AsyncLLM(llm)
            tokenizer, rng = llm.tokenizer, random.Random(0)
            prompts = [tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(args.prompt_len)], skip_special_tokens=True)
                       for _ in range(args.num_requests)]
            lengths = sorted(len(tokenizer(p).input_ids) for p in prompts)
            print(f"prompts: {len(prompts)}, {lengths[0]}–{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}); "
                  f"{args.max_tokens} output tokens each (ignore_eos)")
            paths = {"in-process": lambda ps, c: in_process(async_llm, ps, c, args.max_tokens),
                     "triton llm": lambda ps, c: over_triton(url, "llm", ps, c, args.max_tokens)}
            if not args.no_ensemble:
                paths["triton ensemble"] = lambda ps, c: over_triton(url, "ensemble", ps, c, args.max_tokens)
            for interval in (int(n) for n in args.stream_interval.split(",") if int(n) > 1):
                paths[f"triton llm/{interval}"] = lambda ps, c, n=interval: over_triton(url, "llm", ps, c, args.max_tokens, n)
            for measure in paths.values():  # warm-up
                measure(prompts[:8], 4)
            print(f"{'point':<6} {'path':<16} {'tok/s':>8} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}   ratios to in-process")
            for concurrency in map(int, args.concurrency.split(",")):
                base = None
                for name, measure in paths.items():
                    result = figures(measure(prompts, concurrency))
                    base = base or result
                    ratios = "" if result is base else "   " + "  ".join(f"{result[k] / base[k]:.2f}×" for k in result) + \
                        f"   ({len(STALLS)} stalls ≥100 ms a token, {sum(STALLS):.1f} s)"
                    print(f"c{concurrency:<5} {name:<16} {result['tok/s']:8.1f} {result['ttft_ms']:12.1f} {result['tpot_ms']:12.2f}{ratios}",
                          flush=True)
            async_llm.shutdown()
            llm.shutdown()


if __name__ == "__main__":
    main()
