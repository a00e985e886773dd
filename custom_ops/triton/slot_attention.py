"""Attention of a drafting head's queries over its slot cache, and the store into it, a kernel each.

A hidden-state head (``runtime/hidden_state_heads.py``) keeps its keys and values in a ``SlotCache``: per
sequence slot a ring of ``C`` entries, each holding the position it was written at. A query at position ``p``
sees its slot's entries at positions ``p - window < q ≤ p``. In plain PyTorch that is a gather of every
queried slot's whole ring (keys, values, positions), the mask built from them, an expanded copy of it and the
attention: ~9 kernels a drafting round, and the gathers' bytes grow with batch × ring. Here one program per
(query row, kv head) reads its slot's ring in place, tile by tile, with an online softmax: one kernel, and only
the ring it attends to is read — of it, only the entries that can hold a position it sees: a ring is written at
``position % C``, so a query at ``p < C`` reads entries ``0 … p`` (a sequence's first thousand positions no longer
walk the whole ring).

    out = slot_attention(q, k_cache, v_cache, held, slots, positions, window, scale)
    slot_store(k, v, positions, valid, slots, pad, k_cache, v_cache, held)  # SlotCache.write's five kernels in one

``q [B, heads, n, Dk]`` (any strides, the last 1), ``k_cache [S, kv, C, Dk]``, ``v_cache [S, kv, C, Dv]``,
``held [S, C]`` int64, ``slots [B]``, ``positions [B, n]`` → ``[B, heads, n, Dv]`` in ``q``'s dtype, equal to
``SlotCache.attend``'s ``scaled_dot_product_attention`` within rounding (float32 accumulation). A row that sees
no entry gives zeros (the SDPA formula gives NaN there; no head reads such a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 64  # ring entries a tile
MIN_DOT = 16  # tl.dot's smallest M, N and K


@triton.jit
def _slot_attention_kernel(
    q_ptr, k_ptr, v_ptr, held_ptr, slots_ptr, positions_ptr, out_ptr,
    n, window, scale,
    stride_qb, stride_qh, stride_qt, stride_ks, stride_kh, stride_kc, stride_vs, stride_vh, stride_vc, stride_held,
    CAPACITY: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr, DV: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * n + t
    kv_head = tl.program_id(1).to(tl.int64)
    b, t = row // n, row % n
    slot = tl.load(slots_ptr + b).to(tl.int64)
    at = tl.load(positions_ptr + row)
    group = tl.arange(0, GROUP_PAD)
    dk, dv = tl.arange(0, DK_PAD), tl.arange(0, DV_PAD)
    heads = kv_head * GROUP + group
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + t * stride_qt + dk[None, :],
                mask=(group[:, None] < GROUP) & (dk[None, :] < DK), other=0.0)
    best = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DV_PAD], dtype=tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    live = tl.minimum(at + 1, CAPACITY)  # entries past p hold no position ≤ p while p < C (entry i: i mod C)
    for start in range(0, live, BLOCK):
        entries = start + tl.arange(0, BLOCK)
        inside = entries < CAPACITY
        held = tl.load(held_ptr + slot * stride_held + entries, mask=inside, other=0)
        visible = inside & (held <= at) & (held > at - window)
        k = tl.load(k_base + entries[:, None] * stride_kc + dk[None, :], mask=visible[:, None] & (dk[None, :] < DK), other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(visible[None, :], scores.to(tl.float32) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        safe = tl.where(new_best == float("-inf"), 0.0, new_best)  # no entry seen yet: nothing to rescale
        weights = tl.exp(scores - safe[:, None])
        rescale = tl.exp(best - safe)
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(v_base + entries[:, None] * stride_vc + dv[None, :], mask=visible[:, None] & (dv[None, :] < DV), other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(weights, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        best = new_best
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    out_row = out_ptr + ((b * GROUP * tl.num_programs(1) + heads[:, None]) * n + t) * DV + dv[None, :]
    tl.store(out_row, out.to(out_ptr.dtype.element_ty), mask=(group[:, None] < GROUP) & (dv[None, :] < DV))


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, held: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, window: int, scale: float | None = None) -> torch.Tensor:
    """See the module docstring. ``ValueError`` for inputs the kernel does not take."""
    batch, heads, n, key_dim = q.shape
    _, kv_heads, capacity, _ = k_cache.shape
    value_dim = v_cache.shape[-1]
    if heads % kv_heads or k_cache.shape[-1] != key_dim or q.stride(-1) != 1 or k_cache.stride(-1) != 1 \
            or v_cache.stride(-1) != 1 or q.dtype != k_cache.dtype or held.stride(-1) != 1:
        raise ValueError(f"slot_attention: q {tuple(q.shape)} {q.dtype}, k_cache {tuple(k_cache.shape)} {k_cache.dtype}, "
                         f"v_cache {tuple(v_cache.shape)}: heads a multiple of kv heads, one key width, last dims contiguous, "
                         f"q in the caches' dtype")
    group = heads // kv_heads
    out = torch.empty(batch, heads, n, value_dim, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    positions = positions.contiguous()
    _slot_attention_kernel[(batch * n, kv_heads)](
        q, k_cache, v_cache, held, slots, positions, out, n, window,
        key_dim ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), held.stride(0),
        CAPACITY=capacity, GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), DK=key_dim,
        DK_PAD=max(MIN_DOT, triton.next_power_of_2(key_dim)), DV=value_dim, DV_PAD=max(MIN_DOT, triton.next_power_of_2(value_dim)),
        BLOCK=BLOCK_C, IEEE=q.dtype == torch.float32, num_warps=4,
    )
    return out


@triton.jit
def _slot_store_kernel(
    k_ptr, v_ptr, positions_ptr, valid_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, held_ptr, n, pad,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_ks, stride_kc_h, stride_kc_c,
    stride_vs, stride_vc_h, stride_vc_c, stride_held,
    CAPACITY: tl.constexpr, KV: tl.constexpr, KV_PAD: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * n + t
    b, t = row // n, row % n
    position = tl.load(positions_ptr + row)
    slot = tl.where(tl.load(valid_ptr + row) != 0, tl.load(slots_ptr + b).to(tl.int64), pad)
    index = position % CAPACITY
    heads, dk, dv = tl.arange(0, KV_PAD)[:, None], tl.arange(0, DK_PAD)[None, :], tl.arange(0, DV_PAD)[None, :]
    keys = tl.load(k_ptr + b * stride_kb + heads * stride_kh + t * stride_kt + dk, mask=(heads < KV) & (dk < DK))
    tl.store(k_cache_ptr + slot * stride_ks + heads * stride_kc_h + index * stride_kc_c + dk, keys, mask=(heads < KV) & (dk < DK))
    values = tl.load(v_ptr + b * stride_vb + heads * stride_vh + t * stride_vt + dv, mask=(heads < KV) & (dv < DV))
    tl.store(v_cache_ptr + slot * stride_vs + heads * stride_vc_h + index * stride_vc_c + dv, values, mask=(heads < KV) & (dv < DV))
    tl.store(held_ptr + slot * stride_held + index, position)


def slot_store(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor,
               pad: int, k_cache: torch.Tensor, v_cache: torch.Tensor, held: torch.Tensor) -> None:
    """Store keys ``[B, kv, n, Dk]`` and values ``[B, kv, n, Dv]`` (any strides, the last 1) of positions ``[B, n]``
    in the caches' ring entry ``position % C`` of each row's slot (``slots [B]``; rows not ``valid`` ``[B, n]``: slot
    ``pad``), and the positions in ``held``: ``SlotCache.write`` in one kernel."""
    batch, kv_heads, n, key_dim = k.shape
    value_dim = v.shape[-1]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"slot_store: k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype} into caches of "
                         f"{k_cache.dtype}: last dims contiguous, the caches' dtypes")
    if batch * n == 0:
        return
    positions, valid = positions.contiguous(), valid.contiguous()
    _slot_store_kernel[(batch * n,)](
        k, v, positions, valid, slots, k_cache, v_cache, held, n, pad,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        held.stride(0), CAPACITY=k_cache.shape[2], KV=kv_heads, KV_PAD=triton.next_power_of_2(kv_heads), DK=key_dim,
        DK_PAD=triton.next_power_of_2(key_dim), DV=value_dim, DV_PAD=triton.next_power_of_2(value_dim), num_warps=1,
    )
