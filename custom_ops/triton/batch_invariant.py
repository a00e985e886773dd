"""Batch-invariant Triton kernels: a row's result is the same bits whatever else its step computes.

The fast kernels choose their launch from the step's shape: a GEMM's tiles and split-K from its row count
(``skinny_gemm.py``, and cuBLAS its algorithm), attention a prefill kernel for chunks and a split-K decode
kernel for single tokens, a norm's rows per program from the row count. Each choice sums the same products
in another order, so a token's logits differ in their last bits between a one-token decode step and a
step verifying five drafted tokens, or between a batch of 1 and of 32. In bfloat16 a near-tie then flips
the greedy token (issue 42's identity runs: 42 of 100 prompts parted at such ties).

The kernels here fix the order per row, by construction:

- :func:`invariant_linear`: one tile shape for every row count (``BLOCK_M × BLOCK_N``, ``K`` walked in
  ``BLOCK_K`` steps from 0, accumulated in float32, no split-K). Rows past the batch are loaded as zeros;
  an output element is the same ``tl.dot`` instructions over the same ``K`` steps for any ``M``.
- :func:`invariant_attention`: one program per (query token, kv head), every token treated as a decode
  at its position: its sequence found by bisection over ``seq_start``, the keys it sees walked in
  ``BLOCK_N`` tiles aligned to absolute positions (0, ``BLOCK_N``, …), one online softmax in float32, no
  split. A prompt token, a drafted token being verified and a decoded token at the same position over the
  same cache compute the same bits.
- Norms: ``norms.py``'s kernels at one row a program (:data:`NORM_CONFIG`): a row's reduction is laid
  out the same whatever the row count.

The price is speed where the fast kernels' choices paid: decode GEMMs use a 64-row tile for one row, long
contexts run one program per token without split-K, prefill reads keys per token rather than per query
tile. ``batch_invariant: true`` (``custom_ops/batch_invariant.py``) selects these kernels for every node.

Example (on a CPU with ``TRITON_INTERPRET=1`` set before the import, as the tests do)::

    import torch
    from autodeploy.custom_ops.triton.batch_invariant import invariant_linear

    weight = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(5, 128, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(invariant_linear(x[:1], weight, None), invariant_linear(x, weight, None)[:1])
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..cached_attention import DISTANCE_BIAS_REFUSAL, CachedAttentionArgs
from .norms import NormConfig
from .paged_attention import _logits_base2, _online_softmax_step, cache_arguments, write_kv

# One launch for every row count. 64 × 64 × 64 bf16 tiles: a Hopper warpgroup MMA's shape, two stages of
# them in ~32 KB of shared memory.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
_LINEAR_WARPS, _LINEAR_STAGES = 4, 3
ATTENTION_BLOCK_N = 64  # keys a tile; tiles start at multiples of it
NORM_CONFIG = NormConfig(rows_per_program=1, num_warps=4)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[rows, cols] = x[rows] @ w[cols]ᵀ (+ bias)`` for one ``[BLOCK_M, BLOCK_N]`` tile; ``M`` is never
    specialised (a row count of 1 compiles the same kernel as any other)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid, col_valid = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_valid[:, None] & k_valid[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ weight.T + bias`` (``linear``'s contract: ``x [..., K]``, ``weight [N, K]``), each output row
    computed the same way for any number of rows."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], BLOCK_M), triton.cdiv(weight.shape[0], BLOCK_N))
        _linear_kernel[grid](
            rows, weight, bias, out, rows.shape[0], weight.shape[0], rows.stride(0), weight.stride(0), out.stride(0),
            K=weight.shape[1], HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=_LINEAR_WARPS, num_stages=_LINEAR_STAGES,
        )
    return out.reshape(*x.shape[:-1], weight.shape[0])


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "stride_bt"])
def _attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, seq_start_ptr, kv_lens_ptr, block_tables_ptr, num_tokens, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, scale, logit_cap, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Query token ``program_id(0)``, the query heads of kv head ``program_id(1)``: attention over the keys
    its position sees, as a decode there would compute it."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    value_dims = tl.arange(0, DV_PAD)
    q_heads = kv_head * GROUP + heads
    out_rows = out_ptr + token.to(tl.int64) * stride_ot + q_heads[:, None] * stride_oh + value_dims[None, :]
    out_mask = (heads[:, None] < GROUP) & (value_dims[None, :] < VALUE_DIM)
    total = tl.load(seq_start_ptr + num_seqs)
    if token >= total:  # a padded row of a captured graph: zeros, not whatever the buffer held
        tl.store(out_rows, tl.zeros((GROUP_PAD, DV_PAD), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    # The token's sequence: the last s with seq_start[s] <= token (seq_start[lo] <= token < seq_start[hi]).
    lo = token * 0
    hi = lo + num_seqs
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(seq_start_ptr + mid) <= token  # once hi == lo + 1, mid is lo: nothing moves
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    end = tl.load(seq_start_ptr + lo + 1)
    kv_len = tl.load(kv_lens_ptr + lo)
    position = kv_len - (end - token)  # the token's absolute position; it sees keys 0 … position
    if position < 0:  # a padding sequence of a captured graph (kv_len 0): zeros (Triton's // truncates -1 to 0)
        tl.store(out_rows, tl.zeros((GROUP_PAD, DV_PAD), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(position - window + 1, 0)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + q_heads[:, None] * stride_qh + dims[None, :],
                mask=(heads[:, None] < GROUP) & (dims[None, :] < HEAD_DIM), other=0.0)
    block_table_row = block_tables_ptr + lo.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    acc = tl.zeros((GROUP_PAD, DV_PAD), dtype=tl.float32)
    row_sum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    row_max = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    for tile in range(first // BLOCK_N, position // BLOCK_N + 1):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        visible = (keys >= first) & (keys <= position)
        blocks = tl.load(block_table_row + keys // PAGE_SIZE, mask=visible, other=0).to(tl.int64)
        offsets = keys % PAGE_SIZE
        k = tl.load(k_base + blocks[:, None] * stride_kb + offsets[:, None] * stride_kt + dims[None, :],
                    mask=visible[:, None] & (dims[None, :] < HEAD_DIM), other=0.0).to(q.dtype)
        v = tl.load(v_base + blocks[:, None] * stride_vb + offsets[:, None] * stride_vt + value_dims[None, :],
                    mask=visible[:, None] & (value_dims[None, :] < VALUE_DIM), other=0.0).to(q.dtype)
        logits = _logits_base2(q, k, scale, logit_cap, HAS_CAP, DOT_PRECISION)
        logits = tl.where(visible[None, :], logits, float("-inf"))
        acc, row_sum, row_max = _online_softmax_step(acc, row_sum, row_max, logits, v, DOT_PRECISION)
    tl.store(out_rows, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


def invariant_attention(*args, **kwargs) -> torch.Tensor:
    """``cached_attention``'s arguments and contract (``q [1, T, Hq, D]``; without sinks, ALiBi or tree masks,
    which :func:`unsupported_attention` refuses): writes ``k``/``v`` into their slots, then attends every token
    as a decode at its position would. Reads nothing on the host: a CUDA graph can hold it."""
    return attend(CachedAttentionArgs(*args, **kwargs))


def attend(call: CachedAttentionArgs) -> torch.Tensor:
    """:func:`invariant_attention` of arguments already bound (the rope backend's, after its rotation)."""
    q, k_cache, v_cache, seq_start, kv_lens, block_tables = (
        call.q, call.k_cache, call.v_cache, call.seq_start, call.kv_lens, call.block_tables)
    write_kv(call.k, call.v, k_cache, v_cache, call.slot_mapping, call.k_scale, call.v_scale)
    q_tokens = q[0] if q.stride(-1) == 1 else q[0].contiguous()
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
    num_tokens, q_heads, kv_heads, num_seqs = q.shape[1], q.shape[2], k_cache.shape[2], kv_lens.shape[0]
    if num_tokens and num_seqs:
        caches = cache_arguments(k_cache, v_cache)
        group = q_heads // kv_heads
        _attention_kernel[(num_tokens, kv_heads)](
            q_tokens, out[0], k_cache, v_cache, seq_start, kv_lens, block_tables, num_tokens, num_seqs,
            q_tokens.stride(0), q_tokens.stride(1), out.stride(1), out.stride(2),
            caches["stride_kb"], caches["stride_kt"], caches["stride_kh"],
            caches["stride_vb"], caches["stride_vt"], caches["stride_vh"], block_tables.stride(0),
            call.scale * call.k_scale, call.logit_cap or 0.0, call.sliding_window or 0,
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=caches["HEAD_DIM"],
            VALUE_DIM=caches["VALUE_DIM"], D_PAD=caches["D_PAD"], DV_PAD=caches["DV_PAD"], PAGE_SIZE=caches["PAGE_SIZE"],
            BLOCK_N=ATTENTION_BLOCK_N, SEARCH_STEPS=max(1, int(num_seqs).bit_length()),
            HAS_WINDOW=call.sliding_window is not None, HAS_CAP=call.logit_cap is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
    elif num_tokens:
        out.zero_()
    return out if call.v_scale == 1.0 else out.mul_(call.v_scale)


def unsupported_attention(call: CachedAttentionArgs) -> Optional[str]:
    """Why :func:`invariant_attention` cannot serve this call of ``cached_attention``, or None."""
    q, k_cache = call.q, call.k_cache
    if q.dtype not in DTYPES:
        return f"q is {q.dtype}; the batch-invariant attention takes {', '.join(map(str, DTYPES))}"
    if q.shape[-1] > 256:
        return f"head dim {q.shape[-1]} > 256"
    if q.shape[2] % k_cache.shape[2]:
        return f"{q.shape[2]} query heads are not a multiple of {k_cache.shape[2]} kv heads"
    if call.sinks is not None or call.alibi_slopes is not None:
        return "the batch-invariant attention has no sinks or ALiBi"
    if call.tree_mask is not None:
        return ("tree drafts verify tokens whose keys are not at their positions; the batch-invariant attention "
                "reads keys by position (use speculative.tree_width 1)")
    if call.attend_until is not None:
        return "the batch-invariant attention is causal only; this model's prompts hold bidirectional blocks (attend_until)"
    if call.distance_bias is not None:
        return DISTANCE_BIAS_REFUSAL
    return None

