"""Drive a workload through the serving engine and time every request.

The runner owns the arrival process: it submits each request when its arrival time comes (Poisson),
all at once (synthetic), or whenever fewer than ``max_concurrency`` are in flight, and steps the
engine in between. A Poisson request's arrival is its *scheduled* arrival, so time spent waiting for
the engine to finish a step counts in its TTFT; a closed-loop request arrives when it is sent. The clock and the idle wait are injectable: tests run
the whole loop on a synthetic clock.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from autodeploy.bench.metrics import RequestTiming
from autodeploy.bench.workloads import Workload
from autodeploy.runtime.sampling_params import SamplingParams


@dataclass
class RunMeasurement:
    timings: list[RequestTiming]
    peak_device_memory_bytes: int | None
    peak_host_rss_bytes: int | None  # None: measured over HTTP, where the client cannot see the server's memory
    kv_pool_peak_utilization: float | None
    prefix_cache_hit_rate: float | None
    failures: list[str] = field(default_factory=list)  # over HTTP: why each request that did not finish failed
    # Speculative decoding within the run: drafted and accepted tokens, acceptance rate and length (None: off)
    speculation: dict | None = None
    continuations: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (prompt, output) token ids
    # Requests with images: seconds the step loop had nothing to run while arrived requests' images were still being
    # loaded and preprocessed (off its thread), the images the vision graph encoded and those the encoder cache served
    # (None: no images)
    image_wait_s: float | None = None
    images_encoded: int | None = None
    encoder_cache_hits: int | None = None


def peak_host_rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_workload(
    llm,
    workload: Workload,
    clock: Callable[[], float] = time.perf_counter,
    wait: Callable[[float], None] = time.sleep,
    progress: bool = True,
) -> RunMeasurement:
    engine = llm.engine
    previous_clock, engine.clock = engine.clock, clock
    device = engine.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine.pool.reset_prefix_cache()  # hits within this run only, never from an earlier repeat
    stats = engine.pool.stats
    queried_before, hits_before = stats.queried_tokens, stats.hit_tokens
    speculator = engine.speculator
    drafted_before = (speculator.stats.steps, speculator.stats.drafted, speculator.stats.accepted,
                      speculator.stats.rejected, speculator.tally.copy()) if speculator else None
    pending = sorted(workload.requests, key=lambda r: r.arrival)
    images = any(r.images for r in workload.requests)
    vision = engine.vision if images else None
    if vision is not None:
        vision.cache.clear()  # hits within this run only, as the prefix cache
    hits_before, encoded_before = (vision.cache.hits, vision.images_encoded) if vision is not None else (0, 0)
    # Requests with images are made (loaded, preprocessed) on worker threads, as the server makes them, and submitted
    # when ready: the step loop runs meanwhile, and only waits when it has nothing else to run.
    preparing: list[tuple[object, float, Future]] = []
    workers = ThreadPoolExecutor(4, thread_name_prefix="bench-requests") if images else None
    image_wait = 0.0
    submitted = []
    peak_blocks = 0
    steps = 0
    try:
        start = clock()
        with tqdm(total=len(pending), desc=workload.id, unit="req", leave=False, disable=not progress or None) as bar:
            while pending or preparing or engine.has_unfinished():
                now = clock() - start
                in_flight = sum(not r.finished for _, r in submitted) + len(preparing)
                while pending and pending[0].arrival <= now and (workload.max_concurrency is None or in_flight < workload.max_concurrency):
                    request = pending.pop(0)
                    params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
                    # Poisson: the scheduled arrival. Closed loop: when a seat came free (vLLM's convention).
                    arrival = start + request.arrival if workload.max_concurrency is None else clock()
                    if workers is not None:
                        preparing.append((request, arrival, workers.submit(engine.make_request, request.prompt, params)))
                    else:
                        submitted.append((request, _submit(engine, engine.make_request(request.prompt, params), arrival)))
                    in_flight += 1
                for entry in [entry for entry in preparing if entry[2].done()]:
                    preparing.remove(entry)
                    submitted.append((entry[0], _submit(engine, entry[2].result(), entry[1])))
                if not engine.has_unfinished():
                    if preparing:  # idle only because images are still being prepared
                        waited = clock()
                        futures_wait([entry[2] for entry in preparing], return_when=FIRST_COMPLETED)
                        image_wait += clock() - waited
                    else:
                        wait(max(0.0, pending[0].arrival - (clock() - start)))
                    continue
                finished_before = sum(r.finished for _, r in submitted)
                engine.step()
                steps += 1
                peak_blocks = max(peak_blocks, engine.pool.num_used_blocks)
                bar.update(sum(r.finished for _, r in submitted) - finished_before)
    finally:
        engine.clock = previous_clock
        if workers is not None:
            workers.shutdown(wait=True, cancel_futures=True)
    queried = stats.queried_tokens - queried_before
    # An encoder–decoder's input is its encoder's (its decoder's prompt is the start token alone).
    timings = [RequestTiming(r.arrival_time, list(r.token_times), len(r.encoder_input_ids or r.prompt_token_ids)) for _, r in submitted]
    return RunMeasurement(
        timings=timings,
        peak_device_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        peak_host_rss_bytes=peak_host_rss_bytes(),
        kv_pool_peak_utilization=peak_blocks / engine.pool.num_blocks,
        prefix_cache_hit_rate=(stats.hit_tokens - hits_before) / queried if queried else None,
        speculation=_speculation(speculator, drafted_before, timings, steps, workload) if speculator else None,
        continuations=[(list(r.prompt_token_ids), list(r.sequences[0].output_token_ids)) for _, r in submitted if r.sequences],
        image_wait_s=image_wait if images else None,
        images_encoded=vision.images_encoded - encoded_before if vision is not None else None,
        encoder_cache_hits=vision.cache.hits - hits_before if vision is not None else None,
    )


def _submit(engine, request, arrival: float):
    request.arrival_time = arrival
    engine.submit(request)
    return request


def _speculation(speculator, before: tuple, timings: list[RequestTiming], forwards: int, workload) -> dict:
    stats = speculator.stats
    rows, drafted, accepted, rejected = (now - then for now, then in zip(
        (stats.steps, stats.drafted, stats.accepted, stats.rejected), before[:4]))
    output_tokens = sum(len(t.token_times) for t in timings)
    # auto's break-even at the workload's width (its concurrency, or its batch; a Poisson point has none): the
    # per-token acceptance from which it drafts, from the set-up's forwards alone and from the steps as they ran
    batch = workload.max_concurrency or workload.description.get("batch")
    costs = speculator.costs if batch else None
    return {"method": speculator.method, "num_tokens": speculator.num_tokens, "verification_rows": rows,
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "per_token_acceptance": accepted / (accepted + rejected) if accepted + rejected else None,
            "acceptance_length": 1 + accepted / rows if rows else None,
            "tokens_per_forward": output_tokens / forwards if forwards else None,
            "steps": speculator.tally.since(before[4]),  # steps of decodes alone by kind: how many, mean ms
            "auto": None if costs is None else {"batch": batch, "threshold_set_up": costs.threshold(batch),
                                                "threshold_as_run": speculator.threshold_as_run(batch)}}
