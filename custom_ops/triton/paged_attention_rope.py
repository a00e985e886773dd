"""Triton backend of ``cached_attention_rope``: RoPE inside the kernel that writes K/V into the paged cache.

Unfused, a layer's step runs ``rope(q)`` and ``rope(k)`` (each a launch that reads its input and writes a
rotated copy), then ``cached_attention``'s write kernel reads the rotated keys again to store them. Here
one kernel reads each new token's angles, q, k and v once: it rotates q into a contiguous buffer that
the attention kernels read, and rotates k straight into its cache slot, next to v. A program owns one
token and one role (grid ``T × 2``): all query heads, or all kv heads' keys and values. The rotation is
``rope``'s Triton kernel's (``rope.rotate_rows``: rotate-half or interleaved pairs, partial rotary, math in
float32 with one rounding), the attention is ``cached_attention``'s (``paged_attention.attend_over_cache``).

A batch of decodes alone (every captured decode graph) skips that kernel: the decode kernel takes the same
arguments (``HAS_ROPE``), each of its programs rotates its kv head's query heads, and the split that holds
the newest key writes it and its value into the caches first, writing the same bits as the kernel would.

Example (on a CPU with ``TRITON_INTERPRET=1`` set before the import, as the tests do)::

    import torch
    from autodeploy.custom_ops.triton.paged_attention_rope import cached_attention_rope_triton

    cuda = dict(device="cuda")
    q, k, v = torch.randn(1, 4, 4, 16, **cuda), torch.randn(1, 4, 2, 16, **cuda), torch.randn(1, 4, 2, 16, **cuda)
    angles = torch.rand(1, 4, 8, **cuda).repeat(1, 1, 2)                            # [1, T, R=16]
    k_cache, v_cache = torch.zeros(4, 8, 2, 16, **cuda), torch.zeros(4, 8, 2, 16, **cuda)
    seq_start = torch.tensor([0, 3, 4], dtype=torch.int32, **cuda)
    kv_lens = torch.tensor([3, 3], dtype=torch.int32, **cuda)
    block_tables = torch.tensor([[2], [0]], dtype=torch.int32, **cuda)
    slot_mapping = torch.tensor([16, 17, 18, 2], **cuda)
    batch_info = torch.tensor([1, 1, 3, 3], dtype=torch.int32)  # stays on the CPU
    out = cached_attention_rope_triton(q, k, v, angles.cos(), angles.sin(), False, k_cache, v_cache, seq_start,
                                       kv_lens, block_tables, slot_mapping, batch_info, 16**-0.5)  # [1, 4, 4, 16]
"""

from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl

from . import SUPPORTED_DTYPES
from .cache_store import stored_as
from .launch import dependent_launch, wait_for_previous_kernel
from .paged_attention import attend_over_cache, cache_arguments, check_batch_info, check_supported
from .rope import load_angles, rotate_rows


@triton.jit
def _rope_write_kv_kernel(
    new_q_ptr, new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_multiplier, v_multiplier,
    stride_new_qt, stride_new_qh, stride_new_kt, stride_new_kh, stride_new_vt, stride_new_vh, stride_cos_t, stride_sin_t,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, ROTARY_HALF: tl.constexpr, PAIRS_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (new token, role): role 0 rotates the token's query heads into ``q_out``, role 1
    its keys into their cache slot and copies its values beside them, times the multipliers (1 / an fp8
    cache's scales). (``D_PAD``: unused, taken with the other cache arguments.)"""
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cos_first, cos_second, sin_first, sin_second = load_angles(
        cos_ptr + token * stride_cos_t, sin_ptr + token * stride_sin_t, ROTARY_HALF, PAIRS_PAD, INTERLEAVED
    )
    if tl.program_id(1) == 0:  # the query heads, rotated into the buffer the attention kernels read
        # Names differ between the branches: Triton types a name once for the whole if/else, and the
        # query and key head ranges have different shapes.
        q_heads = tl.arange(0, Q_HEADS_PAD)[:, None]
        rotate_rows(
            new_q_ptr + token * stride_new_qt + q_heads * stride_new_qh, q_out_ptr + (token * Q_HEADS + q_heads) * HEAD_DIM,
            q_heads < Q_HEADS, cos_first, cos_second, sin_first, sin_second, 1.0,
            Q_HEADS_PAD, HEAD_DIM, ROTARY_HALF, PAIRS_PAD, PASS_PAD, INTERLEAVED,
        )
    else:  # the keys, rotated into their cache slot, and the values beside them
        slot = tl.load(slot_mapping_ptr + token)
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        kv_heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        head_valid = kv_heads < KV_HEADS
        rotate_rows(
            new_k_ptr + token * stride_new_kt + kv_heads * stride_new_kh,
            k_cache_ptr + block * stride_kb + offset * stride_kt + kv_heads * stride_kh,
            head_valid, cos_first, cos_second, sin_first, sin_second, k_multiplier,
            KV_HEADS_PAD, HEAD_DIM, ROTARY_HALF, PAIRS_PAD, PASS_PAD, INTERLEAVED,
        )
        value_dims = tl.arange(0, DV_PAD)[None, :]
        value_mask = head_valid & (value_dims < VALUE_DIM)
        v = tl.load(new_v_ptr + token * stride_new_vt + kv_heads * stride_new_vh + value_dims, mask=value_mask)
        v_slot = v_cache_ptr + block * stride_vb + offset * stride_vt + kv_heads * stride_vh
        tl.store(v_slot + value_dims, stored_as(v * v_multiplier, v_cache_ptr), mask=value_mask)


def cached_attention_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
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
    """``cached_attention_rope`` with Triton kernels: same arguments, same result as its reference.

    One launch rotates q and k by ``cos``/``sin`` and writes the rotated keys and the values into the
    caches; then ``cached_attention``'s prefill and split-K decode kernels attend. In a batch without
    prefills (``batch_info``) the decode kernel rotates and writes instead, one launch in all. Raises
    ``ValueError`` for inputs these kernels do not take (:func:`check_rope_supported`); ``check=False``
    skips the checks, for the backend op, whose ``supports`` ran them at build.
    """
    if check:
        check_rope_supported(
            q, k, v, cos, sin, k_cache, v_cache, block_tables, sliding_window, logit_cap, sinks, alibi_slopes,
            num_decode_splits, tree_mask, attend_until, distance_bias, device=q.device,
        )
        check_batch_info("cached_attention_rope_triton", batch_info, distance_bias)
    tokens, q_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    kv_heads, rotary_dim = k_cache.shape[2], cos.shape[-1]
    q_tokens, k_tokens, v_tokens = (t[0] if t.stride(-1) == 1 else t[0].contiguous() for t in (q, k, v))
    # One row of angles per token; a broadcast row (S = 1) is read through a zero stride, never expanded.
    cos, sin = ((t if t.stride(-1) == 1 else t.contiguous()).expand(1, tokens, rotary_dim)[0] for t in (cos, sin))
    rotated_q = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    # What the rope/write kernel and the decode kernel's fused path both take, under the same names.
    new_tokens = dict(
        new_q_ptr=q_tokens, new_k_ptr=k_tokens, new_v_ptr=v_tokens, cos_ptr=cos, sin_ptr=sin,
        slot_mapping_ptr=slot_mapping, k_multiplier=1.0 / k_scale, v_multiplier=1.0 / v_scale,
        stride_new_qt=q_tokens.stride(0), stride_new_qh=q_tokens.stride(1),
        stride_new_kt=k_tokens.stride(0), stride_new_kh=k_tokens.stride(1),
        stride_new_vt=v_tokens.stride(0), stride_new_vh=v_tokens.stride(1),
        stride_cos_t=cos.stride(0), stride_sin_t=sin.stride(0),
        ROTARY_HALF=rotary_dim // 2, PAIRS_PAD=triton.next_power_of_2(rotary_dim // 2),
        PASS_PAD=triton.next_power_of_2(head_dim - rotary_dim) if rotary_dim < head_dim else 0,
        INTERLEAVED=interleaved,
    )
    # A batch of decodes alone (every captured decode graph) skips the rope/write launch: each decode
    # program rotates its own query heads and, in the split that reads it, the new key.
    decodes_alone = int(batch_info[0]) == 0
    if not decodes_alone:
        _rope_write_kv_kernel[(tokens, 2)](
            **new_tokens, q_out_ptr=rotated_q, **cache_arguments(k_cache, v_cache),
            Q_HEADS=q_heads, KV_HEADS=kv_heads, Q_HEADS_PAD=triton.next_power_of_2(q_heads),
            KV_HEADS_PAD=triton.next_power_of_2(kv_heads), **dependent_launch(q.device),
        )
    return attend_over_cache(
        rotated_q, k_cache, v_cache, seq_start, kv_lens, block_tables, batch_info, scale, sliding_window,
        logit_cap, sinks, alibi_slopes, num_decode_splits, k_scale, v_scale, tree_mask, attend_until, distance_bias,
        rope=new_tokens if decodes_alone else None,
    )


def check_rope_supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
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
    """Raise ``ValueError`` naming the first input these kernels cannot take: ``cached_attention``'s
    Triton limits (:func:`paged_attention.check_supported`), then the angles'. Reads only shapes, dtypes
    and strides, so ``supports`` runs it on a node's meta tensors at build."""
    check_supported(
        q, k, v, k_cache, v_cache, block_tables, sliding_window, logit_cap, sinks, alibi_slopes, num_decode_splits,
        tree_mask, attend_until, distance_bias, device=device,
    )
    if cos.dtype not in SUPPORTED_DTYPES or sin.dtype != cos.dtype:
        raise ValueError(
            f"cached_attention_rope_triton: cos and sin must share one dtype of {SUPPORTED_DTYPES}; "
            f"got cos {cos.dtype}, sin {sin.dtype}."
        )
    if cos.dim() != 3 or sin.shape != cos.shape or cos.shape[0] != 1 or cos.shape[1] not in (1, q.shape[1]):
        raise ValueError(
            f"cached_attention_rope_triton: cos and sin must both be [1, T or 1, R] for q {tuple(q.shape)}; "
            f"got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}."
        )
    rotary_dim, head_dim = cos.shape[-1], q.shape[-1]
    if rotary_dim % 2 != 0 or rotary_dim == 0 or rotary_dim > head_dim:
        raise ValueError(
            f"cached_attention_rope_triton: rotary dim R={rotary_dim} must be even, positive and at most D={head_dim}."
        )
