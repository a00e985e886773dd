"""Goodput of an OpenAI server under a closed-loop overload: C clients, each sending its next request as soon
as the last one ended, and retrying a refused (503) request at once (the worst client: no back-off, no
Retry-After), for a fixed time. What counts is the output of requests that completed: a server that spends its
time refusing, or lets the refused crowd starve the batch, shows it here.

    python scripts/overload_bench.py --url http://127.0.0.1:8000 --concurrency 64,512 --seconds 30
    python scripts/overload_bench.py --serve "--set device=cpu --set dtype=float32" --concurrency 64,512

With ``--serve`` it starts ``autodeploy serve`` (the demo model, unless the arguments name one) in a process of
its own, so the clients (this process) and the server do not share an interpreter lock. Figures: notes/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


async def _client(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, stop_at: float,
                    totals: dict, latencies: list[float], retry_delay: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    while time.monotonic() < stop_at:
        started = time.monotonic()
        try:
            response = await http.post(f"{url}/v1/completions", json=body)
        except httpx.HTTPError:
            totals["errors"] += 1
            continue
        if response.status_code == 503:
            totals["refused"] += 1
            if retry_delay:
                await asyncio.sleep(retry_delay)
            continue
        if response.status_code != 200:
            totals["errors"] += 1
            continue
        if time.monotonic() <= stop_at:  # only requests that ended inside the window count
            totals["completed"] += 1
            totals["tokens"] += response.json()["usage"]["completion_tokens"]
            latencies.append(time.monotonic() - started)


async def measure(url: str, model: str, concurrency: int, seconds: float, max_tokens: int, retry_delay: float,
                  prompt_tokens: int = 0) -> dict:
    totals = {"completed": 0, "tokens": 0, "refused": 0, "errors": 0}
    latencies: list[float] = []
    prompts: list = [f"def f{i}(x):\n    return x * {i}" for i in range(concurrency)]
    if prompt_tokens:  # token ids: a model without a tokenizer (random weights), a fixed prompt length
        prompts = [[(7 + 131 * i + 17 * j) % 8000 + 3 for j in range(prompt_tokens)] for i in range(concurrency)]
    # A client (and connection) each, as separate clients have: httpx's shared pool costs O(connections) per
    # request. Made before the clock starts: each makes an SSL context, 20 ms apiece.
    clients = [httpx.AsyncClient(timeout=httpx.Timeout(600.0)) for _ in range(concurrency)]
    started = time.monotonic()
    stop_at = started + seconds
    await asyncio.gather(*(_client(clients[i], url, model, prompts[i], max_tokens, stop_at, totals, latencies, retry_delay)
                           for i in range(concurrency)))
    elapsed = time.monotonic() - started
    for client in clients:
        await client.aclose()
    latencies.sort()
    return {
        "concurrency": concurrency, "seconds": round(elapsed, 1), "completed": totals["completed"],
        "output_tok_s": round(totals["tokens"] / seconds, 1), "requests_s": round(totals["completed"] / seconds, 2),
        "refused_s": round(totals["refused"] / seconds, 1), "errors": totals["errors"],
        "latency_p50_s": round(statistics.median(latencies), 2) if latencies else None,
        "latency_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 2) if latencies else None,
    }


@contextlib.contextmanager
def serving(arguments: str):
    """``autodeploy serve`` with ``arguments`` on a free loopback port, in its own process; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "autodeploy", "serve", "--port", str(port), *shlex.split(arguments)]
    log = tempfile.NamedTemporaryFile("w+", prefix="overload-serve-", suffix=".log")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise SystemExit(f"the server did not start: {' '.join(command)}\n{log.read()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL")
    where.add_argument("--serve", metavar="ARGS", help="start `autodeploy serve ARGS` for the run")
    parser.add_argument("--concurrency", default="64,512", help="comma-separated client counts, each its own window")
    parser.add_argument("--seconds", type=float, default=30.0, help="each window's length")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--retry-delay", type=float, default=0.0, help="seconds a refused client waits (0: at once)")
    parser.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                        help="send N token ids as each prompt (for models without a tokenizer); default: short code text")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url.rstrip("/") if args.url else stack.enter_context(serving(args.serve))
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            result = asyncio.run(measure(url, model, concurrency, args.seconds, args.max_tokens, args.retry_delay,
                                         args.prompt_tokens))
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
