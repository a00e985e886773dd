"""``capture_graph(graph)``: ``torch.cuda.graph`` that leaves CUDA's random number generators usable when it fails.

A capture that a CUDA error ends (a kernel that synchronizes with the host, say: "operation failed due to a
previous error during capture") never reaches PyTorch's end-of-capture bookkeeping for the default CUDA
generator, which stays in capture state: every later ``torch.rand`` on that device raises "Offset increment
outside graph capture encountered unexpectedly", far from the cause (scripts/probe_failed_capture_rng.py).
The autotuner and the engine catch failed captures and carry on without the graph, so they must also put
the generator back: capturing an empty graph runs that bookkeeping again.

    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph, pool=pool):
        outputs = module(*arguments)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    except BaseException:
        restore_random_generators()
        raise


def restore_random_generators() -> None:
    """Bring the current device's CUDA generators out of the capture state a failed capture left them in."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")  # it is meant to be
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
