"""An encoder–decoder's encoder pass and the cross-KV pool it writes (``models/encoder_decoder.py``).

The decoder of an encoder–decoder attends, in every layer, to the same keys and values of its request's encoder
output at every step. ``EncoderPass`` runs the ``"encoder"`` graph once a request — when the request is first
scheduled, before the step that computes its decoder's first token — on the input ids of the requests a step starts
(``[R, S]``: those of one length together, no padding), and writes each layer's keys and values into blocks of a pool of its own
(``cross_k_cache_i`` / ``cross_v_cache_i``, declared by the cache stage as ``ServingSignature.cross_kv_caches``).
The decoder graph reads them through ``cross_lens`` and ``cross_block_tables`` (``step_inputs.py``), each sequence's
row from its request (``Request.cross_table``).

The pool holds ``max_batch_size`` requests of ``max_seq_len`` input tokens, so a scheduled request finds its blocks;
they go back when the request finishes or is aborted, and when its only sequence is preempted (it is encoded again
when it runs again: its decoder starts over too). Sequences a request forks (``n``, beams) share them until it is done.

With ``compile.encoder_graphs: N`` (``cuda_graph`` on a GPU) the first N shapes ``[R, S]`` the pass runs are captured
as CUDA graphs, each the first time it runs, and replayed after: one launch instead of the graph's few hundred op
calls, which an encoding step otherwise spends on the host (BART-large's encoder: 265). Shapes past the first N, and
one whose capture fails (a kernel that syncs with the host), run eagerly. The graphs share one memory pool: each
replay's keys and values are copied into the cross caches before the next replay can overwrite them. Their memory
(each holds its outputs, ``2 × layers × R × S`` rows) is taken after the KV pool was sized, from the share
``kv_cache.memory_fraction`` leaves free, so N is meant small (a few shapes of a workload with fixed lengths).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from autodeploy.custom_ops.graph_capture import GraphCapture
from autodeploy.custom_ops.serving_signature import KVCacheSpec
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


@dataclass
class _Captured:
    """One captured shape: the static input the replays read, the graph, and the outputs they overwrite."""

    ids: torch.Tensor
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, torch.Tensor]


class EncoderPass:
    def __init__(self, graph: Callable, specs: Sequence[KVCacheSpec], max_batch_size: int, max_input_len: int,
                 block_size: int, device: torch.device, max_graphs: int = 0):
        self.graph = graph
        self.max_graphs = max_graphs if device.type == "cuda" else 0  # CUDA graphs; the CPU runs eagerly
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.eager_shapes: set[tuple[int, int]] = set()  # past the first max_graphs, or failed to capture
        self._capture = None  # a GraphCapture, made at the first capture
        self.specs = tuple(specs)
        self.block_size = block_size
        self.device = device
        blocks = max_batch_size * -(-max_input_len // block_size)
        self.pool = KVBlockPool(blocks, block_size, enable_prefix_caching=False)
        self.caches = allocate_kv_caches(self.specs, blocks, block_size, device)
        self.encoded = 0  # requests encoded so far (a preempted one counts again)

    def encode(self, requests: Sequence) -> None:
        """Run the encoder on each of ``requests`` that has no cross cache yet, and write its keys and values: requests
        of the same input length in one forward ``[R, S]`` (no padding, so no mask: the same function as one a
        request), and every layer's rows of them in one indexed copy a cache."""
        by_length: dict[int, list] = {}
        for request in requests:
            if request.cross_table is None:
                by_length.setdefault(len(request.encoder_input_ids), []).append(request)
        for length, group in by_length.items():
            for taken, request in enumerate(group):
                if not self.pool.reserve(request.request_id, length):
                    for reserved in group[:taken]:  # nothing of the group is left holding blocks
                        self.pool.free(reserved.request_id)
                    raise RuntimeError(f"the cross-KV pool has no room for request {request.request_id!r}'s {length} tokens "
                                       f"({self.pool.num_free_blocks} blocks free): more requests hold blocks than it was sized for")
            ids = torch.tensor([request.encoder_input_ids for request in group], dtype=torch.long, device=self.device)
            keys, values = self._forward(ids)  # [layers, R, S, heads, head_dim] each
            tables = [self.pool.block_table(request.request_id) for request in group]
            blocks = torch.tensor([table[: -(-length // self.block_size)] for table in tables])  # [R, blocks]
            positions = torch.arange(length)
            slots = (blocks[:, positions // self.block_size] * self.block_size + positions % self.block_size).reshape(-1).to(self.device)
            for layer, spec in enumerate(self.specs):
                for name, rows in ((spec.key_input, keys[layer]), (spec.value_input, values[layer])):
                    cache = self.caches[name]
                    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.reshape(-1, *rows.shape[2:]).to(cache.dtype))
            for request, table in zip(group, tables):
                request.cross_table, request.cross_len = table, length
            self.encoded += len(group)

    def _forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's keys and values for ``ids`` ``[R, S]``: a captured graph replayed (capturing the shape first
        while fewer than ``max_graphs`` are), else the graph run eagerly."""
        shape = tuple(ids.shape)
        captured = self.captured.get(shape)
        if captured is None and self.max_graphs and shape not in self.eager_shapes:
            captured = self._capture_shape(shape, ids) if len(self.captured) < self.max_graphs else None
            if captured is None:
                self.eager_shapes.add(shape)
        if captured is None:
            return self.graph(ids)
        captured.ids.copy_(ids)
        captured.graph.replay()
        return captured.outputs

    def _capture_shape(self, shape: tuple[int, int], ids: torch.Tensor) -> _Captured | None:
        static = ids.clone()
        try:
            if self._capture is None:  # mid-serving: other threads' CUDA calls must not fail for this capture
                self._capture = GraphCapture(self.device, capture_error_mode="thread_local")
            graph, outputs = self._capture.capture(self.graph, [static])
        except Exception as error:  # a kernel that syncs with the host, or memory the capture could not get
            logger.warning("the encoder pass of shape %s runs eagerly: its CUDA graph capture failed (%s: %s)", shape,
                           type(error).__name__, error)
            return None
        captured = self.captured[shape] = _Captured(static, graph, tuple(outputs))
        logger.info("captured the encoder pass for %d × %d tokens (%d of %d shapes)", *shape, len(self.captured), self.max_graphs)
        return captured

    def release(self, request) -> None:
        """Give ``request``'s cross blocks back (finished, aborted or preempted)."""
        if request.cross_table is not None:
            self.pool.free(request.request_id)
            request.cross_table = None
