"""The llm model's own metrics on Triton's metrics endpoint (the Python backend's custom metrics), with the
OpenAI server's names (``serve/request_metrics.py``), labelled with the model and version:

- ``autodeploy_time_to_first_token_seconds``, ``autodeploy_time_per_output_token_seconds``,
  ``autodeploy_e2e_request_latency_seconds``: histograms of finished requests;
- ``autodeploy_prompt_tokens_total``, ``autodeploy_generation_tokens_total``, ``autodeploy_requests_total``
  (by ``finish_reason``);
- ``autodeploy_request_failures_total`` (by ``reason``: ``invalid_request`` or ``internal``): requests
  answered with an error, which Triton's own ``nv_inference_request_failure`` misses (a decoupled request
  succeeds, to Triton, once ``execute`` accepts it);
- the engine's state (waiting and running requests, KV pool use, prefix-cache hits, preemptions), read
  when a request starts and when it ends (``refresh``), so it does not change while the model is idle.

Every call is a round trip to Triton's core; ``llm_model`` makes them only while a request is in flight.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.serve.request_metrics import HISTOGRAMS, engine_state, request_latencies

FINISH_REASONS = ("stop", "length", "abort")
FAILURE_REASONS = ("invalid_request", "internal")


class TritonMetrics:
    def __init__(self, engine, labels: dict[str, str]):
        self.engine = engine
        self._families: list = []  # kept: a family must outlive its metrics (close)
        self._metrics: list = []
        kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER}

        def metric(name: str, help: str, kind, **options):
            family = pb_utils.MetricFamily(name=name, description=help, kind=kind)
            self._families.append(family)
            made = family.Metric(labels=labels, **options)
            self._metrics.append(made)
            return made

        def labelled(name: str, help: str, label: str, values: tuple[str, ...]) -> dict:
            family = pb_utils.MetricFamily(name=name, description=help, kind=pb_utils.MetricFamily.COUNTER)
            self._families.append(family)
            made = {value: family.Metric(labels={**labels, label: value}) for value in values}
            self._metrics.extend(made.values())
            return made

        self.histograms = {spec.name: metric(spec.name, spec.help, pb_utils.MetricFamily.HISTOGRAM, buckets=list(spec.buckets))
                           for spec in HISTOGRAMS}
        self.prompt_tokens = metric("autodeploy_prompt_tokens_total", "Prompt tokens of finished requests", pb_utils.MetricFamily.COUNTER)
        self.generation_tokens = metric("autodeploy_generation_tokens_total", "Tokens generated (all samples)", pb_utils.MetricFamily.COUNTER)
        self.requests = labelled("autodeploy_requests_total", "Finished requests", "finish_reason", FINISH_REASONS)
        self.failures = labelled("autodeploy_request_failures_total", "Requests answered with an error", "reason", FAILURE_REASONS)
        self._state = {}
        for value in engine_state(engine):
            name = value.name + ("_total" if value.kind == "counter" else "")
            self._state[value.name] = (metric(name, value.help, kinds[value.kind]), value.kind)
        self._totals = {name: 0.0 for name, (_, kind) in self._state.items() if kind == "counter"}  # counters only increment
        self.refresh()

    def observe_finished(self, output: RequestOutput) -> None:
        for name, value in request_latencies(output).items():
            self.histograms[name].observe(value)
        self.prompt_tokens.increment(len(output.prompt_token_ids))
        self.generation_tokens.increment(sum(len(c.token_ids) for c in output.outputs))
        self.requests[output.finish_reason if output.finish_reason in FINISH_REASONS else "abort"].increment(1)
        self.refresh()

    def observe_abandoned(self) -> None:
        """A stream its client cancelled (its request was aborted)."""
        self.requests["abort"].increment(1)

    def observe_failure(self, error: BaseException) -> None:
        self.failures["invalid_request" if isinstance(error, InvalidRequestError) else "internal"].increment(1)

    def refresh(self) -> None:
        """Read the engine's state into its gauges and counters."""
        for value in engine_state(self.engine):
            metric, kind = self._state[value.name]
            if kind == "gauge":
                metric.set(value.value)
            elif value.value > self._totals[value.name]:
                metric.increment(value.value - self._totals[value.name])
                self._totals[value.name] = value.value

    def close(self) -> None:
        """Drop every metric, then the families (Triton's rule: a family must outlive its metrics)."""
        self.histograms, self.requests, self.failures, self._state = {}, {}, {}, {}
        self.prompt_tokens = self.generation_tokens = None
        self._metrics.clear()
        self._families.clear()
