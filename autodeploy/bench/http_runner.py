"""Drive a workload through an OpenAI-compatible server over HTTP and time every request: the HTTP twin of
``runner.py``, so ``autodeploy bench --url`` measures what a client of the server sees.

Each request is one streamed ``/v1/completions`` call: the workload's token ids as the prompt, greedy,
``max_tokens`` = its output length, ``ignore_eos`` (vLLM's name, which ``autodeploy serve`` accepts) and
``stream_options.include_usage``. Arrivals follow ``runner.py``: the scheduled time (Poisson, synthetic) or
the moment a seat came free (concurrency); a token's time is when the server-sent event carrying it arrived.
A request counts only when the server's ``usage`` says it produced the requested length; an HTTP error, an
error event, a timeout or a short answer is kept as a failure with its message, so nothing waits forever.

This module imports neither torch nor the engine: ``--compare server`` runs it in a separate process, so the
client's work does not take the server's interpreter lock.

    target = probe_server("http://127.0.0.1:8000")
    measurement = measure_over_http(target, synthetic_workload(8, 128, 128, vocab_size=32000, max_seq_len=2048))
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from autodeploy.bench.metrics import RequestTiming
from autodeploy.bench.workloads import BenchRequest, Workload
from autodeploy.errors import ConfigError, error_summary


@dataclass(frozen=True)
class ServerTarget:
    url: str  # the base URL, without /v1
    model: str  # what requests send as "model"
    api_key: str | None = None
    max_model_len: int | None = None  # from /v1/models, when the server says
    timeout_s: float = 120.0  # the longest wait for the next byte of an answer

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class HttpMeasurement:
    timings: list[RequestTiming]  # the requests that produced their whole output
    failures: list[str]  # one message per request that did not


def probe_server(url: str, served_model_name: str | None = None, api_key: str | None = None, timeout_s: float = 120.0,
                 probe_timeout_s: float = 10.0) -> ServerTarget:
    """Ask ``url``'s ``/v1/models`` which model it serves; a ``ConfigError`` if nothing answers there, the key
    is refused, or the model is not served (or, with several served, not named)."""
    base = url.rstrip("/").removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--url {url!r} is not an http:// or https:// URL")
    target = ServerTarget(base, "", api_key, None, timeout_s)
    try:
        response = httpx.get(f"{base}/v1/models", headers=target.headers(), timeout=probe_timeout_s)
    except httpx.HTTPError as error:
        raise ConfigError(f"no server answers at {base} ({error_summary(error)}); start one (autodeploy serve MODEL "
                          f"--port 8000) or fix --url") from None
    if response.status_code == 401:
        raise ConfigError(f"the server at {base} refused the API key; pass its key with --api-key")
    try:
        cards = response.json()["data"] if response.status_code == 200 else None
        served = {card["id"]: card for card in cards}
    except (ValueError, KeyError, TypeError):
        served = None
    if served is None:
        raise ConfigError(f"GET {base}/v1/models answered HTTP {response.status_code} without an OpenAI model list "
                          f"({response.text[:200]!r}); is it an OpenAI-compatible server?")
    if served_model_name is None and len(served) != 1:
        raise ConfigError(f"the server at {base} serves {sorted(served)}; choose one with --served-model-name")
    name = served_model_name if served_model_name is not None else next(iter(served))
    if name not in served:
        raise ConfigError(f"the server at {base} does not serve {name!r}; it serves {sorted(served)}")
    max_model_len = served[name].get("max_model_len")
    return ServerTarget(base, name, api_key, max_model_len if isinstance(max_model_len, int) else None, timeout_s)


def measure_over_http(target: ServerTarget, workload: Workload, progress: bool = True) -> HttpMeasurement:
    """Send ``workload``'s requests to ``target`` as they arrive and time each one."""
    return asyncio.run(_measure(target, workload, progress))


async def _measure(target: ServerTarget, workload: Workload, progress: bool) -> HttpMeasurement:
    # One connection per request that may be in flight: a request never waits for a connection.
    seats = min(workload.max_concurrency or len(workload.requests), len(workload.requests))
    limits = httpx.Limits(max_connections=seats, max_keepalive_connections=seats)
    timeout = httpx.Timeout(target.timeout_s, connect=10.0)
    timings: list[RequestTiming] = []
    failures: list[str] = []
    async with httpx.AsyncClient(base_url=target.url, headers=target.headers(), limits=limits, timeout=timeout) as client:
        with tqdm(total=len(workload.requests), desc=f"{workload.id} (HTTP)", unit="req", leave=False,
                  disable=not progress or None) as bar:

            async def send(request: BenchRequest, arrival: float) -> None:
                outcome = await _streamed_completion(client, target, request, arrival)
                (timings if isinstance(outcome, RequestTiming) else failures).append(outcome)
                bar.update()

            start = time.perf_counter()
            if workload.max_concurrency is None:

                async def at_arrival(request: BenchRequest) -> None:
                    await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
                    await send(request, start + request.arrival)  # Poisson: the scheduled arrival, as in-process

                await asyncio.gather(*(at_arrival(request) for request in workload.requests))
            else:
                queue = iter(sorted(workload.requests, key=lambda r: r.arrival))

                async def seat() -> None:
                    for request in queue:  # the seats share the iterator: each takes the next request when its last ends
                        await send(request, time.perf_counter())

                await asyncio.gather(*(seat() for _ in range(seats)))
    return HttpMeasurement(timings, failures)


async def _streamed_completion(client: httpx.AsyncClient, target: ServerTarget, request: BenchRequest,
                               arrival: float) -> RequestTiming | str:
    """The request's timing, or why it failed."""
    body = {"model": target.model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    event_times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"HTTP {response.status_code}: {_error_message(response.text)}"
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                received = time.perf_counter()
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return f"error in the stream: {_error_message(data)}"
                if event.get("choices"):
                    event_times.append(received)
                if event.get("usage"):
                    usage = event["usage"]
    except httpx.TimeoutException as error:
        return f"no answer within --request-timeout {target.timeout_s:g}s ({type(error).__name__})"
    except (httpx.HTTPError, ValueError) as error:
        return f"{type(error).__name__}: {error_summary(error)}"
    if not event_times:
        return "the stream ended without a token"
    produced = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if produced is None:
        return "the stream carried no usage (stream_options.include_usage), so its output length is unknown"
    if produced != request.output_len:
        return f"produced {produced} of the {request.output_len} tokens asked for (does the server honour ignore_eos?)"
    return RequestTiming(arrival, event_times, len(request.prompt_token_ids), num_output_tokens=produced)


def _error_message(text: str) -> str:
    """The message of an OpenAI error body, else the start of the text."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]
