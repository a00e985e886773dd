"""Timing one candidate kernel: warm-up, then the median of timed calls over rotated input sets.

On a GPU each call is timed with CUDA events (the host clock would time the launch, not the kernel);
on a CPU with the monotonic ``perf_counter``. Calls cycle through several copies of the inputs so a
candidate is not flattered by finding its operands already in cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

Timer = Callable[[Any, Callable[[Sequence[Any]], Any], Sequence[Sequence[Any]], torch.device], float]


def median_seconds(
    backend: Any,
    run: Callable[[Sequence[Any]], Any],
    input_sets: Sequence[Sequence[Any]],
    device: torch.device,
    *,
    warmup: int = 3,
    repeats: int = 15,
) -> float:
    """Median seconds of ``run(inputs)`` over ``repeats`` calls, ``input_sets`` taken in turn.

    ``backend`` is the candidate being timed (unused here; a test's fake timer reads it).
    """
    for index in range(warmup):
        run(input_sets[index % len(input_sets)])
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
