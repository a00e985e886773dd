"""Latency and throughput metrics from per-request timestamps.

Per request (all times from one clock): arrival ``a``, output token times ``t_1 … t_n``. Over HTTP the
times are those of the streamed events, and an event may carry several tokens (the server holds back a
token that ends in half a UTF-8 character); ``num_output_tokens`` then gives ``n`` (the server's ``usage``)
and ITL pools the gaps between events.

- TTFT (time to first token) = ``t_1 − a``
- E2E latency = ``t_n − a``
- TPOT (time per output token, after the first) = ``(t_n − t_1) / (n − 1)``, for ``n > 1`` and ``t_n > t_1``: a
  request whose tokens all arrived at once (over HTTP, one event carrying them all, which a server whose loop falls
  behind its engine sends) showed no time between tokens, so it has no TPOT, as a one-token request has none; its
  time is in its TTFT and E2E, and the run's TPOT is over the other requests (none when no request has one)
- ITL (inter-token latency) = every gap ``t_{i+1} − t_i``, pooled over requests

Distributions are reported as mean, p50, p90, p99 (linear interpolation between order statistics).
Throughputs divide by the run's duration: first arrival to last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RequestTiming:
    arrival: float
    token_times: list[float]
    input_len: int
    num_output_tokens: int | None = None  # None: one time per token

    @property
    def output_len(self) -> int:
        return len(self.token_times) if self.num_output_tokens is None else self.num_output_tokens

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        n, span = self.output_len, self.token_times[-1] - self.token_times[0]
        return span / (n - 1) if n > 1 and span > 0 else None

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentile(values: list[float], q: float) -> float:
    """``q`` in [0, 100]; linear interpolation between the order statistics (NumPy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def summarize(timings: list[RequestTiming]) -> dict:
    """Latency distributions, throughputs and counts for one run's finished requests."""
    if not timings or any(not t.token_times for t in timings):
        raise ValueError("every request of a benchmark run must have produced at least one token")
    start = min(t.arrival for t in timings)
    duration = max(t.token_times[-1] for t in timings) - start
    output_tokens = sum(t.output_len for t in timings)
    input_tokens = sum(t.input_len for t in timings)
    tpots = [t.tpot for t in timings if t.tpot is not None]
    metrics = {
        "num_requests": len(timings),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "duration_s": duration,
        "ttft_s": distribution([t.ttft for t in timings]),
        "tpot_s": distribution(tpots),
        "itl_s": distribution([gap for t in timings for gap in t.inter_token_latencies]),
        "e2e_s": distribution([t.e2e for t in timings]),
        "output_tokens_per_s": output_tokens / duration if duration > 0 else math.inf,
        "total_tokens_per_s": (input_tokens + output_tokens) / duration if duration > 0 else math.inf,
        "requests_per_s": len(timings) / duration if duration > 0 else math.inf,
    }
    return metrics


def headline_values(metrics: dict) -> dict[str, float]:
    """The scalar headline metrics (``results.HEADLINE_METRICS``) of one run's summary."""
    values = {name: metrics[name] for name in ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s")}
    for name, quantile in (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("itl", "p99"), ("e2e", "p50")):
        summary = metrics[f"{name}_s"]
        if summary is not None:
            values[f"{name}_{quantile}_s"] = summary[quantile]
    return values
