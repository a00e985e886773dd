"""Prometheus metrics of one server (``GET /metrics``): the histograms and engine state of
``request_metrics`` (shared with the Triton backend), plus token and request counters. Each server has its
own registry, so several can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from autodeploy.runtime.engine import Engine
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.serve.request_metrics import HISTOGRAMS, engine_state, request_latencies


class ServerMetrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.histograms = {spec.name: Histogram(spec.name, spec.help, buckets=spec.buckets, registry=self.registry) for spec in HISTOGRAMS}
        self.prompt_tokens = Counter("autodeploy_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry)
        self.generation_tokens = Counter("autodeploy_generation_tokens", "Tokens generated (all samples)", registry=self.registry)
        self.requests = Counter("autodeploy_requests", "Finished requests (one per prompt)", ["finish_reason"],
                                registry=self.registry)
        self.rejected = Counter("autodeploy_requests_rejected", "Requests refused because the queue stayed full",
                                registry=self.registry)
        self.waiting_for_room = Gauge("autodeploy_requests_waiting_for_room",
                                      "Requests waiting in the lobby for room in the queue (serve/admission.py)", registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def observe_finished(self, output: RequestOutput) -> None:
        for name, value in request_latencies(output).items():
            self.histograms[name].observe(value)
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
        for value in engine_state(self.engine):
            family = GaugeMetricFamily if value.kind == "gauge" else CounterMetricFamily
            yield family(value.name, value.help, value=value.value)
