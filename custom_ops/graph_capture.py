"""Capturing CUDA graphs: one sequence for every capture the engine makes, and a failed capture's repair.

``GraphCapture`` captures callables one after another into one shared memory pool: each runs once eagerly
on a side stream first (Triton compiles, cuBLAS picks its kernels, lazy buffers get made, none of which a
capture may do), then is captured, then its executable is uploaded to the device. The decode graphs
(``runtime/cuda_graphs.py``) and the piecewise prefill graphs (``runtime/piecewise_graphs.py``) both use it.

``capture_graph(graph)`` is ``torch.cuda.graph`` that leaves CUDA's random number generators usable when it
fails. A capture that a CUDA error ends (a kernel that synchronizes with the host, say: "operation failed
due to a previous error during capture") never reaches PyTorch's end-of-capture bookkeeping for the default
CUDA generator, which stays in capture state: every later ``torch.rand`` on that device raises "Offset
increment outside graph capture encountered unexpectedly", far from the cause
(scripts/probe_failed_capture_rng.py). The autotuner and the engine catch failed captures and carry on
without the graph, so they must also put the generator back: capturing an empty graph runs that
bookkeeping again.

    capture = GraphCapture(device)
    graph, outputs = capture.capture(module, arguments)
    logger.info("%.2f GiB; %s", capture.pool_bytes() / 2**30, capture.times)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class CaptureTimes:
    """Where capturing went, summed over captures: the eager run before each on the host (launching; a
    capture told that a like callable already ran skips it), the wait for it on the GPU, and the capture
    itself (``torch.cuda.graph``: its synchronize and cache release, the launches recorded, the graph
    instantiated)."""

    launching: float = 0.0
    running: float = 0.0
    capturing: float = 0.0
    count: int = 0
    eager_runs: int = 0

    def add(self, launching: float, running: float, capturing: float, ran_eagerly: bool = True) -> None:
        self.launching += launching
        self.running += running
        self.capturing += capturing
        self.count += 1
        self.eager_runs += ran_eagerly

    def __str__(self) -> str:
        return (f"{self.count} captures: {self.eager_runs} eager runs {self.launching:.2f} s on the host + "
                f"{self.running:.2f} s more on the GPU, captures {self.capturing:.2f} s")


class GraphCapture:
    """Captures into one memory pool on ``device``, each capture after an eager run on a side stream."""

    def __init__(self, device: torch.device, capture_error_mode: str = "global"):
        """``capture_error_mode``: ``torch.cuda.graph``'s — "thread_local" for captures made while other threads may
        call CUDA (mid-serving), which "global" would make fail."""
        self.device = device
        self.capture_error_mode = capture_error_mode
        torch.cuda.synchronize(device)
        self._reserved_before = torch.cuda.memory_reserved(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.times = CaptureTimes()

    def capture(self, function: Callable, arguments: Sequence, warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, object]:
        """``function(*arguments)`` captured: the graph and the outputs its replays overwrite. ``warm_up=False``
        skips the eager run where the caller knows a like call already ran at these shapes."""
        current = torch.cuda.current_stream(self.device)
        start = time.perf_counter()
        if warm_up:
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                function(*arguments)
        launched = time.perf_counter()
        self.stream.synchronize()
        ran = time.perf_counter()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
            outputs = function(*arguments)
        upload(graph, current)
        self.times.add(launched - start, ran - launched, time.perf_counter() - ran, warm_up)
        return graph, outputs

    def capture_sizes(self, function: Callable, arguments: Mapping[int, Sequence], holders: Mapping[int, object]) -> None:
        """Capture ``function`` at every size of ``arguments``, largest first (smaller ones then fit in the pool the
        largest left), setting each holder's ``graph`` and ``logits`` (the first output)."""
        for size in sorted(arguments, reverse=True):
            holder = holders[size]
            holder.graph, outputs = self.capture(function, arguments[size])
            holder.logits = outputs[0]

    def pool_bytes(self) -> int:
        """The memory the captures so far hold (the pool and their outputs), once they are done."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device) - self._reserved_before


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool=None, capture_error_mode: str = "global") -> Iterator[None]:
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
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


def upload(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> bool:
    """Queue the upload of a captured graph's executable to the device on ``stream``, as its first replay
    would otherwise do on the step that first needs it (the first 2,048-token prefill step of a process
    took 26 ms on the host against 16 ms for the next ones). False where the driver's ``cuGraphUpload`` is
    out of reach or refuses (the graph then uploads at its first replay, as before)."""
    function = _driver_graph_upload()
    if function is None:
        return False
    return function(graph.raw_cuda_graph_exec(), stream.cuda_stream) == 0


@functools.lru_cache(maxsize=1)
def _driver_graph_upload():
    try:
        function = ctypes.CDLL("libcuda.so.1").cuGraphUpload  # a runtime graph exec is a driver CUgraphExec
    except (OSError, AttributeError):
        logger.info("CUDA graphs upload at their first replay: the driver library has no cuGraphUpload")
        return None
    function.argtypes, function.restype = (ctypes.c_void_p, ctypes.c_void_p), ctypes.c_int
    return function
