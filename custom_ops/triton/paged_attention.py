"""Triton backend of ``cached_attention``: paged-KV attention over a mixed prefill/decode batch.

The cache layout and metadata are those of ``cached_attention.py``; the results are its reference's.
A small kernel first writes the new tokens' keys and values into their slots, both caches in one
launch. Then two attention kernels, one per kind of sequence, read keys and values token by token
through ``block_tables`` (so a tile need not line up with cache blocks) and run the softmax in
float32, base 2 (``exp2``):

- **Prefill**: flash attention with an online softmax. A program owns ``BLOCK_M`` query tokens of one
  prompt chunk and one query head. Where each chunk starts lives on the device (``seq_start``), so
  instead of syncing to map programs to sequences, the grid is ``query heads × ceil(max_q_len / BLOCK_M)
  × num_prefill``, and a program whose query block lies past its chunk's end returns at once. Query
  ``j`` of a chunk sits at absolute position ``kv_len - q_len + j``, so a chunk that follows a cached
  prefix (chunked prefill, prefix-cache hit) needs nothing special. Key tiles wholly outside the causal
  and window bounds are never visited, and only the tiles that straddle a bound pay for the mask. A tree
  verification chunk (``tree_mask``, ``HAS_TREE``) also masks the tiles that hold its own keys, by each
  row's bits; graphs without trees compile none of it. A bidirectional block's rows (``attend_until``,
  ``HAS_ATTEND_UNTIL``: Gemma 3's images) see keys up to ``max(own position, attend_until)``, so a query
  block's tiles reach its rows' furthest last key; graphs without such blocks compile none of it.
- **Decode**: one query per sequence, so one program per (sequence, kv head) would leave most of the
  GPU idle for a small batch over long contexts. Split-K cuts each sequence's visible keys into
  ``num_splits`` contiguous ranges, one program each: enough for about two programs per
  multiprocessor, and none over 2048 keys (the host knows only the longest sequence; a few long ones
  among many short ones must not run alone). A program takes all query heads of its kv head (GQA), so
  each K/V tile is loaded once for the group. Splits write partial (max, sum, unnormalised output) to
  a workspace and count their arrival on a per-(sequence, kv head) counter; the last to arrive merges
  them with a log-sum-exp (sinks join the denominator there, once), so no second kernel is launched. A
  sequence whose keys fit one split finishes the softmax itself. A decode's last key is its own position,
  the sequence's newest (``attend_until`` never names a later one), so this kernel reads no
  ``attend_until``. For ``cached_attention_rope`` (``paged_attention_rope.py``), a batch of decodes alone
  needs no write kernel: the decode kernel rotates q and the new key and writes the caches itself
  (``HAS_ROPE``).

Both kernels add a relative position bias by distance (``distance_bias``, ``HAS_DISTANCE_BIAS``: T5's decoder), this
head's ``distance_bias[h, q_pos - k_pos]``, to each tile's scaled logits before the soft-cap and the running max, as
the reference does; a split's partial results carry it, so the merge needs nothing more. Graphs without the bias
compile none of it.

Example (a 3-token prompt, then a one-token decode at position 2; on a CPU, Triton's interpreter runs
it too, as ``tests/custom_ops/test_paged_attention_triton.py`` does)::

    import torch
    from autodeploy.custom_ops.triton.paged_attention import cached_attention_triton

    cuda = dict(device="cuda")
    q, k, v = torch.randn(1, 4, 4, 16, **cuda), torch.randn(1, 4, 2, 16, **cuda), torch.randn(1, 4, 2, 16, **cuda)
    k_cache, v_cache = torch.zeros(4, 8, 2, 16, **cuda), torch.zeros(4, 8, 2, 16, **cuda)
    seq_start = torch.tensor([0, 3, 4], dtype=torch.int32, **cuda)
    kv_lens = torch.tensor([3, 3], dtype=torch.int32, **cuda)
    block_tables = torch.tensor([[2], [0]], dtype=torch.int32, **cuda)
    slot_mapping = torch.tensor([16, 17, 18, 2], **cuda)
    batch_info = torch.tensor([1, 1, 3, 3], dtype=torch.int32)  # stays on the CPU
    out = cached_attention_triton(q, k, v, k_cache, v_cache, seq_start, kv_lens, block_tables,
                                  slot_mapping, batch_info, 16**-0.5)  # [1, 4, 4, 16]
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import triton
import triton.language as tl

from . import INTERPRETED, SUPPORTED_DTYPES
from .cache_store import stored_as
from .launch import arrival_counters, dependent_launch, wait_for_previous_kernel
from .rope import load_angles, rotate_rows

from ..attention import check_alibi_slopes

MAX_HEAD_DIM = 256


# A split must cover enough keys that its fixed cost (loading the queries, writing and merging a
# partial result) stays small next to its loop.
_MIN_KEYS_PER_SPLIT = 256
# Past this many keys a split is cut even when the grid is already full: the host knows only the longest
# sequence (kv_lens is on the device), and a few long sequences among many short ones would otherwise run
# alone at the end. A partial result costs well under 1% of the bytes of 2048 keys.
_MAX_KEYS_PER_SPLIT = 2048
_MAX_SPLITS = 64
# Whether the grid's last splits are launched first, so that those a short sequence leaves empty end
# before its working programs start (blocks are handed out in grid order, though CUDA does not promise
# it). None: for the one-wave launch only. At 32 decodes of ~200 keys (graph-sized grid, 768 of 1,024
# programs empty; scripts/time_decode_attention.py on an H200) its 128-key tiles took 9.14 µs with the
# empty splits first against over 10.06 last; the 64-key launch, 13.84 against 11.38, and the same at
# 1 and 256 decodes (5.31 / 5.25, 56.27 / 56.53).
_EMPTY_SPLITS_FIRST: bool | None = None
# An fp8 cache read by bfloat16 queries: both dots in float16 (see _in_float16); False keeps bfloat16.
FP8_IN_F16 = True
_MERGE_TILE = 4096  # elements of the merge's partial-results tile: 32 a thread at 4 warps

# Triton compiles a kernel once per value class of each integer argument (1, a multiple of 16, other).
# Arguments that follow the batch (the block table's width, the first decode's index, split sizes, query
# blocks) are exempt (do_not_specialize): otherwise the first step of each new class would stall for a
# compile (~1 s each, measured on the H200) in the middle of serving.
_LOG2E = tl.constexpr(1.4426950408889634)
# Stands for "no logit yet" in the running max: unlike -inf, subtracting it from itself gives 0, not NaN,
# so a row whose first tiles are all masked (sliding window) needs no special case.
_NO_LOGIT = tl.constexpr(-1.0e30)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_multiplier, v_multiplier,
    stride_new_kt, stride_new_kh, stride_new_vt, stride_new_vh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """One program per new token: its keys and values, all kv heads, to its slot in each cache (times the
    multipliers: 1 / the layer's fp8 scales, 1 for other caches)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    value_dims = tl.arange(0, DV_PAD)[None, :]
    key_mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    value_mask = (heads < KV_HEADS) & (value_dims < VALUE_DIM)
    k = tl.load(k_ptr + token * stride_new_kt + heads * stride_new_kh + dims, mask=key_mask)
    v = tl.load(v_ptr + token * stride_new_vt + heads * stride_new_vh + value_dims, mask=value_mask)
    k_slot = k_cache_ptr + block * stride_kb + offset * stride_kt
    v_slot = v_cache_ptr + block * stride_vb + offset * stride_vt
    tl.store(k_slot + heads * stride_kh + dims, stored_as(k * k_multiplier, k_cache_ptr), mask=key_mask)
    tl.store(v_slot + heads * stride_vh + value_dims, stored_as(v * v_multiplier, v_cache_ptr), mask=value_mask)


@triton.jit
def _logits_base2(q, k, scale, logit_cap, HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr, bias=None,
                  HAS_BIAS: tl.constexpr = False):
    """``scale · q kᵀ`` plus ``bias`` (with ``HAS_BIAS``), soft-capped if asked, in base-2 units (× log2 e) for
    ``exp2``."""
    logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if HAS_BIAS:  # before the cap, as the reference adds it
        logits += bias
    if HAS_CAP:
        # cap · tanh(x / cap) through exp2: Triton has no tanh that both the GPU and the interpreter run.
        doubled = tl.exp2(logits * (2.0 * _LOG2E / logit_cap))
        logits = logit_cap * (1.0 - 2.0 / (doubled + 1.0))
    return logits * _LOG2E


@triton.jit
def _distance_bias(bias_rows, query_positions, keys, valid):
    """``distance_bias[h, i - j]`` (``[ROWS, BLOCK_N]``, float32) for query positions ``query_positions [ROWS]`` and key
    positions ``keys [BLOCK_N]``, ``bias_rows`` pointing at each row's head's table row (a scalar or ``[ROWS, 1]``); 0
    for keys after their query and where ``valid`` is false (keys past the sequence, rows past the chunk), whose
    distances may lie outside the table."""
    distance = query_positions[:, None] - keys[None, :]
    return tl.load(bias_rows + distance, mask=valid & (distance >= 0), other=0.0).to(tl.float32)


@triton.jit
def _gather_kv(
    k_base, v_base, block_table_row, keys, key_valid,
    stride_kb, stride_kt, stride_vb, stride_vt,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Keys ``[BLOCK_N, D_PAD]`` and values ``[BLOCK_N, DV_PAD]`` at absolute positions ``keys``; zeros
    where ``key_valid`` is false, so slots past the sequence (never written, maybe NaN) are never read."""
    blocks = tl.load(block_table_row + keys // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
    offsets = keys % PAGE_SIZE
    dims = tl.arange(0, D_PAD)
    value_dims = tl.arange(0, DV_PAD)
    k = tl.load(
        k_base + blocks[:, None] * stride_kb + offsets[:, None] * stride_kt + dims[None, :],
        mask=key_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    v = tl.load(
        v_base + blocks[:, None] * stride_vb + offsets[:, None] * stride_vt + value_dims[None, :],
        mask=key_valid[:, None] & (value_dims[None, :] < VALUE_DIM),
        other=0.0,
    )
    return k, v


@triton.jit
def _in_float16(q):
    """bfloat16 queries as float16, for the dots over an fp8 cache (``FP8_IN_F16``): Hopper converts e4m3
    pairs to float16 in one instruction, to bfloat16 only through float32, and the cache's tiles are
    converted to the queries' dtype. bfloat16 queries are exact in float16 from 6e-5 to 65,504; past that
    they saturate (a logit that large already swamps the softmax)."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _online_softmax_step(acc, row_sum, row_max, logits, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 ``logits [ROWS, BLOCK_N]`` and its values into the running state."""
    new_max = tl.maximum(row_max, tl.max(logits, 1))
    rescale = tl.exp2(row_max - new_max)
    probs = tl.exp2(logits - new_max[:, None])
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def _prefill_tiles(
    acc, row_sum, row_max, q, query_positions, row_last_keys,
    k_base, v_base, block_table_row, stride_kb, stride_kt, stride_vb, stride_vt,
    first_tile, end_tile, kv_len, scale, logit_cap, window, slope, tree_rows, chunk_start, bias_row,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_DISTANCE_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attend over key tiles ``first_tile … end_tile - 1``; ``MASKED`` tiles apply the causal/window mask (row
    ``i`` sees keys up to ``row_last_keys[i]``: its own position, or its bidirectional block's end; the window
    counts back from ``query_positions``), and with ``HAS_TREE`` the rows' ``tree_mask`` bits (``tree_rows
    [BLOCK_M]``) over the chunk's keys (from position ``chunk_start``). ALiBi (``slope``, this head's) and the
    relative position bias (``bias_row``: this head's row of ``distance_bias``) bias every tile, masked or not."""
    for tile in range(first_tile, end_tile):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = _gather_kv(
            k_base, v_base, block_table_row, keys, keys < kv_len, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, PAGE_SIZE,
        )
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache's values, read back
        bias = None
        if HAS_DISTANCE_BIAS:  # rows past the chunk's end sit at kv_len and beyond
            bias = _distance_bias(bias_row, query_positions, keys, query_positions[:, None] < kv_len)
        logits = _logits_base2(q, k, scale, logit_cap, HAS_CAP, DOT_PRECISION, bias, HAS_DISTANCE_BIAS)
        if HAS_ALIBI:
            logits += slope * (keys[None, :] - query_positions[:, None]).to(tl.float32) * _LOG2E
        if MASKED:
            visible = keys[None, :] <= row_last_keys[:, None]
            if HAS_WINDOW:
                visible &= keys[None, :] > query_positions[:, None] - window
            if HAS_TREE:
                # Chunk key j is seen iff the row's bit j is set (-1: every bit). Keys past the 63rd belong to
                # longer chunks, all rows -1 (bit 63 set): the shift stops at 63, inside an int64.
                in_chunk = keys - chunk_start
                bits = tree_rows[:, None] >> tl.minimum(tl.maximum(in_chunk, 0), 63).to(tl.int64)[None, :]
                visible &= (in_chunk[None, :] < 0) | ((bits & 1) != 0)
            logits = tl.where(visible, logits, float("-inf"))
        acc, row_sum, row_max = _online_softmax_step(acc, row_sum, row_max, logits, v, DOT_PRECISION)
    return acc, row_sum, row_max


@triton.jit(do_not_specialize=["num_query_blocks", "stride_bt"])  # batch-dependent: see the note on integer arguments above
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_start_ptr, kv_lens_ptr, block_tables_ptr, sinks_ptr, alibi_ptr,
    tree_mask_ptr, attend_until_ptr, distance_bias_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_bias_h,
    scale, logit_cap, window, num_query_blocks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_ATTEND_UNTIL: tl.constexpr, HAS_DISTANCE_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_IN_F16: tl.constexpr,
):
    head = tl.program_id(0)
    # A chunk's last query blocks see the most keys; launching them first shortens the tail.
    query_block = num_query_blocks - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(seq_start_ptr + seq)
    q_len = tl.load(seq_start_ptr + seq + 1) - q_start
    if query_block * BLOCK_M >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    chunk_start = kv_len - q_len  # the absolute position of the chunk's first token

    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    query_positions = chunk_start + rows
    tokens = (q_start + rows).to(tl.int64)
    dims = tl.arange(0, D_PAD)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    if FP8_IN_F16:
        q = _in_float16(q)
    tree_rows = -1
    if HAS_TREE:  # the rows' bitmasks over the chunk's keys, read once for all tiles
        tree_rows = tl.load(tree_mask_ptr + tokens, mask=row_valid, other=-1)

    # Key tiles first_tile … end_tile - 1 are visible to some row of this block; of them, free_first …
    # free_end - 1 are visible to every row and skip the mask.
    first_position = chunk_start + query_block * BLOCK_M
    last_position = tl.minimum(first_position + BLOCK_M, kv_len) - 1
    # Each row's last visible key; of them, the furthest bounds the tiles visited and the nearest the free ones.
    row_last_keys = query_positions
    last_key = last_position
    free_key = first_position
    if HAS_ATTEND_UNTIL:  # a bidirectional block's rows see on to its end, read once for all tiles
        row_last_keys = tl.maximum(query_positions, tl.load(attend_until_ptr + tokens, mask=row_valid, other=-1))
        # Rows past the chunk's end sit at kv_len and beyond: the clamp drops them from the furthest, and the
        # nearest is a valid row's (row 0 of the block is one).
        last_key = tl.minimum(tl.max(row_last_keys), kv_len - 1)
        free_key = tl.min(row_last_keys)
    first_tile = 0
    free_first = 0
    if HAS_WINDOW:
        first_tile = tl.maximum(first_position - window + 1, 0) // BLOCK_N
        free_first = tl.cdiv(tl.maximum(last_position - window + 1, 0), BLOCK_N)
    end_tile = tl.cdiv(last_key + 1, BLOCK_N)
    free_end = tl.minimum((free_key + 1) // BLOCK_N, end_tile)
    if HAS_TREE:  # only a chunk of ≤ 63 tokens may have tree rows: the tiles holding its keys take the mask
        free_end = tl.where(q_len <= 63, tl.minimum(free_end, chunk_start // BLOCK_N), free_end)
    free_end = tl.maximum(free_end, first_tile)
    free_first = tl.minimum(tl.maximum(free_first, first_tile), free_end)

    kv_head = head // GROUP
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    block_table_row = block_tables_ptr + seq * stride_bt

    if HAS_SINKS:  # the sink is a logit with no value: start the softmax from it
        row_max = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        row_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        row_max = tl.full([BLOCK_M], _NO_LOGIT, tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + head)
    bias_row = distance_bias_ptr
    if HAS_DISTANCE_BIAS:
        bias_row += head * stride_bias_h

    acc, row_sum, row_max = _prefill_tiles(
        acc, row_sum, row_max, q, query_positions, row_last_keys, k_base, v_base, block_table_row,
        stride_kb, stride_kt, stride_vb, stride_vt, first_tile, free_first, kv_len, scale, logit_cap, window, slope,
        tree_rows, chunk_start, bias_row, True, HAS_WINDOW, HAS_CAP, HAS_ALIBI, HAS_TREE, HAS_DISTANCE_BIAS,
        HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
    )
    acc, row_sum, row_max = _prefill_tiles(
        acc, row_sum, row_max, q, query_positions, row_last_keys, k_base, v_base, block_table_row,
        stride_kb, stride_kt, stride_vb, stride_vt, free_first, free_end, kv_len, scale, logit_cap, window, slope,
        tree_rows, chunk_start, bias_row, False, HAS_WINDOW, HAS_CAP, HAS_ALIBI, HAS_TREE, HAS_DISTANCE_BIAS,
        HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
    )
    acc, row_sum, row_max = _prefill_tiles(
        acc, row_sum, row_max, q, query_positions, row_last_keys, k_base, v_base, block_table_row,
        stride_kb, stride_kt, stride_vb, stride_vt, free_end, end_tile, kv_len, scale, logit_cap, window, slope,
        tree_rows, chunk_start, bias_row, True, HAS_WINDOW, HAS_CAP, HAS_ALIBI, HAS_TREE, HAS_DISTANCE_BIAS,
        HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
    )

    # Rows past the chunk's end may see no key at all (under a window); they are not stored.
    row_sum = tl.where(row_valid, row_sum, 1.0)
    value_dims = tl.arange(0, DV_PAD)
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + value_dims[None, :],
        (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (value_dims[None, :] < VALUE_DIM),
    )


@triton.jit
def _split_keys(kv_len, window, num_splits, spread_splits, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                MAX_KEYS_PER_SPLIT: tl.constexpr):
    """(first visible key, keys per split, splits used) for a query at ``kv_len - 1``.

    Splits divide the keys the query may see (a window leaves none idle), in whole tiles. A sequence
    spreads its keys over ``spread_splits`` (what fills the card at this batch), and over more of the
    grid's ``num_splits`` only past ``MAX_KEYS_PER_SPLIT`` keys a split: the grid is sized for the longest
    sequence (a CUDA graph's for the longest possible), and a short sequence cut into one-tile splits
    would only add programs (each holding its pipeline's shared memory) and partial results to merge."""
    visible_first = 0
    if HAS_WINDOW:
        visible_first = tl.maximum(kv_len - window, 0)
    visible = kv_len - visible_first
    keys = tl.maximum(tl.cdiv(visible, num_splits), tl.minimum(tl.cdiv(visible, spread_splits), MAX_KEYS_PER_SPLIT))
    keys_per_split = tl.cdiv(keys, BLOCK_N) * BLOCK_N
    return visible_first, keys_per_split, tl.cdiv(visible, keys_per_split)


@triton.jit(do_not_specialize=["first_decode", "stride_bt", "spread_splits"])  # batch-dependent: see the note on integer arguments above
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partials_ptr, arrivals_ptr,
    seq_start_ptr, kv_lens_ptr, block_tables_ptr, sinks_ptr, alibi_ptr, distance_bias_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_bias_h,
    scale, logit_cap, window, first_decode, q_heads, spread_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr, MERGE_GROUP_PAD: tl.constexpr,
    MERGE_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DISTANCE_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_IN_F16: tl.constexpr, MAX_KEYS_PER_SPLIT: tl.constexpr,
    EMPTY_SPLITS_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
    # The new tokens, unrotated, and their angles, for cached_attention_rope's decode-only batches (HAS_ROPE;
    # the rope/write kernel's arguments of the same names). Without HAS_ROPE they stay None: not compiled in.
    new_q_ptr=None, new_k_ptr=None, new_v_ptr=None, cos_ptr=None, sin_ptr=None, slot_mapping_ptr=None,
    k_multiplier=None, v_multiplier=None, stride_new_qt=None, stride_new_qh=None, stride_new_kt=None,
    stride_new_kh=None, stride_new_vt=None, stride_new_vh=None, stride_cos_t=None, stride_sin_t=None,
    ROTARY_HALF: tl.constexpr = None, PAIRS_PAD: tl.constexpr = None, PASS_PAD: tl.constexpr = None,
    INTERLEAVED: tl.constexpr = None, HAS_ROPE: tl.constexpr = False,
):
    decode = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_splits = tl.num_programs(2)
    # Blocks are handed out in grid order, z last: with the last splits first, the splits a short
    # sequence leaves empty end at once, while the kernel ahead still runs (see the early exit below).
    split = num_splits - 1 - tl.program_id(2) if EMPTY_SPLITS_FIRST else tl.program_id(2)
    seq = first_decode + decode
    kv_len = tl.load(kv_lens_ptr + seq)
    visible_first, keys_per_split, used_splits = _split_keys(
        kv_len, window, num_splits, spread_splits, HAS_WINDOW, BLOCK_N, MAX_KEYS_PER_SPLIT
    )
    if split >= used_splits:
        # The grid has splits for the longest sequence a captured graph may see; a split with no keys
        # ends here, before it waits for the kernel ahead (kv_lens is a step input the host wrote, which
        # no kernel of the step writes), so it holds a program slot for one load instead of the whole
        # wait (at 32 decodes of ~200 keys, 768 of 1,024 programs: 13.8 µs against 10.5 without them).
        return
    wait_for_previous_kernel(USE_PDL)
    token = tl.load(seq_start_ptr + seq).to(tl.int64)
    split_first = visible_first + split * keys_per_split
    split_end = tl.minimum(split_first + keys_per_split, kv_len)

    group_rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group_rows
    head_valid = group_rows < GROUP
    if HAS_ROPE:
        # No rope/write kernel ran ahead: rotate this kv head's query heads into the q buffer, as it would.
        # Every split of this (sequence, kv head) writes these rows with the same bits, so it does not
        # matter whose write lands last.
        cos_first, cos_second, sin_first, sin_second = load_angles(
            cos_ptr + token * stride_cos_t, sin_ptr + token * stride_sin_t, ROTARY_HALF, PAIRS_PAD, INTERLEAVED
        )
        rotate_rows(
            new_q_ptr + token * stride_new_qt + heads[:, None] * stride_new_qh,
            q_ptr + token * stride_qt + heads[:, None] * stride_qh, head_valid[:, None],
            cos_first, cos_second, sin_first, sin_second, 1.0,
            GROUP_PAD, HEAD_DIM, ROTARY_HALF, PAIRS_PAD, PASS_PAD, INTERLEAVED,
        )
        if split == used_splits - 1:
            # This split holds the newest key (position kv_len - 1), and no other program reads its slot
            # this step: it rotates the key into the slot and copies the value beside it.
            slot = tl.load(slot_mapping_ptr + token)
            block = slot // PAGE_SIZE
            offset = slot % PAGE_SIZE
            one_row = tl.zeros([1, 1], dtype=tl.int64)
            rotate_rows(
                new_k_ptr + token * stride_new_kt + kv_head * stride_new_kh + one_row,
                k_cache_ptr + block * stride_kb + offset * stride_kt + kv_head * stride_kh + one_row, one_row == 0,
                cos_first, cos_second, sin_first, sin_second, k_multiplier,
                1, HEAD_DIM, ROTARY_HALF, PAIRS_PAD, PASS_PAD, INTERLEAVED,
            )
            new_value_dims = tl.arange(0, DV_PAD)
            new_value_valid = new_value_dims < VALUE_DIM
            new_v = tl.load(
                new_v_ptr + token * stride_new_vt + kv_head * stride_new_vh + new_value_dims, mask=new_value_valid
            )
            tl.store(
                v_cache_ptr + block * stride_vb + offset * stride_vt + kv_head * stride_vh + new_value_dims,
                stored_as(new_v * v_multiplier, v_cache_ptr), mask=new_value_valid,
            )
        # The loads below read what other threads of this program just wrote (q; the new key and value in
        # the last tile): a CTA barrier makes the block's global writes visible to all its threads.
        tl.debug_barrier()
    dims = tl.arange(0, D_PAD)
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    if FP8_IN_F16:
        q = _in_float16(q)
    row_max = tl.full([GROUP_PAD], _NO_LOGIT, tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    if HAS_SINKS:  # a sequence in one split adds its sink here; over several, the merge adds it once
        sink = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0).to(tl.float32) * _LOG2E
        row_max = tl.where(used_splits == 1, sink, row_max)
        row_sum = tl.where(used_splits == 1, 1.0, row_sum)
    acc = tl.zeros([GROUP_PAD, DV_PAD], tl.float32)
    slopes = tl.zeros([GROUP_PAD], tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=head_valid, other=0.0)
    bias_rows = distance_bias_ptr
    if HAS_DISTANCE_BIAS:
        bias_rows += heads[:, None] * stride_bias_h

    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    block_table_row = block_tables_ptr + seq * stride_bt
    for tile_first in range(split_first, split_end, BLOCK_N):
        keys = tile_first + tl.arange(0, BLOCK_N)
        key_valid = keys < split_end
        k, v = _gather_kv(
            k_base, v_base, block_table_row, keys, key_valid, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, VALUE_DIM, D_PAD, DV_PAD, PAGE_SIZE,
        )
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache's values, read back
        bias = None
        if HAS_DISTANCE_BIAS:  # the query sits at kv_len - 1
            query_positions = tl.zeros([GROUP_PAD], tl.int32) + kv_len - 1
            bias = _distance_bias(bias_rows, query_positions, keys, head_valid[:, None] & key_valid[None, :])
        logits = _logits_base2(q, k, scale, logit_cap, HAS_CAP, DOT_PRECISION, bias, HAS_DISTANCE_BIAS)
        if HAS_ALIBI:  # the query sits at kv_len - 1
            logits += slopes[:, None] * (keys - (kv_len - 1))[None, :].to(tl.float32) * _LOG2E
        logits = tl.where(key_valid[None, :], logits, float("-inf"))
        acc, row_sum, row_max = _online_softmax_step(acc, row_sum, row_max, logits, v, DOT_PRECISION)

    value_dims = tl.arange(0, DV_PAD)
    value_mask = head_valid[:, None] & (value_dims[None, :] < VALUE_DIM)
    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + value_dims[None, :]
    if SINGLE_SPLIT:  # no workspace: partials_ptr is None
        tl.store(out_ptrs, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=value_mask)
    elif used_splits == 1:  # the merge leaves this sequence alone
        tl.store(out_ptrs, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=value_mask)
    else:
        # A workspace row per (decode, query head, split): [max, sum, acc…]; the merge reads the used ones.
        partials = partials_ptr + ((decode * q_heads + heads) * num_splits + split) * (VALUE_DIM + 2)
        tl.store(partials, row_max, mask=head_valid)
        tl.store(partials + 1, row_sum, mask=head_valid)
        tl.store(partials[:, None] + 2 + value_dims[None, :], acc, mask=value_mask)
        # The last split of this (sequence, kv head) to arrive merges them all: no second kernel to
        # launch. The barrier makes every thread's stores precede the release of the counter, and the
        # merger resets the counter for the next launch (a replayed graph's included).
        tl.debug_barrier()
        arrival = arrivals_ptr + decode * tl.num_programs(1) + kv_head
        if tl.atomic_add(arrival, 1, sem="acq_rel") == used_splits - 1:
            _merge_splits(
                partials_ptr, out_ptr, sinks_ptr, token, stride_ot, stride_oh, q_heads, num_splits, used_splits,
                decode, kv_head, GROUP, MERGE_GROUP_PAD, VALUE_DIM, DV_PAD, SPLITS_PAD, MERGE_SPLITS, HAS_SINKS,
            )
            tl.atomic_xchg(arrival, 0, sem="relaxed")


@triton.jit
def _merge_splits(
    partials_ptr, out_ptr, sinks_ptr, token, stride_ot, stride_oh, q_heads, num_splits, used_splits, decode,
    kv_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, VALUE_DIM: tl.constexpr, DV_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr, MERGE_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Combine the partial results of ``used_splits`` splits with a log-sum-exp into the output rows of
    one kv head's query heads. All heads at once (``GROUP_PAD`` rows: no ``tl.dot`` here, so no padding
    to 16) and ``MERGE_SPLITS`` splits a step, so the dependent loads are few. The partials were written
    by other programs: loads go through L2 (``.cg``), not L1."""
    group_rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group_rows
    head_valid = group_rows < GROUP
    rows = (decode * q_heads + heads) * num_splits
    splits = tl.arange(0, SPLITS_PAD)
    stats = partials_ptr + (rows[:, None] + splits[None, :]) * (VALUE_DIM + 2)
    stats_valid = head_valid[:, None] & (splits[None, :] < used_splits)
    split_max = tl.load(stats, mask=stats_valid, other=_NO_LOGIT, cache_modifier=".cg")
    split_sum = tl.load(stats + 1, mask=stats_valid, other=0.0, cache_modifier=".cg")
    overall_max = tl.max(split_max, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0).to(tl.float32) * _LOG2E
        overall_max = tl.maximum(overall_max, sink)
    total = tl.sum(split_sum * tl.exp2(split_max - overall_max[:, None]), 1)
    if HAS_SINKS:
        total += tl.exp2(sink - overall_max)

    value_dims = tl.arange(0, DV_PAD)
    value_valid = value_dims < VALUE_DIM
    chunk = tl.arange(0, MERGE_SPLITS)
    acc = tl.zeros([GROUP_PAD, DV_PAD], tl.float32)
    for first in range(0, used_splits, MERGE_SPLITS):
        chunk_rows = partials_ptr + (rows[:, None] + first + chunk[None, :]) * (VALUE_DIM + 2)
        chunk_valid = head_valid[:, None] & (first + chunk[None, :] < used_splits)
        chunk_max = tl.load(chunk_rows, mask=chunk_valid, other=_NO_LOGIT, cache_modifier=".cg")
        weights = tl.exp2(chunk_max - overall_max[:, None])
        values = tl.load(
            chunk_rows[:, :, None] + 2 + value_dims[None, None, :],
            mask=chunk_valid[:, :, None] & value_valid[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.sum(values * weights[:, :, None], 1)
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + value_dims[None, :],
        (acc / total[:, None]).to(out_ptr.dtype.element_ty),
        mask=head_valid[:, None] & value_valid[None, :],
    )


def cached_attention_triton(
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
    *,
    num_decode_splits: Optional[int] = None,
    check: bool = True,
) -> torch.Tensor:
    """``cached_attention`` with Triton kernels: same arguments, same result as ``cached_attention_reference``.

    Writes ``k``/``v`` into the caches, then runs the prefill kernel over the first ``num_prefill``
    sequences (a tree chunk's rows masked by their ``tree_mask`` bits, a bidirectional block's rows seeing
    on to their ``attend_until``) and the split-K decode kernel over the last ``num_decode`` (``batch_info``,
    read on the host; decode rows are causal, so it reads neither ``tree_mask`` nor ``attend_until``). Both
    add ``distance_bias`` (T5's relative position bias) to their logits.
    ``num_decode_splits`` overrides the split count chosen from the batch and context sizes.
    Raises ``ValueError`` for inputs these kernels do not support (see :func:`check_supported`);
    ``check=False`` skips those checks, for a caller that ran them once already (the backend op, whose
    ``supports`` checked the node at build).
    """
    if check:
        check_supported(
            q, k, v, k_cache, v_cache, block_tables, sliding_window, logit_cap, sinks, alibi_slopes,
            num_decode_splits, tree_mask, attend_until, distance_bias, device=q.device,
        )
        check_batch_info("cached_attention_triton", batch_info, distance_bias)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    q_tokens = q[0] if q.stride(-1) == 1 else q[0].contiguous()
    return attend_over_cache(
        q_tokens, k_cache, v_cache, seq_start, kv_lens, block_tables, batch_info, scale, sliding_window, logit_cap,
        sinks, alibi_slopes, num_decode_splits, k_scale, v_scale, tree_mask, attend_until, distance_bias,
    )


def check_batch_info(op: str, batch_info: torch.Tensor, distance_bias: Optional[torch.Tensor]) -> None:
    """``batch_info`` must be on the CPU (the launch reads it without a device sync), and ``distance_bias`` reach past
    its longest sequence's last position (the kernels read the table unchecked)."""
    if batch_info.device.type != "cpu":
        raise ValueError(f"{op}: batch_info must be a CPU tensor (read without a device sync); it is on {batch_info.device}.")
    longest = int(batch_info[3])
    if distance_bias is not None and distance_bias.shape[1] < longest:
        raise ValueError(f"{op}: distance_bias must be [Hq, L ≥ {longest} (the longest sequence)]; got "
                         f"{tuple(distance_bias.shape)}.")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """This step's keys and values ``[1, T, Hkv, D]`` into their slots of both caches, one kernel (an fp8 cache's
    entries divided by its scales)."""
    k_tokens, v_tokens = (t[0] if t.stride(-1) == 1 else t[0].contiguous() for t in (k, v))
    if k.shape[1] > 0:
        _write_kv_kernel[(k.shape[1],)](
            k_tokens, v_tokens, slot_mapping_ptr=slot_mapping, k_multiplier=1.0 / k_scale, v_multiplier=1.0 / v_scale,
            **cache_arguments(k_cache, v_cache),
            stride_new_kt=k_tokens.stride(0), stride_new_kh=k_tokens.stride(1),
            stride_new_vt=v_tokens.stride(0), stride_new_vh=v_tokens.stride(1),
            KV_HEADS=k_cache.shape[2], HEADS_PAD=triton.next_power_of_2(k_cache.shape[2]),
        )


def cache_arguments(k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """The caches' pointers, strides and dims, as every kernel that reads or writes them takes them."""
    head_dim, value_dim = k_cache.shape[-1], v_cache.shape[-1]
    return dict(
        k_cache_ptr=k_cache, v_cache_ptr=v_cache,
        stride_kb=k_cache.stride(0), stride_kt=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vt=v_cache.stride(1), stride_vh=v_cache.stride(2),
        HEAD_DIM=head_dim, VALUE_DIM=value_dim, D_PAD=_padded_dim(head_dim), DV_PAD=_padded_dim(value_dim),
        PAGE_SIZE=k_cache.shape[1],
    )


def attend_over_cache(
    q_tokens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_start: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    batch_info: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    logit_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[List[float]] = None,
    num_decode_splits: Optional[int] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tree_mask: Optional[torch.Tensor] = None,
    attend_until: Optional[torch.Tensor] = None,
    distance_bias: Optional[torch.Tensor] = None,
    rope: Optional[dict] = None,
) -> torch.Tensor:
    """The attention half of :func:`cached_attention_triton`, once this step's keys and values are in the
    caches: the prefill and decode kernels over ``q_tokens [T, Hq, D]`` (last dim contiguous). Returns
    ``[1, T, Hq, Dv]``. An fp8 cache's scales act outside the kernels: ``k_scale`` scales the logits (it
    joins ``scale``, so ``distance_bias`` is added after it, as the reference adds it), ``v_scale`` the output
    (attention is linear in the values). ``tree_mask``, ``attend_until``: the op's, read by the prefill kernel only
    (None compiles its test out); ``distance_bias``: the op's, read by both (None compiles it out).

    ``rope`` (a batch without prefills only): the decode kernel's arguments for the new tokens, unrotated
    (``paged_attention_rope``'s fused decode path). The decode kernel then rotates them itself, writing q
    into the contiguous ``q_tokens`` buffer and the keys and values into the caches."""
    scale = scale * k_scale
    num_prefill, num_decode, max_q_len, max_kv_len = batch_info.tolist()
    if rope is not None and num_prefill > 0:
        raise ValueError(
            f"attend_over_cache: rope (the decode kernel's rotation) needs a batch without prefills; "
            f"batch_info has {num_prefill}."
        )
    out = q_tokens.new_empty((1, *q_tokens.shape[:-1], v_cache.shape[-1]))
    q_heads, kv_heads = q_tokens.shape[1], k_cache.shape[2]
    shared = dict(
        **cache_arguments(k_cache, v_cache), q_ptr=q_tokens, out_ptr=out[0],
        seq_start_ptr=seq_start, kv_lens_ptr=kv_lens, block_tables_ptr=block_tables, sinks_ptr=sinks,
        alibi_ptr=None if alibi_slopes is None else _slopes_tensor(tuple(alibi_slopes), q_tokens.device),
        distance_bias_ptr=distance_bias,
        stride_qt=q_tokens.stride(0), stride_qh=q_tokens.stride(1), stride_ot=out.stride(1), stride_oh=out.stride(2),
        stride_bt=block_tables.stride(0), stride_bias_h=0 if distance_bias is None else distance_bias.stride(0),
        scale=scale, logit_cap=logit_cap or 0.0, window=sliding_window or 0, GROUP=q_heads // kv_heads,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=logit_cap is not None, HAS_SINKS=sinks is not None,
        HAS_ALIBI=alibi_slopes is not None, HAS_DISTANCE_BIAS=distance_bias is not None,
        # fp32 dots would otherwise run in TF32 on the GPU, ~1e-3 off the float32 reference.
        DOT_PRECISION="ieee" if q_tokens.dtype == torch.float32 else "tf32",
        FP8_IN_F16=FP8_IN_F16 and q_tokens.dtype == torch.bfloat16 and k_cache.dtype == torch.float8_e4m3fn,
    )
    if num_prefill > 0:
        block_m, block_n, num_warps, num_stages = _prefill_config(max_q_len, max(shared["D_PAD"], shared["DV_PAD"]))
        num_query_blocks = triton.cdiv(max_q_len, block_m)
        _prefill_kernel[(q_heads, num_query_blocks, num_prefill)](
            **shared, tree_mask_ptr=tree_mask, attend_until_ptr=attend_until, num_query_blocks=num_query_blocks,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_TREE=tree_mask is not None, HAS_ATTEND_UNTIL=attend_until is not None,
            num_warps=num_warps, num_stages=num_stages,
        )
    if num_decode > 0:
        _launch_decode(
            shared, out, num_prefill, num_decode, max_kv_len, q_heads, kv_heads, sliding_window, num_decode_splits,
            rope,
        )
    return out if v_scale == 1.0 else out.mul_(v_scale)


@functools.lru_cache(maxsize=64)
def _slopes_tensor(slopes: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The slopes on the device, made once per (layer's slopes, device) instead of on every call."""
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def _launch_decode(
    shared: dict,
    out: torch.Tensor,
    num_prefill: int,
    num_decode: int,
    max_kv_len: int,
    q_heads: int,
    kv_heads: int,
    sliding_window: Optional[int],
    num_decode_splits: Optional[int],
    rope: Optional[dict],
) -> None:
    max_visible = max_kv_len if sliding_window is None else min(max_kv_len, sliding_window)
    one_wave = False
    if num_decode_splits is None:
        spread, num_splits = _decode_splits(num_decode * kv_heads, max_visible, out.device)
        one_wave = spread == 1 and num_decode * kv_heads <= _RESIDENT_PROGRAMS_PER_SM * _multiprocessors(out.device)
    block_n, num_warps, num_stages = _decode_config(max(shared["D_PAD"], shared["DV_PAD"]), one_wave)
    if num_decode_splits is None:
        keys_per_split = triton.cdiv(triton.cdiv(max_visible, num_splits), block_n) * block_n
        # rounding up to whole tiles may leave trailing splits with nothing to do
        num_splits = triton.cdiv(max_visible, keys_per_split)
        spread = min(spread, num_splits)
    else:  # every sequence over all the splits asked for
        spread = num_splits = num_decode_splits
    partials = arrivals = None
    if num_splits > 1:
        partials = torch.empty(
            (num_decode, q_heads, num_splits, shared["VALUE_DIM"] + 2), dtype=torch.float32, device=out.device
        )
        arrivals = arrival_counters(num_decode * kv_heads, out.device)
    splits_pad, merge_group_pad = triton.next_power_of_2(num_splits), triton.next_power_of_2(shared["GROUP"])
    # as many splits a merge step as keep its [heads, splits, dims] tile at ~32 registers a thread
    merge_splits = max(1, min(splits_pad, _MERGE_TILE // (merge_group_pad * shared["DV_PAD"])))
    _decode_kernel[(num_decode, kv_heads, num_splits)](
        **shared, partials_ptr=partials, arrivals_ptr=arrivals,
        first_decode=num_prefill, q_heads=q_heads, spread_splits=spread,
        # tl.dot needs at least 16 rows; the padded head rows are masked out.
        GROUP_PAD=max(16, triton.next_power_of_2(shared["GROUP"])), BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1,
        SPLITS_PAD=splits_pad, MERGE_GROUP_PAD=merge_group_pad, MERGE_SPLITS=merge_splits,
        MAX_KEYS_PER_SPLIT=_MAX_KEYS_PER_SPLIT, EMPTY_SPLITS_FIRST=one_wave if _EMPTY_SPLITS_FIRST is None else _EMPTY_SPLITS_FIRST,
        num_warps=num_warps, num_stages=num_stages,
        **dependent_launch(out.device), **({} if rope is None else dict(rope, HAS_ROPE=True)),
    )


def _padded_dim(head_dim: int) -> int:
    # Tiles need power-of-2 sides, and tl.dot at least 16 along the reduced axis.
    return max(16, triton.next_power_of_2(head_dim))


def _prefill_config(max_q_len: int, dim_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel."""
    # Short chunks (decode-sized prefills, small prefix-cache misses) would waste most of a 64-row block.
    block_m = 64 if max_q_len > 32 else max(16, triton.next_power_of_2(max_q_len))
    if dim_pad > 128:  # 256-wide tiles: halve BLOCK_N to keep three stages in shared memory
        return block_m, 32, 4, 3
    return block_m, 64, 4, 3


def _decode_config(dim_pad: int, one_wave: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the decode kernel; ``one_wave``: every sequence is one split
    and all of the (sequence, kv head) programs are resident at once."""
    if dim_pad > 128:  # as for prefill: three stages of 64-key, 256-wide tiles would not fit in shared memory
        return 32, 4, 3
    if one_wave:
        # No program waits for a slot, so each walks its keys in half as many tiles: at 32 decodes (~200
        # keys, Llama-3-8B heads, graph-sized grid) 10.27 against 11.52 µs (scripts/time_decode_attention.py
        # on an H200). At 256 decodes (eight programs an SM) 128-key tiles are slower: fewer programs reside.
        return 128, 4, 2
    # Two stages, not three: at 256 decodes (~200 keys, Llama-3-8B heads, graph-sized grid) 72.2 against
    # 81.7 µs (kernel and the separate merge it then had), the same at one decode (6.05) and 14.5 against
    # 14.1 at 32 (scripts/time_decode_attention.py on an H200): a program holds less shared memory, so more
    # reside.
    return 64, 4, 2


_RESIDENT_PROGRAMS_PER_SM = 2  # decode programs of 64-key, two-stage tiles that fit on one SM at once


def _decode_splits(programs_per_split: int, max_visible: int, device: torch.device) -> tuple[int, int]:
    """(splits every sequence spreads over, splits in the grid). The first fills the card: about two
    programs per multiprocessor, what the decode kernel's pipelined tiles let reside (a sequence cut into
    more programs than that runs in waves, each program a tile or two). The grid adds splits for the
    longest sequence, none longer than ``_MAX_KEYS_PER_SPLIT`` keys; both stay at most ``_MAX_SPLITS``
    and leave no split shorter than ``_MIN_KEYS_PER_SPLIT`` at ``max_visible`` keys."""
    most = max(1, min(triton.cdiv(max_visible, _MIN_KEYS_PER_SPLIT), _MAX_SPLITS))
    spread = min(max(1, _RESIDENT_PROGRAMS_PER_SM * _multiprocessors(device) // programs_per_split), most)
    return spread, min(max(spread, triton.cdiv(max_visible, _MAX_KEYS_PER_SPLIT)), most)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter runs programs one after another: nothing to fill
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    sliding_window: Optional[int],
    logit_cap: Optional[float],
    sinks: Optional[torch.Tensor],
    alibi_slopes: Optional[List[float]],
    num_decode_splits: Optional[int] = None,
    tree_mask: Optional[torch.Tensor] = None,
    attend_until: Optional[torch.Tensor] = None,
    distance_bias: Optional[torch.Tensor] = None,
    *,
    device: torch.device,
) -> None:
    """Raise ``ValueError`` naming the first input these kernels cannot take on ``device``. Reads only
    shapes, dtypes and strides, so the ``supports`` predicate runs it on a node's meta tensors at build."""
    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"cached_attention_triton: tensors are on {device}; the Triton kernels need CUDA tensors, "
            f"or TRITON_INTERPRET=1 set before this module is imported to run on the CPU."
        )
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"cached_attention_triton: q must be [1, T, Hq, D]; got {tuple(q.shape)}.")
    fp8_caches = k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    if fp8_caches and device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("cached_attention_triton: float8 caches need compute capability 8.9 or later (Ada, Hopper)")
    if q.dtype not in SUPPORTED_DTYPES or (not fp8_caches and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype)):
        raise ValueError(
            f"cached_attention_triton: q and both caches must share one dtype of {SUPPORTED_DTYPES} (or the caches be "
            f"float8_e4m3fn); "
            f"got q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}. Use the torch backend otherwise."
        )
    if INTERPRETED and q.dtype == torch.bfloat16 and not (fp8_caches and FP8_IN_F16):  # fp8 caches: float16 dots
        raise ValueError(
            "cached_attention_triton: Triton's interpreter multiplies the bit patterns of bfloat16 tl.dot "
            "operands (triton-lang/triton#11584); run bfloat16 on a GPU, or float16/float32 in the interpreter."
        )
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    if head_dim > MAX_HEAD_DIM or value_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"cached_attention_triton: head dims up to {MAX_HEAD_DIM} are supported; got D={head_dim}, "
            f"Dv={value_dim}. Use the torch backend for wider heads."
        )
    q_heads, kv_heads = q.shape[2], k_cache.shape[2]
    kv_shapes_agree = k.shape[-2:] == (kv_heads, head_dim) and k_cache.shape[-1] == head_dim
    if not kv_shapes_agree or v_cache.shape[-2:] != (kv_heads, value_dim):
        raise ValueError(
            f"cached_attention_triton: k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)} "
            f"and v_cache {tuple(v_cache.shape)} disagree on kv heads or head dims (q is {tuple(q.shape)})."
        )
    if q_heads % kv_heads != 0:
        raise ValueError(
            f"cached_attention_triton: query heads Hq={q_heads} must be a multiple of kv heads Hkv={kv_heads}."
        )
    block_size = k_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1) or v_cache.shape[1] != block_size:
        raise ValueError(
            f"cached_attention_triton: the cache block size must be a power of 2 shared by both caches "
            f"(positions are split into block and offset by shift and mask); got {block_size} and {v_cache.shape[1]}."
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError(
            "cached_attention_triton: the caches' head-dim axis and block_tables' rows must be contiguous."
        )
    check_alibi_slopes("cached_attention_triton", alibi_slopes, q_heads)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"cached_attention_triton: sliding_window must be ≥ 1 (or None); got {sliding_window}.")
    if logit_cap is not None and not logit_cap > 0:
        raise ValueError(f"cached_attention_triton: logit_cap must be > 0 (or None); got {logit_cap}.")
    if logit_cap is not None and alibi_slopes is not None:
        # The kernels add ALiBi's slope · distance after the cap; the reference before it. No served model has both.
        raise ValueError("cached_attention_triton: ALiBi slopes with a logit_cap are not supported together (the kernels "
                         "would add the slopes after the cap); use the torch backend.")
    if sinks is not None and sinks.shape != (q_heads,):
        raise ValueError(f"cached_attention_triton: sinks must be [Hq={q_heads}]; got {tuple(sinks.shape)}.")
    if num_decode_splits is not None and num_decode_splits < 1:
        raise ValueError(
            f"cached_attention_triton: num_decode_splits must be ≥ 1 (or None); got {num_decode_splits}."
        )
    tokens = q.shape[1]
    for name, rows in (("tree_mask", tree_mask), ("attend_until", attend_until)):
        if rows is not None and not (rows.dtype == torch.int64 and rows.shape == (tokens,) and rows.stride(0) == 1):
            raise ValueError(
                f"cached_attention_triton: {name} must be a contiguous int64 [T={tokens}]; got {rows.dtype} "
                f"{tuple(rows.shape)}."
            )
    if distance_bias is not None:
        if distance_bias.dim() != 2 or distance_bias.shape[0] != q_heads or distance_bias.stride(-1) != 1:
            raise ValueError(
                f"cached_attention_triton: distance_bias must be [Hq={q_heads}, L] with contiguous rows; got "
                f"{tuple(distance_bias.shape)} with strides {distance_bias.stride()}."
            )
        if distance_bias.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"cached_attention_triton: distance_bias must be one of {SUPPORTED_DTYPES}; got {distance_bias.dtype}."
            )
        if attend_until is not None:
            raise ValueError(
                "cached_attention_triton: distance_bias is by distance back from the query; it cannot bias keys after "
                "it (attend_until)."
            )
