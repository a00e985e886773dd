"""A batch job against the same requests sent online (issue 45's target: ``autodeploy batch`` ≥ 1.1× the online engine's
output tok/s at its best concurrency, same run).

``--requests`` completion requests of ``--input-len`` (uniform range) prompt tokens and ``--output-len`` output tokens
(``ignore_eos``, greedy); each prompt starts with one of ``--prefixes`` shared instructions of 128 tokens, as a dataset
job's prompts do. Online: the requests in their random order, through the server's ``/v1/completions`` route in
process, ``c`` in flight, for each ``--concurrency``; batch: the same requests as a batch file through ``run_batch_file``
(its order: shared prefixes together; its concurrency: twice ``max_batch_size``). Both on one engine, one after the other.

    python3 scripts/batch_vs_online.py llama-3-8b --set weights=random --requests 2000 --concurrency 64,128,256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autodeploy import autodeploy  # noqa: E402
from autodeploy.serve.app import ServerOptions, build_app  # noqa: E402
from autodeploy.serve.batch_job import run_batch_file  # noqa: E402


def requests(count: int, input_len: tuple[int, int], output_len: tuple[int, int], prefixes: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(prefixes)]
    bodies = []
    for _ in range(count):
        length = max(rng.randint(*input_len), 129)
        prompt = rng.choice(shared) + [rng.randrange(100, vocab) for _ in range(length - 128)]
        bodies.append({"prompt": prompt, "max_tokens": rng.randint(*output_len), "temperature": 0, "ignore_eos": True})
    return bodies


async def online(llm, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    """Output tokens a second with ``concurrency`` requests in flight, in the bodies' order; and the tokens."""
    import httpx

    app = build_app(llm, ServerOptions(served_model_name="m", max_queued_requests=max(concurrency, 1), queue_timeout_s=1e9))
    pending = iter(bodies)
    tokens = 0

    async def worker(client):
        nonlocal tokens
        for body in pending:
            response = await client.post("/v1/completions", json={"model": "m", **body})
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://online", timeout=None) as client:
            began = time.perf_counter()
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
            seconds = time.perf_counter() - began
    return tokens / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--input-len", default="64,1024")
    parser.add_argument("--output-len", default="16,256")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--concurrency", default="64,128,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    llm = autodeploy(args.model, set_arguments=args.sets)
    span = [tuple(int(x) for x in value.split(",")) for value in (args.input_len, args.output_len)]
    bodies = requests(args.requests, span[0], span[1], args.prefixes, llm.vocab_size, args.seed)
    print(f"{args.requests} requests, {span[0][0]}-{span[0][1]} in / {span[1][0]}-{span[1][1]} out, {args.prefixes} shared "
          f"128-token prefixes; max_batch_size {llm.settings.max_batch_size}")
    asyncio.run(online(llm, bodies[:32], 32))  # warm-up
    best = None
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        rate, tokens = asyncio.run(online(llm, bodies, concurrency))
        print(f"online, concurrency {concurrency}: {rate:,.1f} output tok/s ({tokens} tokens)")
        best = max(best or (0, 0), (rate, concurrency))
    folder = Path(tempfile.mkdtemp(prefix="batch-vs-online-"))
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
                              for i, body in enumerate(bodies)))
    summary = run_batch_file(llm, source, folder / "out.jsonl", served_model_name="m", progress=False)
    rate = summary.output_tokens / summary.seconds
    print(f"batch: {rate:,.1f} output tok/s; {summary.line()}")
    print(f"ratio: {rate / best[0]:.2f}× online at its best concurrency ({best[1]})")


if __name__ == "__main__":
    main()
