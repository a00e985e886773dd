"""``torch.ops.autodeploy.bidirectional_attention``: every query sees every key of its sequence (an encoder's
attention: a vision tower's, a text encoder's; a decoder's cross-attention over the encoder's keys, which may be
more or fewer than its queries), with GQA and an optional additive bias (T5's relative position bias).

It is its own op rather than an option of the causal ``attention``: the cache stage turns ``attention`` into
paged, cached attention over the KV pool, and this one never is (an encoder's sequence is whole in one forward).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .attention import check_bias
from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def bidirectional_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``q[B, S, Hq, D]`` over ``k[B, Sk, Hkv, D]``, ``v[B, Sk, Hkv, Dv]`` → ``[B, S, Hq, Dv]``, no mask.

    ``softmax(scale · q_i · k_j + bias_ij) · v_j`` per head in float32 (float64 for float64 inputs), cast back to
    ``q``'s dtype; query head ``h`` reads kv head ``h // (Hq // Hkv)``. ``bias`` (optional) is ``[1 or B, 1 or Hq,
    S, Sk]``: T5's relative position bias (``relative_position_bias``).
    """
    batch, _, q_heads, head_dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    if k.shape != (batch, keys, kv_heads, head_dim) or v.shape[:3] != (batch, keys, kv_heads):
        raise ValueError(f"bidirectional_attention: expected k [B, Sk, Hkv, D] and v [B, Sk, Hkv, Dv] matching q "
                         f"{tuple(q.shape)}; got k {tuple(k.shape)} and v {tuple(v.shape)}.")
    if q_heads % kv_heads != 0:
        raise ValueError(f"bidirectional_attention: query heads Hq={q_heads} must be a multiple of kv heads Hkv={kv_heads}.")
    check_bias("bidirectional_attention", bias, batch, q_heads, q.shape[1], keys)
    dtype = compute_dtype(q.dtype)
    kv_head_of = torch.arange(q_heads, device=q.device) // (q_heads // kv_heads)
    logits = torch.einsum("bihd,bjhd->bhij", q.to(dtype), k.to(dtype)[:, :, kv_head_of]) * scale
    if bias is not None:
        logits = logits + bias.to(dtype)
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(logits, dim=-1), v.to(dtype)[:, :, kv_head_of])
    return out.to(q.dtype).contiguous()


def bidirectional_attention_fake(q, k, v, scale, bias=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


bidirectional_attention = register_op(
    "bidirectional_attention",
    bidirectional_attention_reference,
    bidirectional_attention_fake,
    example_inputs=(torch.ones(1, 3, 4, 8, dtype=torch.bfloat16), torch.ones(1, 3, 2, 8, dtype=torch.bfloat16),
                    torch.ones(1, 3, 2, 6, dtype=torch.bfloat16), 8**-0.5),
)


def bidirectional_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch's ``scaled_dot_product_attention`` (flash or memory-efficient kernels on a GPU) on ``[B, H, S, D]`` views;
    a ``bias`` is its float ``attn_mask`` (which SDPA adds to the scaled logits)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).contiguous()


def _sdpa_supports(q, k, v, scale, bias=None, *, device):
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k and v differ in dtype ({q.dtype}, {k.dtype}, {v.dtype})"
    if bias is not None and bias.dtype != q.dtype:  # SDPA takes a float mask in the queries' dtype only
        return f"the bias is {bias.dtype}, q {q.dtype}"
    return True


register_backend("bidirectional_attention", "sdpa", bidirectional_attention_sdpa, supports=_sdpa_supports)
