"""Timing one candidate kernel: warm-up, then the median of timed calls over rotated input sets.

On a GPU each call is timed with CUDA events (the host clock would time the launch, not the kernel);
on a CPU with the monotonic ``perf_counter``. Calls cycle through several copies of the inputs so a
candidate is not flattered by finding its operands already in cache.

``graphed=True`` (a deploy whose decode steps replay CUDA graphs) times what such a step pays: the
kernels alone. ``GRAPHED_CALLS`` calls (or one per input set, if more) are captured in one CUDA graph
and each timed replay counts for that many; eager timings of small ops measure the gaps the host leaves
between launches instead, which a replayed graph does not have (measured on the H200: eager, torch's 8-kernel RoPE beat the one-kernel
Triton RoPE at every decode size). A candidate that cannot be captured is timed eagerly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autodeploy.custom_ops.graph_capture import capture_graph

Timer = Callable[[Any, Callable[[Sequence[Any]], Any], Sequence[Sequence[Any]], torch.device], float]


def median_seconds(
    backend: Any,
    run: Callable[[Sequence[Any]], Any],
    input_sets: Sequence[Sequence[Any]],
    device: torch.device,
    *,
    warmup: int = 3,
    repeats: int = 15,
    graphed: bool = False,
) -> float:
    """Median seconds of ``run(inputs)`` over ``repeats`` calls, ``input_sets`` taken in turn.

    ``backend`` is the candidate being timed (unused here; a test's fake timer reads it).
    """
    for index in range(warmup):
        run(input_sets[index % len(input_sets)])
    if graphed and device.type == "cuda":
        seconds = _graphed_median_seconds(run, input_sets, device, repeats)
        if seconds is not None:
            return seconds
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for index in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(input_sets[index % len(input_sets)])
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for index in range(repeats):
            began = time.perf_counter()
            run(input_sets[index % len(input_sets)])
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


GRAPHED_CALLS = 8


def _graphed_median_seconds(
    run: Callable[[Sequence[Any]], Any], input_sets: Sequence[Sequence[Any]], device: torch.device, repeats: int
) -> float | None:
    """Median seconds per call of ``GRAPHED_CALLS`` calls (or one per input set) replayed as one CUDA graph;
    None if capture fails."""
    calls = max(GRAPHED_CALLS, len(input_sets))
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.synchronize(device)
        with capture_graph(graph):
            for index in range(calls):
                run(input_sets[index % len(input_sets)])
    except Exception:  # it syncs with the host, or allocates in a way capture forbids
        torch.cuda.synchronize(device)
        return None
    graph.replay()  # the first replay uploads the graph
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(samples)
