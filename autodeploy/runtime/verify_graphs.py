"""CUDA graphs of the verification step of speculative decoding: ``K + 1`` tokens a sequence, captured per batch size.

A step in which every sequence decodes — its newest token, then the up to ``K`` tokens drafted for it
(``runtime/speculative.py``), or no draft — is a forward over ``b × (K + 1)`` tokens laid out alike at every
step: ``b`` sequences of ``K + 1`` query tokens each, after their cached context. Like the decode graphs
(``cuda_graphs.py``) it is captured once per batch size and replayed with the batch padded up. Within a row,
the tokens past a sequence's draft are padding: they come after its real tokens, so causal attention never
lets a real token see them; their keys and values go to the pad block (a block the pool never hands out), and
their logits are dropped. Rows past the batch are padding sequences of the same kind.

Each size's ``batch_info`` is fixed at capture to ``[b, 0, K + 1, max_seq_len + K + 1]`` (every sequence a
``K + 1``-token chunk; the kernels size their grids for the longest possible one), ``seq_start`` to
``0, K + 1, 2 (K + 1), …``; ids, positions, slots, lengths and block tables are refilled per step from pinned
host buffers in two copies. Padding positions are clamped below ``max_seq_len`` (the rotary tables end there)
and block tables are wide enough for the padding's positions, so nothing reads past a table. Tree drafts
(``speculative.tree_width`` = w) make it ``K·w + 1`` tokens a sequence, their nodes at their depths' positions and
their ``tree_mask`` rows filled in (every other row: -1, causal).

Before a capture is used, its replay must give the logits an eager forward gives on the same inputs
(``check``): a kernel that reads a host value at capture time would replay stale work, and then the graphs
are dropped with a warning and verification steps run as before. On the CPU nothing is captured: ``replay``
calls the graph on the same static inputs, so the padding is the one a GPU replays.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

from autodeploy.custom_ops.graph_capture import GraphCapture
from autodeploy.runtime.cuda_graphs import StaticBatch
from autodeploy.runtime.device_copies import to_device
from autodeploy.runtime.draft_trees import tree_depths, tree_masks
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.step_inputs import PendingTokens, SideInputSpec, copy_device_drafts, no_side_rows, slot

logger = logging.getLogger(__name__)


class VerifyGraphs:
    """Captured verification steps of ``num_tokens`` drafted tokens a sequence; see the module docstring."""

    def __init__(self, graph: Callable[..., tuple[torch.Tensor, ...]], input_names: Sequence[str],
                 caches: dict[str, torch.Tensor], batch_sizes: Sequence[int], num_tokens: int, block_size: int,
                 max_seq_len: int, pad_block: int, device: torch.device, side_inputs: Sequence[SideInputSpec] = ()):
        self.graph = graph
        self.width = num_tokens + 1
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.pad_block = pad_block
        self.device = device
        self.capture = device.type == "cuda"
        self.sizes = sorted(set(batch_sizes))
        max_blocks = -(-(max_seq_len + self.width) // block_size)
        self.rows = {size: StaticBatch(size, max_blocks, device, self.capture, self.width) for size in self.sizes}
        empty = no_side_rows(side_inputs, device)  # a verification step computes no prompt position
        self._arguments = {size: [{**rows.named_inputs(max_blocks, max_seq_len + self.width), **empty, **caches}[name] for name in input_names]
                           for size, rows in self.rows.items()}
        for rows in self.rows.values():
            self._fill(rows, [])
        self.pool_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every size, largest first into one memory pool (``check`` then compares a replay with eager).
        Raises what capture raised."""
        if not self.capture:
            return
        capture = GraphCapture(self.device)
        capture.capture_sizes(self.graph, self._arguments, self.rows)
        self.pool_bytes = capture.pool_bytes()
        logger.info("verification CUDA graphs: %d batch sizes up to %d of %d tokens each captured, %.2f GiB; %s",
                    len(self.sizes), self.max_size, self.width, self.pool_bytes / 2**30, capture.times)

    def check(self, chunks: Sequence[ScheduledChunk], block_table: Callable[[int], list[int]]) -> None:
        """The replay of a real verification step (``chunks``, on blocks of the pool) keeps the logits an eager
        forward gives on the same static inputs. (Padding alone would not do: its rows' logits are not kept,
        and may not even be finite.)"""
        size, keep = self.stage(chunks, block_table)
        replayed = self.replay(size, keep)
        eager = self.graph(*self._arguments[size])[0].index_select(0, keep)
        if not (replayed.isfinite().all() and torch.allclose(replayed.float(), eager.float(), rtol=1e-3, atol=1e-3)):
            worst = float((replayed.float() - eager.float()).nan_to_num(float("inf")).abs().max())
            raise RuntimeError(f"the replayed verification step differs from the eager one by up to {worst:.3g} (rows "
                               f"with non-finite logits: replayed {_bad_rows(replayed)}, eager {_bad_rows(eager)} of "
                               f"{len(eager)})")

    def serves(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether every chunk decodes its sequence's newest token and at most ``width - 1`` drafted ones, some chunk
        has a draft, and the batch fits the largest size."""
        return (0 < len(chunks) <= self.max_size and any(c.draft for c in chunks)
                and all(c.length == 1 + len(c.draft) < 1 + self.width and c.completes for c in chunks))

    def stage(self, chunks: Sequence[ScheduledChunk], block_table: Callable[[int], list[int]],
              pending: PendingTokens | None = None) -> tuple[int, torch.Tensor]:
        """Fill the smallest captured size holding ``chunks`` (``serves`` must hold) and queue the copies; returns
        that size and the rows of its logits to keep (each chunk's ``1 + len(draft)``, in order)."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(chunks))]
        rows = self.rows[size]
        if rows.copied is not None:
            rows.copied.synchronize()  # the last step's copy must have read the pinned buffers before they change
        pending_places, pending_seq_ids, keep = [], [], []
        for row, chunk in enumerate(chunks):
            sequence = chunk.sequence
            if chunk.start < len(sequence.token_ids):
                pending_places.append(None)
            else:  # sampled by the step in flight (a chunk without a draft)
                pending_places.append(row * self.width)
                pending_seq_ids.append(sequence.seq_id)
            keep += range(row * self.width, row * self.width + chunk.length)
        self._fill(rows, chunks, block_table)
        rows.dev64.copy_(rows.host64, non_blocking=True)
        rows.dev32.copy_(rows.host32, non_blocking=True)
        places = [p for p in pending_places if p is not None]
        if places:
            pending.copy_into(rows.dev64[0], places, pending_seq_ids)
        copy_device_drafts(rows.dev64[0], [(row * self.width + 1, chunk) for row, chunk in enumerate(chunks)])
        if self.capture:
            rows.copied = torch.cuda.Event()
            rows.copied.record()
        return size, to_device(keep, torch.long, self.device)

    def replay(self, size: int, keep: torch.Tensor) -> torch.Tensor:
        """The kept logits rows of the step staged for ``size``."""
        # index_select copies: the next replay overwrites the captured output.
        return self.rows[size].run(self.graph, self._arguments[size]).index_select(0, keep)

    def _fill(self, rows: StaticBatch, chunks: Sequence[ScheduledChunk], block_table: Callable | None = None) -> None:
        width, bs, pad_slot = self.width, self.block_size, self.pad_block * self.block_size
        ids, last_position = rows.host64_np, self.max_seq_len - 1
        ids[:] = 0
        ids[2, :] = pad_slot  # padding writes its key and value into the pad block
        ids[3, :] = -1  # causal, but for tree drafts' rows
        rows.host32_np[: rows.size] = width  # padding sequences: width tokens at positions 0 … width - 1
        rows.tables_np[:, :] = self.pad_block
        for row, chunk in enumerate(chunks):
            sequence, first = chunk.sequence, row * width
            table = block_table(sequence.seq_id)
            known = sequence.token_ids[chunk.start : chunk.start + 1]
            tokens = (known or [0]) + list(chunk.draft)
            ids[0, first : first + len(tokens)] = tokens
            ids[1, first : first + width] = [min(chunk.start + j, last_position) for j in range(width)]
            if chunk.draft_parents is not None:  # nodes at their depths' positions, seeing their ancestors
                ids[1, first + 1 : first + chunk.length] = [chunk.start + d for d in tree_depths(chunk.draft_parents)]
                ids[3, first : first + chunk.length] = tree_masks(chunk.draft_parents)
            ids[2, first : first + chunk.length] = [slot(table, chunk.start + j, bs) for j in range(chunk.length)]
            rows.host32_np[row] = chunk.start + width
            rows.tables_np[row, : len(table)] = table


def _bad_rows(logits: torch.Tensor) -> list[int]:
    return (~logits.float().isfinite().all(dim=-1)).nonzero().flatten().tolist()[:8]
