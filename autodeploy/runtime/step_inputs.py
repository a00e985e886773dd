"""Fill the executable graph's declared inputs for one scheduled step.

The cache stage declares the inputs (``transforms/insert_cached_attention.py``); this module fills
exactly those from the scheduler's chunks and the block pool's tables, on the host, then copies them to
the device in one go per tensor. ``batch_info`` stays on the CPU: kernels read it without a sync.

With the overlapped runtime a sequence's newest token may still be on the device (sampled by the step
in flight, ``PendingTokens``): its input position gets a placeholder on the host and the device copies
the sampled token in before the forward runs.

A graph may also declare side inputs (``SideInputSpec``): rows that requests carry for given prompt
positions (``Request.side_inputs``), gathered for the tokens of the step in its token order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from autodeploy.custom_ops.serving_signature import ATTEND_UNTIL, CROSS_METADATA, TREE_MASK
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.errors import UnsupportedModelError
from autodeploy.runtime.device_copies import pinned_to_device, to_device
from autodeploy.runtime.draft_trees import tree_depths, tree_masks
from autodeploy.runtime.scheduler import ScheduledChunk

TOKEN_INDEX_SUFFIX = "_token_index"


@dataclass(frozen=True)
class SideInputSpec:
    """A side input a graph declares as two inputs: ``<name>`` ``[N, *row_shape]``, the rows that the
    step's requests carry for the tokens it computes (``TokenRows``), in the step's token order, and
    ``<name>_token_index`` ``[N]``, each row's token among the step's (where to scatter it)."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def index_input(self) -> str:
        return self.name + TOKEN_INDEX_SUFFIX


def declared_side_inputs(graph: fx.GraphModule, input_names: Sequence[str]) -> dict[str, SideInputSpec]:
    """The side inputs among ``input_names``: every ``<name>`` that has a ``<name>_token_index`` beside it,
    its row shape and dtype from the shape the graph recorded for it."""
    placeholders = {node.target: node for node in graph.graph.nodes if node.op == "placeholder"}
    specs = {}
    for index_input in input_names:
        name = index_input.removesuffix(TOKEN_INDEX_SUFFIX)
        if name == index_input or name not in input_names:
            continue
        value = placeholders[name].meta.get("val") if name in placeholders else None
        if not isinstance(value, torch.Tensor):
            raise UnsupportedModelError(f"the graph's side input {name!r} carries no recorded shape; export the graph "
                                        f"with an example value for it")
        specs[name] = SideInputSpec(name, tuple(int(d) for d in value.shape[1:]), value.dtype)
    return specs


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


def copy_device_drafts(input_ids: torch.Tensor, firsts: Sequence[tuple[int, ScheduledChunk]]) -> None:
    """Write the drafted tokens still on the device (``chunk.draft_source[chunk.draft_rows]``) of each chunk into the
    flat ``input_ids`` from place ``first`` on: one indexed copy for the step."""
    places: list[int] = []
    sources: list[int] = []
    source = None
    for first, chunk in firsts:
        if chunk.draft_rows is not None:
            places += range(first, first + len(chunk.draft_rows))
            sources += chunk.draft_rows
            source = chunk.draft_source
    if places:
        device = input_ids.device
        input_ids.index_copy_(0, to_device(places, torch.long, device),
                              source.index_select(0, to_device(sources, torch.long, device)))


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
    side_inputs: Sequence[SideInputSpec] = (),
) -> tuple[list[torch.Tensor], list[int]]:
    """Graph arguments in declared order, and the indices (into ``chunks``) whose logits come out, in
    output-row order: the chunks that reach their sequence's last token (one row each, or ``1 + len(draft)``
    rows for a chunk verifying a draft), or every token of every chunk with ``logits_for_all_tokens``. A chunk
    may end at a token still on the device (``pending``)."""
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
    trees = TREE_MASK in input_names
    tree_mask: list[int] = []
    blocks = ATTEND_UNTIL in input_names
    attend_until: list[int] = []
    drafts_at: list[tuple[int, ScheduledChunk]] = []  # where each chunk's draft starts in input_ids
    for index, chunk in enumerate(chunks):
        sequence = chunk.sequence
        end = chunk.start + chunk.length
        table = pool.block_table(sequence.seq_id)
        known = sequence.token_ids[chunk.start : end - len(chunk.draft)] + chunk.draft
        drafts_at.append((len(input_ids) + len(known) - len(chunk.draft), chunk))
        input_ids += known
        if len(known) < chunk.length:  # its newest token is the step in flight's: filled on the device
            pending_places.append(len(input_ids))
            pending_seq_ids.append(sequence.seq_id)
            input_ids.append(0)
        span = range(chunk.start, end)
        if chunk.draft_parents is None:
            positions += span
        else:  # a tree's nodes sit at the positions of their depths, in the slots after the newest token
            positions += [chunk.start + depth for depth in (0, *tree_depths(chunk.draft_parents))]
        if trees:
            tree_mask += [-1] * chunk.length if chunk.draft_parents is None else tree_masks(chunk.draft_parents)
        if blocks:
            attend_until += chunk_attend_until(chunk)
        slots += [slot(table, p, block_size) for p in span]
        if logits_for_all_tokens:
            logit_index += range(seq_start[-1], seq_start[-1] + chunk.length)
        elif chunk.draft:  # a verification chunk: a row for its newest token and for each drafted one
            logit_index += range(seq_start[-1] + chunk.length - 1 - len(chunk.draft), seq_start[-1] + chunk.length)
            completing.append(index)
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
    # one tensor from padded lists: a tensor a row cost ~3 µs each (0.85 ms a step at 256 rows, on a CPU)
    block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)

    ids = to_device([input_ids], torch.long, device)
    if pending_places:
        pending.copy_into(ids[0], pending_places, pending_seq_ids)
    copy_device_drafts(ids[0], drafts_at)
    available = {
        "input_ids": ids,
        "position_ids": to_device([positions], torch.long, device),
        "seq_start": to_device(seq_start, torch.int32, device),
        "kv_lens": to_device(kv_lens, torch.int32, device),
        "block_tables": pinned_to_device(block_tables, device),
        "slot_mapping": to_device(slots, torch.long, device),
        "batch_info": torch.tensor([len(chunks) - num_decode, num_decode, max(max_q_len, 1), max(kv_lens)], dtype=torch.int32),
        "logit_index": to_device(logit_index, torch.long, device),
        **({TREE_MASK: to_device(tree_mask, torch.long, device)} if trees else {}),
        **({ATTEND_UNTIL: to_device(attend_until, torch.long, device)} if blocks else {}),
        **caches,
    }
    if CROSS_METADATA[0] in input_names:
        available.update(_cross_inputs(chunks, device))
    for spec in side_inputs:
        available[spec.name], available[spec.index_input] = _gather_side_input(spec, chunks, device)
    missing = [name for name in input_names if name not in available]
    if missing:
        raise RuntimeError(f"the runtime cannot fill graph input(s) {missing}; it fills {sorted(available)}")
    return [available[name] for name in input_names], completing


def cross_rows(chunks: Sequence[ScheduledChunk]) -> tuple[list[list[int]], list[int]]:
    """An encoder–decoder's cross rows of the chunks: each one's request's blocks in the cross-KV pool and its encoder
    length (``encoder_pass.py``); block 0 and length 0 for the engine's probes (their cross-attention reads nothing)."""
    requests = [chunk.sequence.request for chunk in chunks]
    tables = [(r.cross_table or [0]) if r is not None else [0] for r in requests]
    lengths = [r.cross_len if r is not None and r.cross_table is not None else 0 for r in requests]
    return tables, lengths


def _cross_inputs(chunks: Sequence[ScheduledChunk], device: torch.device) -> dict[str, torch.Tensor]:
    """``cross_lens`` and ``cross_block_tables`` (``cross_rows``), the tables as wide as the step's widest."""
    tables, lengths = cross_rows(chunks)
    block_tables = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return {"cross_lens": to_device(lengths, torch.int32, device), "cross_block_tables": pinned_to_device(block_tables, device)}


def chunk_attend_until(chunk: ScheduledChunk) -> list[int]:
    """``cached_attention``'s ``attend_until`` rows of a chunk: each token inside one of its request's bidirectional
    blocks (``Request.whole_spans``) sees up to the block's last position; every other token, -1 (causal)."""
    rows = [-1] * chunk.length
    request = chunk.sequence.request
    if request is None or not request.whole_spans or chunk.start >= len(request.prompt_token_ids):
        return rows
    for first, end in request.whole_spans:
        for position in range(max(first, chunk.start), min(end, chunk.start + chunk.length)):
            rows[position - chunk.start] = end - 1
    return rows


def no_side_rows(specs: Sequence[SideInputSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """Each side input with no rows, as a captured step holds them (a decode or verification step computes no prompt
    position that carries rows: ``carries_side_rows``)."""
    empty = {}
    for spec in specs:
        empty[spec.name] = torch.zeros((0, *spec.row_shape), dtype=spec.dtype, device=device)
        empty[spec.index_input] = torch.zeros(0, dtype=torch.long, device=device)
    return empty


def carries_side_rows(chunks: Sequence[ScheduledChunk], specs: Sequence[SideInputSpec]) -> bool:
    """Whether a position the chunks compute carries a row of a side input (a prompt's image placeholder, say)."""
    for chunk in chunks:
        request = chunk.sequence.request
        if not _may_carry_rows(chunk):
            continue
        for spec in specs:
            carried = request.side_inputs.get(spec.name)
            if carried is not None and any(chunk.start <= p < chunk.start + chunk.length for p in carried.positions):
                return True
    return False


def _may_carry_rows(chunk: ScheduledChunk) -> bool:
    """Rows go with prompt positions only (admission checks it): a chunk past the prompt (a decode, a verification)
    carries none, which spares every decode step a walk over an image's hundreds of positions."""
    request = chunk.sequence.request
    return request is not None and bool(request.side_inputs) and chunk.start < len(request.prompt_token_ids)


def _gather_side_input(spec: SideInputSpec, chunks: Sequence[ScheduledChunk], device: torch.device):
    """The rows of side input ``spec`` that the chunks' requests carry for the positions the chunks compute,
    in token order, and the token (in the step) each goes to."""
    rows: list[torch.Tensor] = []
    token_index: list[int] = []
    first_token = 0
    for chunk in chunks:
        request = chunk.sequence.request  # None for the engine's probes, which carry nothing
        carried = request.side_inputs.get(spec.name) if _may_carry_rows(chunk) else None
        if carried is not None:
            computed = [(p, i) for i, p in enumerate(carried.positions) if chunk.start <= p < chunk.start + chunk.length]
            computed.sort()
            rows += [carried.rows[i] for _, i in computed]
            token_index += [first_token + p - chunk.start for p, _ in computed]
        first_token += chunk.length
    stacked = torch.stack(rows) if rows else torch.zeros((0, *spec.row_shape), dtype=spec.dtype)
    return stacked.to(device), to_device(token_index, torch.long, device)
