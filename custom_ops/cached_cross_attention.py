"""``torch.ops.autodeploy.cached_cross_attention``: an encoder–decoder model's cross-attention over a paged cache
written once from the encoder's output (notes/encoder_decoder.md, section 2).

A decoder layer's cross-attention keys and values are its ``k_proj`` / ``v_proj`` of the encoder's last hidden
state: the same at every decoding step of a request. The encoder graph computes them once and writes them into a
second, per-request paged pool with ``write_cross_kv``; every later decoder step reads them with
``cached_cross_attention``, which writes nothing. Every query token of a request sees all of its request's encoder
positions (non-causal), whatever the decoder position of the query.

Layout and metadata follow ``cached_attention.py`` (N sequences, T decoder tokens flattened into one row):

- ``q[1, T, Hq, D]``; ``k_cache[num_blocks, block_size, Hkv, D]``, ``v_cache[num_blocks, block_size, Hkv, Dv]``
  in the model's dtype or float8_e4m3fn (values over the layer's ``k_scale`` / ``v_scale``, read back times it).
- ``seq_start[N + 1]`` (int32): sequence ``s`` owns decoder tokens ``seq_start[s] : seq_start[s + 1]``.
- ``cross_lens[N]`` (int32): the encoder length of ``s``: its cross keys sit at positions ``0 … cross_lens[s] - 1``.
- ``block_tables[N, max_blocks]`` (int32): position ``p`` of ``s`` lives in block ``block_tables[s, p // block_size]``
  at offset ``p % block_size`` (the cross pool's table, not the self-attention one).
- ``batch_info`` (int32, on the CPU): ``[num_prefill, num_decode, max_q_len, max_cross_len]``; the last
  ``num_decode`` sequences have exactly one decoder token each.
- ``write_cross_kv``'s ``slot_mapping[S]`` (int64): the flat slot (``block * block_size + offset``) of each encoder
  token, the tokens of all requests of an encoder pass flattened into ``k[1, S, Hkv, D]`` as ``q`` is.

A sequence with no encoder positions (``cross_lens`` 0) gets zeros: the empty weighted sum, which is also what
Hugging Face's eager attention returns for empty ``key_value_states`` (``softmax`` of no logits times no values).
Batch padding (a CUDA graph's spare rows) can therefore name such sequences without producing NaN.

Two backends: ``sdpa`` reads ``seq_start`` and ``cross_lens`` on the host (one call per prompt chunk, the decodes
padded to the longest); ``dense`` reads no device tensor on the host, so decode steps replayed as CUDA graphs hold it
(``select`` prefers it where they do).

Example (two requests with 3 and 2 encoder tokens, block size 2; the first has two decoder tokens, the second one):

>>> import torch
>>> from autodeploy.custom_ops.cached_cross_attention import cached_cross_attention, write_cross_kv
>>> k_cache, v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
>>> encoder_k, encoder_v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
>>> write_cross_kv(encoder_k, encoder_v, k_cache, v_cache, torch.tensor([6, 7, 2, 0, 1]))  # blocks [3, 1] and [0]
>>> out = cached_cross_attention(
...     torch.randn(1, 3, 4, 8), k_cache, v_cache, torch.tensor([0, 2, 3], dtype=torch.int32),
...     torch.tensor([3, 2], dtype=torch.int32), torch.tensor([[3, 1], [0, 0]], dtype=torch.int32),
...     torch.tensor([1, 1, 2, 3], dtype=torch.int32))
>>> out.shape
torch.Size([1, 3, 4, 8])
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from .cached_attention import gather_sequence_kv, read_back, write_kv_cache
from .cached_attention_sdpa import _decode_batch
from .compute_dtype import compute_dtype
from .registry import arguments_tuple, register_backend, register_op


def write_cross_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store the encoder tokens' cross keys and values (``k[1, S, Hkv, D]``, ``v[1, S, Hkv, Dv]``) at their slots
    (``slot_mapping[S]``, int64), in the caches' dtype, divided by the layer's fp8 scales: ``cached_attention``'s
    write, exact (no arithmetic, bar float32 division by a scale other than 1)."""
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def write_cross_kv_fake(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    return None


write_cross_kv = register_op(
    "write_cross_kv",
    write_cross_kv_reference,
    write_cross_kv_fake,
    example_inputs=(torch.ones(1, 3, 2, 8), torch.ones(1, 3, 2, 6), torch.zeros(2, 2, 2, 8), torch.zeros(2, 2, 2, 6),
                    torch.tensor([2, 3, 0])),
    mutates_args=("k_cache", "v_cache"),
)


def cached_cross_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_start: torch.Tensor,
    cross_lens: torch.Tensor,
    block_tables: torch.Tensor,
    batch_info: torch.Tensor,
    scale: Optional[float] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Each decoder token of ``q[1, T, Hq, D]`` attends over all ``cross_lens[s]`` cached encoder keys and values of
    its sequence ``s``: ``softmax(scale · q_i · k_j) · v_j`` with no mask, in float32 (float64 for float64 inputs).

    ``scale`` None is ``D ** -0.5`` (BART's); T5 passes 1.0. GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``.
    ``k_scale`` / ``v_scale``: the layer's fp8 cache scales. A sequence with ``cross_lens`` 0 gets zeros. Returns
    ``[1, T, Hq, Dv]`` in ``q``'s dtype. The oracle: one sequence at a time. Raises ``ValueError`` when ``Hq`` is
    not a multiple of ``Hkv`` or a sequence's table holds fewer positions than its ``cross_lens``.
    """
    q_heads, kv_heads = q.shape[2], k_cache.shape[2]
    if q_heads % kv_heads != 0:
        raise ValueError(f"cached_cross_attention: query heads Hq={q_heads} must be a multiple of kv heads Hkv={kv_heads}.")
    capacity = block_tables.shape[1] * k_cache.shape[1]
    lengths = cross_lens.tolist()
    if any(not 0 <= length <= capacity for length in lengths):
        raise ValueError(f"cached_cross_attention: cross_lens {lengths} must lie in 0 … {capacity}, the positions a "
                         f"block_tables row of {block_tables.shape[1]} blocks of {k_cache.shape[1]} holds.")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    kv_head_of = torch.arange(q_heads, device=q.device) // (q_heads // kv_heads)
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
    starts = seq_start.tolist()
    for s, length in enumerate(lengths):
        first, last = starts[s], starts[s + 1]
        keys, values = gather_sequence_kv(k_cache, v_cache, block_tables[s], length)
        keys, values = read_back(keys, dtype, k_scale)[:, kv_head_of], read_back(values, dtype, v_scale)[:, kv_head_of]
        logits = torch.einsum("ihd,jhd->hij", q[0, first:last].to(dtype), keys) * scale  # [Hq, q_len, length]
        out[0, first:last] = torch.einsum("hij,jhd->ihd", torch.softmax(logits, dim=-1), values).to(q.dtype)
    return out


def cached_cross_attention_fake(q, k_cache, v_cache, *metadata_and_scales, **options):
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))


# The one declaration of the op's signature: the backend and the cache-stage passes bind a call's arguments by
# name with ``CrossAttentionArgs(*args, **kwargs)``.
CrossAttentionArgs = arguments_tuple("CrossAttentionArgs", inspect.signature(cached_cross_attention_reference, eval_str=True))


cached_cross_attention = register_op(
    "cached_cross_attention",
    cached_cross_attention_reference,
    cached_cross_attention_fake,
    # Two sequences, block size 2: 3 encoder positions under 2 decoder tokens, 2 under one decode.
    example_inputs=(torch.ones(1, 3, 4, 8), torch.ones(4, 2, 2, 8), torch.ones(4, 2, 2, 6),
                    *(torch.tensor(values, dtype=torch.int32) for values in ([0, 2, 3], [3, 2], [[3, 1], [0, 0]], [1, 1, 2, 3]))),
    capturable=False,  # one sequence at a time, from cross_lens read on the host
)


def cached_cross_attention_sdpa(*args, **kwargs) -> torch.Tensor:
    """Same arguments (``CrossAttentionArgs``) and result as ``cached_cross_attention_reference``, through PyTorch's
    ``scaled_dot_product_attention`` in ``q``'s dtype: one call per sequence of several decoder tokens, over its
    gathered keys with no mask; the decodes as one call over their keys padded to the longest."""
    call = CrossAttentionArgs(*args, **kwargs)
    q, k_cache, v_cache = call.q, call.k_cache, call.v_cache
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    num_prefill, num_decode = call.batch_info.tolist()[:2]
    starts, lengths = call.seq_start.tolist(), call.cross_lens.tolist()
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
    for s in range(num_prefill):
        first, last = starts[s], starts[s + 1]
        if lengths[s] == 0:  # zeroed below
            continue
        keys, values = gather_sequence_kv(k_cache, v_cache, call.block_tables[s], lengths[s])
        keys, values = read_back(keys, q.dtype, call.k_scale), read_back(values, q.dtype, call.v_scale)
        attended = F.scaled_dot_product_attention(
            q[0, first:last].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=scale, enable_gqa=True
        )
        out[0, first:last] = attended.transpose(0, 1)
    decode_lengths = lengths[num_prefill:]
    if num_decode and max(decode_lengths) > 0:
        # A decode's one query at the last of its cross_lens positions sees exactly its encoder keys, so the
        # self-attention decode batch (keys past each length masked) is this op's too.
        first = starts[num_prefill]
        out[0, first : first + num_decode] = _decode_batch(
            q[0, first : first + num_decode], k_cache, v_cache, call.block_tables[num_prefill:], decode_lengths,
            scale, None, None, call.k_scale, call.v_scale,
        )
    if 0 in lengths:  # rows with no key: zeros by the op's contract, whatever a fused kernel makes of a masked row
        empty = torch.repeat_interleave(call.cross_lens == 0, call.seq_start.diff(), output_size=q.shape[1])
        out[0, empty] = 0
    return out


# It reads seq_start and cross_lens on the host: no CUDA graph can hold it.
register_backend("cached_cross_attention", "sdpa", cached_cross_attention_sdpa, capturable=False)


def cached_cross_attention_dense(*args, **kwargs) -> torch.Tensor:
    """Same arguments (``CrossAttentionArgs``) and result as ``cached_cross_attention_reference``, with no read of a
    device tensor on the host, so a CUDA graph can hold it: every sequence's whole ``block_tables`` row is gathered
    (``[N, max_blocks · block_size, Hkv, D]``), the positions from its ``cross_lens`` on masked on the device, and one
    batched SDPA call in ``q``'s dtype attends every sequence's queries over them.

    A decode step (one query a sequence: ``T == N``, a shape, not a value) is that call as it stands. Otherwise the
    queries are laid out ``[N, max_q_len]`` (``batch_info``'s, read on the CPU where it lives) from ``seq_start`` and
    gathered back per token. The table's whole width is read, not the longest sequence's: a captured graph's tables
    are as wide as ``max_seq_len`` allows, whatever the batch holds."""
    call = CrossAttentionArgs(*args, **kwargs)
    q, k_cache, v_cache, cross_lens = call.q, call.k_cache, call.v_cache, call.cross_lens
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    num_sequences, tokens = call.block_tables.shape[0], q.shape[1]
    positions = call.block_tables.shape[1] * k_cache.shape[1]
    visible = torch.arange(positions, device=q.device) < cross_lens[:, None]  # [N, L]
    hidden = ~visible[:, :, None, None]
    # Past a sequence's length the table names any block (padding, stale entries): zeroed, as a weight of 0 times an
    # inf there would be NaN. In place: the gather is a copy of its own, and at a graph's batch and width a large one.
    keys, values = (
        read_back(cache.index_select(0, call.block_tables.flatten()).view(num_sequences, positions, *cache.shape[2:]),
                  q.dtype, cache_scale).masked_fill_(hidden, 0).transpose(1, 2)
        for cache, cache_scale in ((k_cache, call.k_scale), (v_cache, call.v_scale))
    )  # [N, Hkv, L, D]
    decode = tokens == num_sequences
    if decode:
        queries = q[0, :, :, None]  # [N, Hq, 1, D]
    else:
        first = call.seq_start[:-1].long()
        rows = (first[:, None] + torch.arange(int(call.batch_info[2]), device=q.device)).clamp(max=tokens - 1)
        queries = q[0][rows].transpose(1, 2)  # [N, Hq, max_q_len, D]; rows past a sequence's end are dropped below
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible[:, None, None, :], scale=scale,
                                              enable_gqa=True)
    # A sequence with no key: zeros by the op's contract, whatever a fused kernel makes of a row masked whole.
    attended = attended.masked_fill((cross_lens == 0)[:, None, None, None], 0).transpose(1, 2)  # [N, q rows, Hq, Dv]
    if decode:
        return attended.reshape(1, tokens, *attended.shape[2:])
    owner = torch.repeat_interleave(torch.arange(num_sequences, device=q.device), call.seq_start.diff(), output_size=tokens)
    return attended[owner, torch.arange(tokens, device=q.device) - call.seq_start[owner]][None]


def _dense_supports(*args, device, **kwargs):
    call = CrossAttentionArgs(*args, **kwargs)
    q_heads, kv_heads = call.q.shape[2], call.k_cache.shape[2]
    if q_heads % kv_heads:
        return f"query heads Hq={q_heads} must be a multiple of kv heads Hkv={kv_heads}"
    return True




def cached_cross_attention_triton(*args, **kwargs) -> torch.Tensor:
    """Same arguments (``CrossAttentionArgs``) and result as ``cached_cross_attention_reference``. A step of decodes
    alone (``batch_info``: no prefill; what a CUDA graph replays) goes through the paged Triton decode kernel of
    ``cached_attention`` (``attend_over_cache``), reading each sequence's cross blocks in place: one query token at the
    end of a row of ``cross_lens`` keys sees every one of them, which is cross-attention. Where ``dense`` reads every
    sequence's whole table, this reads its own encoder positions only. Sequences with no encoder position (a graph's
    spare rows) are given one, read from whatever their table names, and their rows are then zeroed, as the op's
    contract says. Steps with prefill chunks go to ``dense``."""
    call = CrossAttentionArgs(*args, **kwargs)
    if int(call.batch_info[0]) > 0:
        return cached_cross_attention_dense(*args, **kwargs)
    from .triton.paged_attention import attend_over_cache

    q = call.q
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    batch_info = call.batch_info.clone()
    batch_info[3] = max(int(batch_info[3]), 1)
    out = attend_over_cache(q[0], call.k_cache, call.v_cache, call.seq_start, call.cross_lens.clamp(min=1),
                            call.block_tables, batch_info, scale, k_scale=call.k_scale, v_scale=call.v_scale)
    return out.masked_fill_((call.cross_lens == 0)[None, :, None, None], 0)


def _triton_supports(*args, device, **kwargs):
    from .triton import triton_unavailable

    reason = triton_unavailable(device)
    if reason:
        return reason
    from .triton.paged_attention import check_supported

    call = CrossAttentionArgs(*args, **kwargs)
    reason = _dense_supports(*args, device=device, **kwargs)  # its prefill steps
    if reason is not True:
        return reason
    try:
        check_supported(call.q, call.k_cache[:1, :1], call.v_cache[:1, :1], call.k_cache, call.v_cache, call.block_tables, None, None,
                        None, None, device=device)
    except ValueError as error:
        return str(error).removeprefix("cached_attention_triton: ")
    return True


# Both read no device tensor on the host (batch_info lives on the CPU): decode steps replay them in CUDA graphs. Triton
# first, so that a GPU deploy that captures picks it; dense wherever Triton cannot run.
register_backend("cached_cross_attention", "triton", cached_cross_attention_triton, supports=_triton_supports)
register_backend("cached_cross_attention", "dense", cached_cross_attention_dense, supports=_dense_supports)
