"""``torch.ops.autodeploy.cached_attention``: attention over a paged KV cache for a mixed batch.

The cache stage swaps every canonical ``attention`` for this op. One forward carries the new tokens of
many sequences flattened into one row (``q[1, T, Hq, D]``): prompt chunks being prefilled and single
tokens being decoded, side by side. Each sequence's keys and values live in fixed-size blocks of a
per-layer cache, found through its row of ``block_tables``.

Layout and metadata (N sequences, T new tokens in all):

- ``k_cache[num_blocks, block_size, Hkv, D]``, ``v_cache[num_blocks, block_size, Hkv, Dv]``, in the model's dtype
  or float8_e4m3fn (``quantize.kv_cache: fp8``: values divided by the layer's ``k_scale`` / ``v_scale`` and
  saturated at ±448; read back into ``q``'s dtype, times the scale).
- ``seq_start[N + 1]`` (int32): sequence ``s`` owns tokens ``seq_start[s] : seq_start[s + 1]`` of the row.
- ``kv_lens[N]`` (int32): tokens of ``s`` in the cache once this step's are written; its new tokens sit
  at absolute positions ``kv_lens[s] - q_len_s … kv_lens[s] - 1``.
- ``block_tables[N, max_blocks]`` (int32): position ``p`` of ``s`` lives in block ``block_tables[s, p // block_size]``
  at offset ``p % block_size``.
- ``slot_mapping[T]`` (int64): the flat slot (``block * block_size + offset``) each new token is written to.
- ``batch_info`` (int32, on the CPU so kernels read it without a device sync):
  ``[num_prefill, num_decode, max_q_len, max_kv_len]``. Sequences ``0 … num_prefill - 1`` are prompt
  chunks (any length); the last ``num_decode`` have exactly one new token each.
- ``tree_mask[T]`` (int64, optional: only graphs built for tree drafts, ``speculative.tree_width`` > 1, have it):
  which of its sequence's new tokens each new token sees besides the cached ones. ``-1``: every one up to
  itself (causal: prompt chunks, decodes, chains). Otherwise a bitmask over the chunk's tokens (bit ``j``, ``j``
  ≤ 62, the chunk's token ``j``; its own bit set): a tree verification chunk, the sequence's newest token then
  drafted nodes, each after its parent, each seeing its ancestors and itself
  (``runtime/speculative.py``). A token never sees a later one, whatever its bits say.
- ``attend_until[T]`` (int64, optional: only graphs of models with bidirectional blocks in their prompts have it,
  Gemma 3's images): the last position each new token sees when that is past its own, ``-1`` where it is its own
  (causal). A block's tokens all name the block's last position, so they see one another; a prompt chunk always
  holds the rest of a block it starts (``runtime/scheduler.py``), so the keys a token sees are cached or new in
  its chunk. A sliding window still counts back from the token's own position.
- ``distance_bias[Hq, L]`` (optional: only graphs of models with a relative position bias have it, T5's decoder):
  added to the logit of query position ``i`` and key position ``j`` (``j ≤ i``) as ``distance_bias[h, i - j]``;
  ``L`` must exceed every sequence's last position. The cache stage computes it from the model's bias table
  (``relative_position_bias_by_distance``), once a forward for all layers. Not with ``attend_until``.
"""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch

from .attention import attend, check_alibi_slopes
from .compute_dtype import compute_dtype
from .registry import arguments_tuple, register_backend, register_op



FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
FP8_CACHE_MAX = 448.0  # float8_e4m3fn's largest finite value: a cache stores values (over its scale) saturated to it
# Why a kernel without a relative position bias refuses a layer that has one (select then gives it the next candidate).
DISTANCE_BIAS_REFUSAL = "no relative position bias (distance_bias, T5's) in this kernel"


def to_cache_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a cache of ``dtype`` stores them: an fp8 cache saturates at ±448 and rounds to nearest."""
    if dtype in FP8_CACHE_DTYPES:
        return values.to(torch.float32).clamp(-FP8_CACHE_MAX, FP8_CACHE_MAX).to(dtype)
    return values.to(dtype)


def read_back(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached values in ``dtype``: what ``write_kv_cache`` stored, times the layer's ``scale``."""
    if scale == 1.0:
        return stored.to(dtype)
    return (stored.to(torch.promote_types(dtype, torch.float32)) * scale).to(dtype)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store the new tokens' keys and values (``k[1, T, Hkv, D]``) at their slots, in the caches' dtype,
    divided by the layer's scales (an fp8 cache's; 1 otherwise)."""
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values = new[0] if scale == 1.0 else new[0].to(torch.float32) / scale
        stored, flat = to_cache_dtype(values, cache.dtype), cache.view(-1, *cache.shape[2:])
        if cache.dtype in FP8_CACHE_DTYPES:  # index_copy_ has no float8 kernel on CPUs: copy the bytes
            stored, flat = stored.view(torch.uint8), flat.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, stored)


def gather_sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached keys and values, ``[kv_len, Hkv, D]``, from its row of the block table."""
    blocks = block_table[: -(-kv_len // k_cache.shape[1])].long()
    return k_cache[blocks].flatten(0, 1)[:kv_len], v_cache[blocks].flatten(0, 1)[:kv_len]


def cached_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_start: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    batch_info: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    logit_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[List[float]] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tree_mask: Optional[torch.Tensor] = None,
    attend_until: Optional[torch.Tensor] = None,
    distance_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Write this step's ``k``/``v`` into the caches, then attend each new token over its sequence's
    cached tokens with the ``attention`` op's semantics (causal on absolute positions, GQA, window,
    soft-cap, sinks, ALiBi; a tree chunk's ``tree_mask``; bidirectional blocks' ``attend_until``; a relative
    position bias by distance, ``distance_bias``).
    ``k_scale`` / ``v_scale``: the layer's fp8 cache scales (a stored value times its scale is the value).
    Returns ``[1, T, Hq, Dv]`` in ``q``'s dtype. The oracle: one sequence at a time."""
    check_alibi_slopes("cached_attention", alibi_slopes, q.shape[2])
    check_distance_bias("cached_attention", distance_bias, q.shape[2], kv_lens, attend_until)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    starts = seq_start.tolist()
    for s, kv_len in enumerate(kv_lens.tolist()):
        first, last = starts[s], starts[s + 1]
        keys, values = gather_sequence_kv(k_cache, v_cache, block_tables[s], kv_len)
        dtype = compute_dtype(q.dtype)  # float64 caches stay float64: the oracle loses no precision
        keys, values = read_back(keys, dtype, k_scale)[None], read_back(values, dtype, v_scale)[None]
        key_positions = torch.arange(kv_len, device=q.device)
        query_positions = key_positions[kv_len - (last - first) :]
        bias = None if distance_bias is None else bias_by_distance(distance_bias, query_positions, key_positions)[None]
        out[:, first:last] = attend(
            q[:, first:last], keys, values, query_positions, key_positions, scale, sliding_window, logit_cap, sinks,
            alibi_slopes, tree_visibility(tree_mask, first, last, kv_len), last_keys(attend_until, first, last), bias,
        )
    return out


def check_distance_bias(op: str, distance_bias: Optional[torch.Tensor], q_heads: int, kv_lens: torch.Tensor,
                        attend_until: Optional[torch.Tensor]) -> None:
    """``distance_bias`` must be ``[Hq, L]`` with ``L`` past every sequence's last position, and not meet keys after a
    query (``attend_until``), whose distances it has no column for."""
    if distance_bias is None:
        return
    longest = int(kv_lens.max()) if kv_lens.numel() else 0
    if distance_bias.dim() != 2 or distance_bias.shape[0] != q_heads or distance_bias.shape[1] < longest:
        raise ValueError(f"{op}: distance_bias must be [Hq={q_heads}, L ≥ {longest} (the longest sequence)]; got "
                         f"{tuple(distance_bias.shape)}.")
    if attend_until is not None:
        raise ValueError(f"{op}: distance_bias is by distance back from the query; it cannot bias keys after it (attend_until).")


def bias_by_distance(distance_bias: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``[Hq, Sq, Sk]``: ``distance_bias[h, i - j]`` for query position ``i`` and key position ``j``; keys after the query
    (hidden by the causal mask) read column 0."""
    distance = (query_positions[:, None] - key_positions[None, :]).clamp(min=0)
    return distance_bias[:, distance]


def last_keys(attend_until: Optional[torch.Tensor], first: int, last: int) -> Optional[torch.Tensor]:
    """The last key position each of the new tokens ``first … last - 1`` sees past its own (``-1``: none), by
    ``attend_until``; None where no token of the chunk sees past itself."""
    if attend_until is None:
        return None
    rows = attend_until[first:last].to(torch.int64)
    return None if bool((rows < 0).all()) else rows


def tree_visibility(tree_mask: Optional[torch.Tensor], first: int, last: int, kv_len: int) -> Optional[torch.Tensor]:
    """``[q_len, kv_len]``: which keys the new tokens ``first … last - 1`` of a sequence with ``kv_len`` keys see
    by their ``tree_mask`` bits (the causal mask applies as well); None for a chunk whose tokens are all causal."""
    if tree_mask is None:
        return None
    rows = tree_mask[first:last].to(torch.int64)
    if bool((rows == -1).all()):
        return None
    q_len = last - first
    bits = (rows[:, None] >> torch.arange(q_len, device=rows.device)[None, :]) & 1  # [q_len, q_len]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=rows.device)
    visible[:, kv_len - q_len :] = (bits == 1) | (rows[:, None] == -1)
    return visible


# The op's arguments, in order, as the reference declares them (its type hints give the op's schema): the one
# declaration of the signature. The fakes, the backends and their supports checks, the rope variant and the
# cache-stage passes bind a call's arguments by name with ``CachedAttentionArgs(*args, **kwargs)``.
SIGNATURE = inspect.signature(cached_attention_reference, eval_str=True)
CachedAttentionArgs = arguments_tuple("CachedAttentionArgs", SIGNATURE)


def cached_attention_fake(*args, **kwargs):
    call = CachedAttentionArgs(*args, **kwargs)
    return call.q.new_empty((*call.q.shape[:-1], call.v.shape[-1]))


def _example_inputs():
    """Two sequences, block size 2: a 3-token prompt and a one-token decode at position 2."""
    q, k, v = torch.ones(1, 4, 4, 8), torch.ones(1, 4, 2, 8), torch.ones(1, 4, 2, 6)
    caches = torch.zeros(5, 2, 2, 8), torch.zeros(5, 2, 2, 6)
    metadata = (
        torch.tensor([0, 3, 4], dtype=torch.int32),
        torch.tensor([3, 3], dtype=torch.int32),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([0, 1, 2, 6]),
        torch.tensor([1, 1, 3, 3], dtype=torch.int32),
    )
    return (q, k, v, *caches, *metadata, 8**-0.5)


cached_attention = register_op(
    "cached_attention",
    cached_attention_reference,
    cached_attention_fake,
    example_inputs=_example_inputs(),
    mutates_args=("k_cache", "v_cache"),
    capturable=False,  # one sequence at a time, from kv_lens read on the host
)


def _triton_backend(*args, **kwargs):
    # Imported on first use: Triton decides at kernel definition whether to interpret (TRITON_INTERPRET).
    # The arguments were checked once, at build, by _triton_supports: the launch skips the checks.
    from .triton.paged_attention import cached_attention_triton

    return cached_attention_triton(*args, **kwargs, check=False)


def _triton_supports(*args, device, **kwargs):
    from .triton import triton_unavailable

    reason = triton_unavailable(device)
    if reason:
        return reason
    from .triton.paged_attention import check_supported  # Triton is usable here: its kernels may be defined

    call = CachedAttentionArgs(*args, **kwargs)
    try:
        check_supported(
            call.q, call.k, call.v, call.k_cache, call.v_cache, call.block_tables, call.sliding_window, call.logit_cap,
            call.sinks, call.alibi_slopes, tree_mask=call.tree_mask, attend_until=call.attend_until,
            distance_bias=call.distance_bias, device=device,
        )
    except ValueError as error:
        return str(error).removeprefix("cached_attention_triton: ")
    return True


register_backend("cached_attention", "triton", _triton_backend, supports=_triton_supports)
