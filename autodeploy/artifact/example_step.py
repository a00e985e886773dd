"""A representative step of the serving signature and its dynamic dims: what the served graph is re-exported over.

The runtime's own ``build_step_inputs`` fills the inputs for a mixed step — a partial prompt chunk, a whole
prompt and a decode deep into its sequence — so names, dtypes and devices are exactly what serving feeds.
Every dynamic size differs from every other one and from 0 and 1, so export neither specializes a dim to
its example value nor takes two dims for one. An encoder–decoder's decoder graph also reads each sequence's blocks of
the cross-KV pool (``runtime/encoder_pass.py``), a pool of its own size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from autodeploy.custom_ops.serving_signature import ATTEND_UNTIL, CROSS_METADATA, TREE_MASK, KVCacheSpec
from autodeploy.errors import ExportError
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.kv_cache import allocate_kv_caches
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.request import TokenRows
from autodeploy.runtime.step_inputs import SideInputSpec, build_step_inputs


@dataclass
class _ExampleRequest:
    prompt_token_ids: list[int]
    side_inputs: dict[str, TokenRows] = field(default_factory=dict)
    whole_spans: tuple[tuple[int, int], ...] = ()
    cross_table: list[int] | None = None  # an encoder–decoder's: its blocks in the cross-KV pool, their token count
    cross_len: int = 0


@dataclass
class _ExampleSequence:
    seq_id: int
    token_ids: list[int]
    request: _ExampleRequest  # what side inputs it carries, which cross blocks it reads

    @property
    def num_tokens(self) -> int:  # the scheduler's Schedulable: no token is ever on the device here
        return len(self.token_ids)


def _dynamic_dims(graph_inputs: Sequence[str], kv_caches: Sequence[KVCacheSpec], side_inputs: Sequence[SideInputSpec] = (),
                  cross_kv_caches: Sequence[KVCacheSpec] = ()) -> list[dict[int, object] | None]:
    Dim = torch.export.Dim
    tokens, sequences, blocks, rows, cache_blocks, cross_blocks, cross_cache_blocks = (Dim(name) for name in (
        "tokens", "sequences", "blocks_per_sequence", "logit_rows", "cache_blocks", "cross_blocks_per_sequence",
        "cross_cache_blocks"))
    dims: dict[str, dict[int, object] | None] = {
        "input_ids": {1: tokens}, "position_ids": {1: tokens}, "slot_mapping": {0: tokens},
        "seq_start": {0: sequences + 1}, "kv_lens": {0: sequences}, "block_tables": {0: sequences, 1: blocks},
        "batch_info": None, "logit_index": {0: rows}, TREE_MASK: {0: tokens},
        ATTEND_UNTIL: {0: tokens}, CROSS_METADATA[0]: {0: sequences}, CROSS_METADATA[1]: {0: sequences, 1: cross_blocks},
    }
    for spec in kv_caches:
        dims[spec.key_input] = dims[spec.value_input] = {0: cache_blocks}
    for spec in cross_kv_caches:
        dims[spec.key_input] = dims[spec.value_input] = {0: cross_cache_blocks}
    for spec in side_inputs:  # a side input's rows and where they go: a count of their own
        side_rows = Dim(f"{spec.name}_rows")
        dims[spec.name] = dims[spec.index_input] = {0: side_rows}
    unknown = [name for name in graph_inputs if name not in dims]
    if unknown:
        raise ExportError(
            f"graph input(s) {', '.join(unknown)} are not in the serving signature (custom_ops/serving_signature.py), "
            f"so the deployment format does not know their dynamic dims; the graph cannot be saved"
        )
    return [dims[name] for name in graph_inputs]


def example_step(
    graph_inputs: Sequence[str], kv_caches: Sequence[KVCacheSpec], block_size: int, device: torch.device,
    side_inputs: Sequence[SideInputSpec] = (), cross_kv_caches: Sequence[KVCacheSpec] = (),
) -> tuple[list[torch.Tensor], list[dict[int, object] | None]]:
    """The graph's inputs for one mixed step, in order, and each input's dynamic dims (``torch.export`` form). The
    partial prompt chunk carries ``b + 1`` rows of each side input (an image's feature rows, say)."""
    b = block_size
    carried = {spec.name: TokenRows(tuple(range(b + 1)), torch.zeros((b + 1, *spec.row_shape), dtype=spec.dtype)) for spec in side_inputs}
    prompt = [0] * (2 * b + 3)
    partial = _ExampleSequence(-1, prompt, _ExampleRequest(prompt, carried, ((1, b + 1),) if carried else ()))
    whole, deep = (_ExampleSequence(seq_id, tokens, _ExampleRequest(tokens)) for seq_id, tokens in ((-2, [0] * 3), (-3, [0] * (4 * b + 2))))
    # An encoder–decoder's sequences read cross tables b + 7, 2 and 1 wide, of a pool of b + 8 blocks (more than any
    # other size but the self-attention pool's, which has at least b + 10).
    if cross_kv_caches:
        for sequence, width in ((partial, b + 7), (whole, 2), (deep, 1)):
            sequence.request.cross_table, sequence.request.cross_len = list(range(width)), width * b
    # Prompt chunks first, then decodes (the scheduler's order): 3 sequences, b + 6 tokens, 2 rows of logits
    # (the partial chunk completes nothing), block tables 5 or 6 wide.
    chunks = [ScheduledChunk(partial, 0, b + 2), ScheduledChunk(whole, 0, 3), ScheduledChunk(deep, 4 * b + 1, 1)]
    cached = [chunk.start + chunk.length for chunk in chunks]
    needed = sum(-(-tokens // b) for tokens in cached)
    pool = KVBlockPool(needed + b + 7, b, enable_prefix_caching=False)  # more blocks than any other size
    for chunk, tokens in zip(chunks, cached):
        pool.reserve(chunk.sequence.seq_id, tokens)
    caches = allocate_kv_caches(kv_caches, pool.num_blocks, b, device)
    caches.update(allocate_kv_caches(cross_kv_caches, b + 8, b, device))
    inputs, _ = build_step_inputs(graph_inputs, chunks, pool, caches, device, side_inputs=side_inputs)
    return inputs, _dynamic_dims(graph_inputs, kv_caches, side_inputs, cross_kv_caches)
