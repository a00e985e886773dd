"""Prometheus metrics of one server (``GET /metrics``).

Per-request figures come from each finished request's ``RequestMetrics`` (the engine's timestamps):
time to first token, time per output token (the mean gap between a request's output tokens) and
end-to-end latency, plus token and request counters. Engine state is read when scraped: requests
waiting for a seat and running, KV pool use, prefix-cache hits, preemptions. Each server has its own
registry, so several can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from autodeploy.runtime.engine import Engine
from autodeploy.runtime.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram("autodeploy_time_to_first_token_seconds", "Arrival to first output token",
                                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram("autodeploy_time_per_output_token_seconds",
                                               "Mean gap between a request's output tokens", buckets=_TOKEN_GAP_BUCKETS,
                                               registry=self.registry)
        self.e2e_latency = Histogram("autodeploy_e2e_request_latency_seconds", "Arrival to finish",
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("autodeploy_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry)
        self.generation_tokens = Counter("autodeploy_generation_tokens", "Tokens generated (all samples)", registry=self.registry)
        self.requests = Counter("autodeploy_requests", "Finished requests (one per prompt)", ["finish_reason"],
                                registry=self.registry)
        self.rejected = Counter("autodeploy_requests_rejected", "Requests refused because the queue was full",
                                registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def observe_finished(self, output: RequestOutput) -> None:
        timing = output.metrics
        if timing.time_to_first_token is not None:
            self.time_to_first_token.observe(timing.time_to_first_token)
        gaps = timing.inter_token_latencies
        if gaps:
            self.time_per_output_token.observe(sum(gaps) / len(gaps))
        if timing.e2e_latency is not None:
            self.e2e_latency.observe(timing.e2e_latency)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        self.requests.labels(finish_reason=output.finish_reason or "abort").inc()

    def observe_abandoned(self) -> None:
        """A request whose client left before its last output (it was aborted)."""
        self.requests.labels(finish_reason="abort").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's scheduler and block pool, read at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        scheduler, pool = self.engine.scheduler, self.engine.pool
        waiting = {s.request.request_id for s in list(scheduler.waiting)}
        running = {s.request.request_id for s in list(scheduler.running)} - waiting
        yield GaugeMetricFamily("autodeploy_num_requests_waiting", "Requests waiting for a seat in the batch", value=len(waiting))
        yield GaugeMetricFamily("autodeploy_num_requests_running", "Requests in the running batch", value=len(running))
        yield GaugeMetricFamily("autodeploy_kv_cache_usage_ratio", "Share of the KV pool's blocks held by sequences",
                                value=pool.num_used_blocks / pool.num_blocks)
        yield GaugeMetricFamily("autodeploy_kv_cache_blocks", "Blocks in the KV pool", value=pool.num_blocks)
        yield GaugeMetricFamily("autodeploy_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up",
                                value=pool.stats.hit_rate)
        yield CounterMetricFamily("autodeploy_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=pool.stats.queried_tokens)
        yield CounterMetricFamily("autodeploy_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  value=pool.stats.hit_tokens)
        yield CounterMetricFamily("autodeploy_num_preemptions", "Sequences preempted (blocks freed, recomputed later)",
                                  value=scheduler.num_preemptions)
