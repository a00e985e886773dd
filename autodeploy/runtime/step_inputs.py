"""Fill the executable graph's declared inputs for one scheduled step.

The cache stage declares the inputs (``transforms/insert_cached_attention.py``); this module fills
exactly those from the scheduler's chunks and the block pool's tables, on the host, then copies them to
the device in one go per tensor. ``batch_info`` stays on the CPU: kernels read it without a sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.scheduler import ScheduledChunk


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
) -> tuple[list[torch.Tensor], list[int]]:
    """Graph arguments in declared order, and the indices (into ``chunks``) whose logits come out, in
    output-row order: the chunks that reach their sequence's last token, or every token of every chunk
    with ``logits_for_all_tokens``."""
    block_size = pool.block_size
    input_ids: list[int] = []
    positions: list[int] = []
    seq_start = [0]
    kv_lens: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    logit_index: list[int] = []
    completing: list[int] = []
    num_decode = 0
    max_q_len = 0
    for index, chunk in enumerate(chunks):
        sequence = chunk.sequence
        end = chunk.start + chunk.length
        table = pool.block_table(sequence.seq_id)
        input_ids += sequence.token_ids[chunk.start : end]
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

    def to_device(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    available = {
        "input_ids": to_device([input_ids], torch.long),
        "position_ids": to_device([positions], torch.long),
        "seq_start": to_device(seq_start, torch.int32),
        "kv_lens": to_device(kv_lens, torch.int32),
        "block_tables": block_tables.to(device, non_blocking=True),
        "slot_mapping": to_device(slots, torch.long),
        "batch_info": torch.tensor([len(chunks) - num_decode, num_decode, max(max_q_len, 1), max(kv_lens)], dtype=torch.int32),
        "logit_index": to_device(logit_index, torch.long),
        **caches,
    }
    missing = [name for name in input_names if name not in available]
    if missing:
        raise RuntimeError(f"the runtime cannot fill graph input(s) {missing}; it fills {sorted(available)}")
    return [available[name] for name in input_names], completing
