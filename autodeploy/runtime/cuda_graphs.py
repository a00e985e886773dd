"""CUDA graphs of the decode step: one capture per batch size, replayed with the batch padded up to it.

A decode step at batch ``b`` always launches the same kernels with the same shapes, so the whole forward
(every layer, attention included) is captured once per size the compile stage declared
(``TransformContext.decode_graph_batch_sizes``) and then replayed: one launch instead of hundreds, and no
Python between kernels. A pure decode batch of ``n ≤ max size`` sequences runs the smallest captured size
``b ≥ n``; rows ``n … b-1`` are padding: a one-token sequence whose key and value go to a block the pool
never hands out (``pad_block``), and whose logits are dropped. Prefill and mixed steps, and larger decode
batches, run the graph eagerly.

Each size owns static inputs: ``input_ids``, ``position_ids`` and ``slot_mapping`` in one int64 device
buffer, ``kv_lens`` and ``block_tables`` in one int32 buffer (an encoder–decoder's ``cross_lens`` and
``cross_block_tables`` too, its padding rows of cross length 0: their cross-attention gives zeros), each
refilled per step from a pinned host twin by one copy; ``seq_start`` (0 … b) and ``logit_index`` never
change. ``batch_info`` is fixed at capture to ``[0, b, 1, max_seq_len]``: the decode kernel sizes its
split-K grid for the longest possible sequence, and splits past a sequence's length do nothing. All sizes share one memory pool, captured
largest first. The caches are captured by address: the engine passes the same tensors to every step.

On the CPU (the tests) nothing is captured: ``replay`` calls the graph on the same padded static inputs,
so the padding and buffer logic is the one a GPU replays.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

from autodeploy.custom_ops.graph_capture import GraphCapture
from autodeploy.custom_ops.serving_signature import ATTEND_UNTIL, CROSS_METADATA, TREE_MASK
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.step_inputs import PendingTokens, SideInputSpec, cross_rows, no_side_rows, slot

logger = logging.getLogger(__name__)


class StaticBatch:
    """The static inputs, output and (on a GPU) the captured graph of one batch size: ``size`` sequences of
    ``width`` query tokens each (1 for decode steps; ``K + 1`` for verification steps, ``verify_graphs.py``);
    ``cross``: an encoder–decoder's cross rows as well (``max_blocks`` wide: its cross pool holds inputs of
    ``max_seq_len`` tokens)."""

    def __init__(self, size: int, max_blocks: int, device: torch.device, pin: bool, width: int = 1, cross: bool = False):
        self.size, self.width, self.cross = size, width, cross
        tokens = size * width
        self.host64 = torch.zeros(4, tokens, dtype=torch.long, pin_memory=pin)  # ids, positions, slots, tree mask
        self.host64[3] = -1  # causal rows: a verification step's tree chunks set theirs (verify_graphs.py)
        rows = size * (1 + max_blocks)  # kv_lens, tables; then cross_lens, cross tables
        self.host32 = torch.zeros(rows * (1 + cross), dtype=torch.int32, pin_memory=pin)
        self.host64_np, self.host32_np = self.host64.numpy(), self.host32.numpy()
        self.tables_np = self.host32_np[size:rows].reshape(size, max_blocks)
        self.cross_lens_np = self.host32_np[rows : rows + size]
        self.cross_tables_np = self.host32_np[rows + size :].reshape(-1, max_blocks)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.seq_start = torch.arange(0, tokens + 1, width, dtype=torch.int32, device=device)
        self.logit_index = torch.arange(tokens, dtype=torch.long, device=device)
        self.causal = torch.full((tokens,), -1, dtype=torch.long, device=device)  # decodes and drafts see up to themselves
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None  # recorded after the last host-to-device copy

    def run(self, graph: Callable, arguments: Sequence) -> torch.Tensor:
        """The logits of the staged step: the captured graph replayed (its output, overwritten by the next replay),
        or, uncaptured, ``graph`` called on the static inputs."""
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return graph(*arguments)[0]

    def named_inputs(self, max_blocks: int, max_kv_len: int) -> dict[str, torch.Tensor]:
        """The graph's inputs; ``batch_info`` fixed: ``size`` decodes, or ``size`` chunks of ``width`` tokens."""
        info = [0, self.size, 1, max_kv_len] if self.width == 1 else [self.size, 0, self.width, max_kv_len]
        rows = self.size * (1 + max_blocks)
        cross = {"cross_lens": self.dev32[rows : rows + self.size],
                 "cross_block_tables": self.dev32[rows + self.size :].view(self.size, max_blocks)} if self.cross else {}
        return {
            "input_ids": self.dev64[0:1],
            "position_ids": self.dev64[1:2],
            "slot_mapping": self.dev64[2],
            TREE_MASK: self.dev64[3],  # read only by graphs that verify tree drafts
            ATTEND_UNTIL: self.causal,  # read only by graphs of models with bidirectional prompt blocks
            "kv_lens": self.dev32[: self.size],
            "block_tables": self.dev32[self.size : rows].view(self.size, max_blocks),
            "seq_start": self.seq_start,
            "logit_index": self.logit_index,
            "batch_info": torch.tensor(info, dtype=torch.int32),
            **cross,
        }


class DecodeGraphs:
    """Captured decode steps for the engine's ``graph`` over its ``caches``; see the module docstring."""

    def __init__(
        self,
        graph: Callable[..., tuple[torch.Tensor, ...]],
        input_names: Sequence[str],
        caches: dict[str, torch.Tensor],
        batch_sizes: Sequence[int],
        block_size: int,
        max_seq_len: int,
        pad_block: int,
        device: torch.device,
        side_inputs: Sequence[SideInputSpec] = (),
    ):
        self.graph = graph
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.max_blocks = -(-max_seq_len // block_size)
        self.pad_block = pad_block
        self.device = device
        self.capture = device.type == "cuda"
        self.sizes = sorted(set(batch_sizes))
        cross = CROSS_METADATA[0] in input_names  # an encoder–decoder's decoder
        self.batches = {size: StaticBatch(size, self.max_blocks, device, pin=self.capture, cross=cross) for size in self.sizes}
        self._arguments = {}
        for size, batch in self.batches.items():
            named = {**batch.named_inputs(self.max_blocks, max_seq_len), **no_side_rows(side_inputs, device), **caches}
            self._arguments[size] = [named[name] for name in input_names]
            self._fill(batch, [], [], [], [])
        self.pool_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every size, largest first into one shared memory pool. Raises what capture raised (the
        engine then serves eagerly)."""
        if not self.capture:
            return
        capture = GraphCapture(self.device)
        capture.capture_sizes(self.graph, self._arguments, self.batches)
        self.pool_bytes = capture.pool_bytes()
        logger.info("decode CUDA graphs: %d batch sizes up to %d captured, %.2f GiB; %s", len(self.sizes), self.max_size,
                    self.pool_bytes / 2**30, capture.times)

    def serves(self, chunks: Sequence[ScheduledChunk], logits_for_all_tokens: bool = False) -> bool:
        """Whether this step is one token per sequence, for at most the largest size, every token's
        logits wanted (each chunk completes its sequence, or ``logits_for_all_tokens``)."""
        return (0 < len(chunks) <= self.max_size
                and all(c.length == 1 and (logits_for_all_tokens or c.completes) for c in chunks))

    def stage(self, chunks: Sequence[ScheduledChunk], block_table: Callable[[int], list[int]],
              pending: PendingTokens | None = None) -> int:
        """Fill the static inputs of the smallest captured size that holds ``chunks`` (``serves(chunks)``
        must hold) and queue their copy to the device, then the copy of any tokens still on the device
        (``pending``) into place; returns that size for :meth:`replay`."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(chunks))]
        batch = self.batches[size]
        tokens, positions, tables = [], [], []
        pending_rows, pending_seq_ids = [], []
        for row, chunk in enumerate(chunks):
            sequence = chunk.sequence
            if chunk.start < len(sequence.token_ids):
                tokens.append(sequence.token_ids[chunk.start])
            else:  # sampled by the step in flight
                tokens.append(0)
                pending_rows.append(row)
                pending_seq_ids.append(sequence.seq_id)
            positions.append(chunk.start)
            tables.append(block_table(sequence.seq_id))
        if batch.copied is not None:
            batch.copied.synchronize()  # the last step's copy must have read the pinned buffers before they change
        self._fill(batch, tokens, positions, tables, [p + 1 for p in positions], chunks)
        batch.dev64.copy_(batch.host64, non_blocking=True)
        batch.dev32.copy_(batch.host32, non_blocking=True)
        if pending_rows:
            pending.copy_into(batch.dev64[0], pending_rows, pending_seq_ids)
        if self.capture:
            batch.copied = torch.cuda.Event()
            batch.copied.record()
        return size

    def replay(self, size: int, rows: int) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the step staged for ``size``."""
        # The captured output is overwritten by the next replay: the caller gets its own rows.
        return self.batches[size].run(self.graph, self._arguments[size])[:rows].clone()

    def _fill(self, batch: StaticBatch, tokens: list[int], positions: list[int], tables: list[list[int]],
              kv_lens: list[int], chunks: Sequence[ScheduledChunk] = ()) -> None:
        n, bs = len(tokens), self.block_size
        ids = batch.host64_np
        ids[0, :n], ids[1, :n] = tokens, positions
        ids[2, :n] = [slot(table, p, bs) for table, p in zip(tables, positions)]
        ids[:2, n:] = 0
        ids[2, n:] = self.pad_block * bs  # padding rows write their key and value into the pad block
        batch.host32_np[:n] = kv_lens
        batch.host32_np[n : batch.size] = 1
        for row, table in enumerate(tables):
            batch.tables_np[row, : len(table)] = table
        batch.tables_np[n:, 0] = self.pad_block
        if batch.cross:
            # Past a row's blocks its cross table keeps older entries: blocks of the cross pool all, read and masked.
            cross_tables, cross_lens = cross_rows(chunks)
            batch.cross_lens_np[:n] = cross_lens
            batch.cross_lens_np[n:] = 0  # padding: no encoder positions, so its cross-attention gives zeros
            for row, table in enumerate(cross_tables):
                batch.cross_tables_np[row, : len(table)] = table
