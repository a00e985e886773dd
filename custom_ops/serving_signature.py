"""The serving signature of an executable graph: the inputs the cache stage declares and the runtime fills.

One neutral module both sides import (``transforms/insert_cached_attention.py`` writes it,
``autodeploy/runtime/`` reads it), so the runtime needs neither the pipeline nor any transform. The
graph's inputs, in order::

    input_ids, position_ids,                       # [1, T]: the step's new tokens, flattened
    seq_start, kv_lens, block_tables, slot_mapping, batch_info, logit_index,
    k_cache_0, v_cache_0, k_cache_1, v_cache_1, …  # one KVCacheSpec per attention layer

A graph that verifies tree drafts takes ``tree_mask`` after ``logit_index``, and a model whose prompts hold
bidirectional blocks (Gemma 3's images) ``attend_until`` after that. An encoder–decoder's decoder graph also takes
``cross_lens[N]`` and ``cross_block_tables[N, max_blocks]`` (its sequences' encoder lengths and their blocks in the
cross-KV pool) and one cross cache pair per layer, ``cross_k_cache_i``, ``cross_v_cache_i`` (``cross_kv_caches``),
which ``cached_cross_attention`` reads (``custom_ops/cached_cross_attention.py``). The metadata's layout is documented
in ``custom_ops/cached_attention.py``; ``logit_index[N]`` picks the
token rows whose logits come out (``logits[1, N, vocab]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_INPUTS = ("input_ids", "position_ids")
SEQUENCE_METADATA = ("seq_start", "kv_lens", "block_tables", "slot_mapping", "batch_info", "logit_index")
ATTENTION_METADATA = SEQUENCE_METADATA[:5]  # what cached_attention reads, in its argument order
TREE_MASK = "tree_mask"  # [T] int64, only in graphs that verify tree drafts (custom_ops/cached_attention.py)
ATTEND_UNTIL = "attend_until"  # [T] int64, only in graphs of models with bidirectional prompt blocks (the same)
BATCH_INFO_FIELDS = ("num_prefill", "num_decode", "max_q_len", "max_kv_len")
CROSS_METADATA = ("cross_lens", "cross_block_tables")  # [N] int32, [N, max_blocks] int32: the cross-KV pool's


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache pair, as the cache stage declares it and the runtime allocates it."""

    key_input: str  # graph input name of k_cache
    value_input: str  # graph input name of v_cache
    kv_heads: int
    head_dim: int
    value_head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_layer(cls, layer: int, kv_heads: int, head_dim: int, value_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(f"k_cache_{layer}", f"v_cache_{layer}", kv_heads, head_dim, value_head_dim, dtype)

    @classmethod
    def cross_for_layer(cls, layer: int, kv_heads: int, head_dim: int, value_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
        """Decoder layer ``layer``'s cross-attention cache: its request's encoder keys and values, written once."""
        return cls(f"cross_k_cache_{layer}", f"cross_v_cache_{layer}", kv_heads, head_dim, value_head_dim, dtype)

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return block_size * self.kv_heads * (self.head_dim + self.value_head_dim) * element


@dataclass(frozen=True)
class ServingSignature:
    """What the runtime needs from a built graph besides the graph: its inputs in order, its caches, and the
    step sizes the compile stage chose to replay as captured graphs (none: every step runs eagerly)."""

    inputs: tuple[str, ...]
    kv_caches: tuple[KVCacheSpec, ...]
    decode_graph_batch_sizes: tuple[int, ...] = ()  # decode steps replayed as CUDA graphs (runtime/cuda_graphs.py)
    prefill_graph_token_sizes: tuple[int, ...] = ()  # prefill / mixed steps as piecewise graphs (runtime/piecewise_graphs.py)
    cross_kv_caches: tuple[KVCacheSpec, ...] = ()  # an encoder–decoder's cross-attention caches (a pool of their own)

    def __post_init__(self) -> None:
        # Lists from a context or a JSON file become tuples, so a signature is hashable and cannot drift.
        for name in ("inputs", "kv_caches", "decode_graph_batch_sizes", "prefill_graph_token_sizes", "cross_kv_caches"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
