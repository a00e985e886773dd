"""Fill the executable graph's declared inputs for one scheduled step.

The cache stage declares the inputs (``transforms/insert_cached_attention.py``); this module fills
exactly those from the scheduler's chunks and the block pool's tables, on the host, then copies them to
the device in one go per tensor. ``batch_info`` stays on the CPU: kernels read it without a sync.

With the overlapped runtime a sequence's newest token may still be on the device (sampled by the step
in flight, ``PendingTokens``): its input position gets a placeholder on the host and the device copies
the sampled token in before the forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.device_copies import pinned_to_device, to_device
from autodeploy.runtime.scheduler import ScheduledChunk


@dataclass
class PendingTokens:
    """The tokens the step in flight sampled, still on the device: ``tokens[row_of[seq_id]]`` is the
    newest token of sequence ``seq_id``, which its ``token_ids`` do not hold yet."""

    tokens: torch.Tensor  # [rows] int64
    row_of: dict[int, int]

    def copy_into(self, input_ids: torch.Tensor, places: list[int], seq_ids: list[int]) -> None:
        """Write the pending tokens of ``seq_ids`` into the flat ``input_ids`` at ``places`` (on the device)."""
        if not places:
            return
        rows = [self.row_of[seq_id] for seq_id in seq_ids]
        if places == rows == list(range(len(rows))):  # the same batch again: one copy, no index tensors
            input_ids[: len(rows)].copy_(self.tokens[: len(rows)])
            return
        device = input_ids.device
        input_ids.index_copy_(0, to_device(places, torch.long, device), self.tokens.index_select(0, to_device(rows, torch.long, device)))


def slot(table: list[int], position: int, block_size: int) -> int:
    """The flat cache slot (``block * block_size + offset``) of ``position`` in a sequence with block ``table``."""
    return table[position // block_size] * block_size + position % block_size


def build_step_inputs(
    input_names: Sequence[str],
    chunks: Sequence[ScheduledChunk],
    pool: KVBlockPool,
    caches: dict[str, torch.Tensor],
    device: torch.device,
    logits_for_all_tokens: bool = False,
    pending: PendingTokens | None = None,
) -> tuple[list[torch.Tensor], list[int]]:
    """Graph arguments in declared order, and the indices (into ``chunks``) whose logits come out, in
    output-row order: the chunks that reach their sequence's last token, or every token of every chunk
    with ``logits_for_all_tokens``. A chunk may end at a token still on the device (``pending``)."""
    block_size = pool.block_size
    input_ids: list[int] = []
    positions: list[int] = []
    seq_start = [0]
    kv_lens: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    logit_index: list[int] = []
    completing: list[int] = []
    pending_places: list[int] = []
    pending_seq_ids: list[int] = []
    num_decode = 0
    max_q_len = 0
    for index, chunk in enumerate(chunks):
        sequence = chunk.sequence
        end = chunk.start + chunk.length
        table = pool.block_table(sequence.seq_id)
        known = sequence.token_ids[chunk.start : end]
        input_ids += known
        if len(known) < chunk.length:  # its newest token is the step in flight's: filled on the device
            pending_places.append(len(input_ids))
            pending_seq_ids.append(sequence.seq_id)
            input_ids.append(0)
        span = range(chunk.start, end)
        positions += span
        slots += [slot(table, p, block_size) for p in span]
        if logits_for_all_tokens:
            logit_index += range(seq_start[-1], seq_start[-1] + chunk.length)
        elif chunk.completes:
            logit_index.append(seq_start[-1] + chunk.length - 1)
            completing.append(index)
        seq_start.append(seq_start[-1] + chunk.length)
        kv_lens.append(end)
        tables.append(table)
        if chunk.length == 1:
            num_decode += 1
        else:
            max_q_len = max(max_q_len, chunk.length)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)

    ids = to_device([input_ids], torch.long, device)
    if pending_places:
        pending.copy_into(ids[0], pending_places, pending_seq_ids)
    available = {
        "input_ids": ids,
        "position_ids": to_device([positions], torch.long, device),
        "seq_start": to_device(seq_start, torch.int32, device),
        "kv_lens": to_device(kv_lens, torch.int32, device),
        "block_tables": pinned_to_device(block_tables, device),
        "slot_mapping": to_device(slots, torch.long, device),
        "batch_info": torch.tensor([len(chunks) - num_decode, num_decode, max(max_q_len, 1), max(kv_lens)], dtype=torch.int32),
        "logit_index": to_device(logit_index, torch.long, device),
        **caches,
    }
    missing = [name for name in input_names if name not in available]
    if missing:
        raise RuntimeError(f"the runtime cannot fill graph input(s) {missing}; it fills {sorted(available)}")
    return [available[name] for name in input_names], completing
