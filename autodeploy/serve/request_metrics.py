"""What both servers measure, whatever exports it: the OpenAI server through ``prometheus_client``
(``serve/metrics.py``), the Triton llm model through Triton's custom metrics (``serve/triton/metrics.py``),
with the same names, so one dashboard reads either.

Per request, from its ``RequestMetrics`` (the engine's timestamps): time to first token, time per output
token (the mean gap between its output tokens) and end-to-end latency. Engine state, read when exported:
requests waiting and running, KV pool use, prefix-cache hits, preemptions.
"""

from __future__ import annotations

from dataclasses import dataclass

from autodeploy.runtime.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class HistogramSpec:
    name: str
    help: str
    buckets: tuple[float, ...]


TIME_TO_FIRST_TOKEN = HistogramSpec("autodeploy_time_to_first_token_seconds", "Arrival to first output token", LATENCY_BUCKETS)
TIME_PER_OUTPUT_TOKEN = HistogramSpec("autodeploy_time_per_output_token_seconds", "Mean gap between a request's output tokens",
                                      TOKEN_GAP_BUCKETS)
E2E_LATENCY = HistogramSpec("autodeploy_e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
HISTOGRAMS = (TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY)


def request_latencies(output: RequestOutput) -> dict[str, float]:
    """A finished request's value for each histogram it has one for (a request aborted before its first
    token has no time to first token)."""
    timing, values = output.metrics, {}
    if timing.time_to_first_token is not None:
        values[TIME_TO_FIRST_TOKEN.name] = timing.time_to_first_token
    gaps = timing.inter_token_latencies
    if gaps:
        values[TIME_PER_OUTPUT_TOKEN.name] = sum(gaps) / len(gaps)
    if timing.e2e_latency is not None:
        values[E2E_LATENCY.name] = timing.e2e_latency
    return values


@dataclass(frozen=True)
class EngineValue:
    name: str
    help: str
    kind: str  # "gauge" or "counter" (counters are totals since the engine started)
    value: float


def engine_state(engine) -> list[EngineValue]:
    """The engine's scheduler and block pool now (and its speculation, when it drafts; its encoder cache, when it
    takes images)."""
    scheduler, pool = engine.scheduler, engine.pool
    waiting = {s.request.request_id for s in list(scheduler.waiting)}
    running = {s.request.request_id for s in list(scheduler.running)} - waiting
    speculator = getattr(engine, "speculator", None)
    speculation = [] if speculator is None else [
        EngineValue("autodeploy_spec_decode_num_drafts", "Verification rows: sequence-steps that carried a draft", "counter",
                    speculator.stats.steps),
        EngineValue("autodeploy_spec_decode_num_draft_tokens", "Drafted tokens verified", "counter", speculator.stats.drafted),
        EngineValue("autodeploy_spec_decode_num_accepted_tokens", "Drafted tokens the model accepted", "counter",
                    speculator.stats.accepted),
        EngineValue("autodeploy_spec_decode_acceptance_rate", "Accepted / drafted tokens", "gauge", speculator.stats.acceptance_rate),
        EngineValue("autodeploy_spec_decode_acceptance_length", "Tokens per verification row: accepted drafts + 1", "gauge",
                    speculator.stats.acceptance_length),
    ] + [
        EngineValue(f"autodeploy_spec_decode_acceptance_rate_at_{position}",
                    f"Of the drafts with a token at position {position}, the share whose token there was accepted", "gauge",
                    accepted / drafted)
        for position, (accepted, drafted) in enumerate(zip(speculator.stats.accepted_at, speculator.stats.drafted_at))
    ]
    vision = getattr(engine, "vision", None)
    images = [] if vision is None else [
        EngineValue("autodeploy_encoder_cache_hits", "Images whose vision features came from the encoder cache", "counter",
                    vision.cache.hits),
        EngineValue("autodeploy_encoder_cache_misses", "Images looked up in the encoder cache and not found", "counter",
                    vision.cache.misses),
        EngineValue("autodeploy_encoder_cache_evictions", "Entries evicted from the encoder cache for room", "counter",
                    vision.cache.evictions),
        EngineValue("autodeploy_encoder_cache_usage_bytes", "Bytes of vision features the encoder cache holds", "gauge",
                    vision.cache.bytes_used),
        EngineValue("autodeploy_images_encoded", "Images the vision graph encoded", "counter", vision.images_encoded),
    ]
    return speculation + images + [
        EngineValue("autodeploy_num_requests_waiting", "Requests waiting for a seat in the batch", "gauge", len(waiting)),
        EngineValue("autodeploy_num_requests_running", "Requests in the running batch", "gauge", len(running)),
        EngineValue("autodeploy_kv_cache_usage_ratio", "Share of the KV pool's blocks held by sequences", "gauge",
                    pool.num_used_blocks / pool.num_blocks),
        EngineValue("autodeploy_kv_cache_blocks", "Blocks in the KV pool", "gauge", pool.num_blocks),
        EngineValue("autodeploy_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up", "gauge", pool.stats.hit_rate),
        EngineValue("autodeploy_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", "counter",
                    pool.stats.queried_tokens),
        EngineValue("autodeploy_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", "counter", pool.stats.hit_tokens),
        EngineValue("autodeploy_num_preemptions", "Sequences preempted (blocks freed, recomputed later)", "counter",
                    scheduler.num_preemptions),
    ]
