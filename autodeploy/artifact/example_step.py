"""A representative step of the serving signature and its dynamic dims: what the served graph is re-exported over.

The runtime's own ``build_step_inputs`` fills the inputs for a mixed step — a partial prompt chunk, a whole
prompt and a decode deep into its sequence — so names, dtypes and devices are exactly what serving feeds.
Every dynamic size differs from every other one and from 0 and 1, so export neither specializes a dim to
its example value nor takes two dims for one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autodeploy.custom_ops.serving_signature import ATTEND_UNTIL, TREE_MASK, KVCacheSpec
from autodeploy.errors import ExportError
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.kv_cache import allocate_kv_caches
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.request import TokenRows
from autodeploy.runtime.step_inputs import SideInputSpec, build_step_inputs


@dataclass
class _ExampleRequest:
    side_inputs: dict[str, TokenRows]
    prompt_token_ids: list[int]
    whole_spans: tuple[tuple[int, int], ...] = ()


@dataclass
class _ExampleSequence:
    seq_id: int
    token_ids: list[int]
    request: _ExampleRequest | None = None  # what side inputs it carries

    @property
    def num_tokens(self) -> int:  # the scheduler's Schedulable: no token is ever on the device here
        return len(self.token_ids)


def _dynamic_dims(graph_inputs: Sequence[str], kv_caches: Sequence[KVCacheSpec],
                  side_inputs: Sequence[SideInputSpec] = ()) -> list[dict[int, object] | None]:
    Dim = torch.export.Dim
    tokens, sequences, blocks, rows, cache_blocks = (Dim(name) for name in (
        "tokens", "sequences", "blocks_per_sequence", "logit_rows", "cache_blocks"))
    dims: dict[str, dict[int, object] | None] = {
        "input_ids": {1: tokens}, "position_ids": {1: tokens}, "slot_mapping": {0: tokens},
        "seq_start": {0: sequences + 1}, "kv_lens": {0: sequences}, "block_tables": {0: sequences, 1: blocks},
        "batch_info": None, "logit_index": {0: rows}, TREE_MASK: {0: tokens},
        ATTEND_UNTIL: {0: tokens},
    }
    for spec in kv_caches:
        dims[spec.key_input] = dims[spec.value_input] = {0: cache_blocks}
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
    side_inputs: Sequence[SideInputSpec] = (),
) -> tuple[list[torch.Tensor], list[dict[int, object] | None]]:
    """The graph's inputs for one mixed step, in order, and each input's dynamic dims (``torch.export`` form). The
    partial prompt chunk carries ``b + 1`` rows of each side input (an image's feature rows, say)."""
    b = block_size
    carried = {spec.name: TokenRows(tuple(range(b + 1)), torch.zeros((b + 1, *spec.row_shape), dtype=spec.dtype)) for spec in side_inputs}
    prompt = [0] * (2 * b + 3)
    partial = _ExampleSequence(-1, prompt, _ExampleRequest(carried, prompt, ((1, b + 1),)) if carried else None)
    whole, deep = _ExampleSequence(-2, [0] * 3), _ExampleSequence(-3, [0] * (4 * b + 2))
    # Prompt chunks first, then decodes (the scheduler's order): 3 sequences, b + 6 tokens, 2 rows of logits
    # (the partial chunk completes nothing), block tables 5 or 6 wide.
    chunks = [ScheduledChunk(partial, 0, b + 2), ScheduledChunk(whole, 0, 3), ScheduledChunk(deep, 4 * b + 1, 1)]
    cached = [chunk.start + chunk.length for chunk in chunks]
    needed = sum(-(-tokens // b) for tokens in cached)
    pool = KVBlockPool(needed + b + 7, b, enable_prefix_caching=False)  # more blocks than any other size
    for chunk, tokens in zip(chunks, cached):
        pool.reserve(chunk.sequence.seq_id, tokens)
    caches = allocate_kv_caches(kv_caches, pool.num_blocks, b, device)
    inputs, _ = build_step_inputs(graph_inputs, chunks, pool, caches, device, side_inputs=side_inputs)
    return inputs, _dynamic_dims(graph_inputs, kv_caches, side_inputs)
