"""The ``sdpa`` backend of ``cached_attention``: PyTorch's fused attention over the gathered blocks.

Same loop over sequences as the reference, but each sequence's attention is one
``scaled_dot_product_attention`` call with ``enable_gqa`` (no copy of the KV heads per query head, no
float32 logits tensor), which halves attention time on CPUs (8 decodes × 200 tokens, 6/2 heads ×
64: 1.32 → 0.70 ms per layer, measured). SDPA has no soft-capping or sinks: its ``supports`` refuses
layers with either, so ``select`` gives them the next candidate. ALiBi joins the boolean mask as a float
bias (``slope_h · (j - i)`` where visible, -inf elsewhere).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from .attention import check_alibi_slopes
from .cached_attention import gather_sequence_kv, write_kv_cache
from .registry import register_backend


def cached_attention_sdpa(
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
) -> torch.Tensor:
    """Same arguments and result as ``cached_attention_reference`` (without soft-capping or sinks)."""
    if logit_cap is not None or sinks is not None:
        raise ValueError("cached_attention_sdpa: SDPA has no soft-capping or sinks; use the reference or triton backend.")
    check_alibi_slopes("cached_attention_sdpa", alibi_slopes, q.shape[2])
    slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32, device=q.device)[:, None, None]
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    starts = seq_start.tolist()
    for s, kv_len in enumerate(kv_lens.tolist()):
        first, last = starts[s], starts[s + 1]
        keys, values = (t.transpose(0, 1) for t in gather_sequence_kv(k_cache, v_cache, block_tables[s], kv_len))  # [Hkv, kv_len, D]
        mask = None
        if last - first > 1 or sliding_window is not None or slopes is not None:
            query_pos = torch.arange(kv_len - (last - first), kv_len, device=q.device)[:, None]
            key_pos = torch.arange(kv_len, device=q.device)[None, :]
            mask = key_pos <= query_pos
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
            if slopes is not None:  # [Hq, q_len, kv_len] float bias; SDPA adds it to the scaled logits
                mask = (slopes * (key_pos - query_pos)).masked_fill(~mask, float("-inf")).to(q.dtype)
        attended = F.scaled_dot_product_attention(
            q[0, first:last].transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[0, first:last] = attended.transpose(0, 1)
    return out


def _sdpa_supports(q, k, v, k_cache, v_cache, seq_start, kv_lens, block_tables, slot_mapping, batch_info, scale,
                   sliding_window=None, logit_cap=None, sinks=None, alibi_slopes=None, *, device):
    if logit_cap is not None or sinks is not None:
        return "SDPA has no soft-capping or sinks"
    return True


# It reads seq_start and kv_lens on the host: no CUDA graph can hold it.
register_backend("cached_attention", "sdpa", cached_attention_sdpa, supports=_sdpa_supports, capturable=False)
