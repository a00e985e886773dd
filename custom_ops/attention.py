"""``torch.ops.autodeploy.attention``: causal self-attention with GQA, sliding window, soft-capping, sinks, ALiBi and an
additive bias (T5's relative position bias)."""

from typing import List, Optional

import torch

from .compute_dtype import compute_dtype
from .registry import register_op


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    logit_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[List[float]] = None,
    bias: Optional[torch.Tensor] = None,
    seq_start: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of ``q[B, S, Hq, D]`` over ``k[B, S, Hkv, D]``, ``v[B, S, Hkv, Dv]`` → ``[B, S, Hq, Dv]``.

    - logits: ``scale · q_i · k_j`` per head, in float32 (float64 for float64 inputs), plus with ALiBi
      (``alibi_slopes``, one per query head) ``slope_h · (j - i)``: Bloom's ``slope · j`` and MPT's
      ``slope · (j - S + 1)`` differ from it by a constant per query, which softmax does not see; plus ``bias``
      (``[1 or B, 1 or Hq, S, S]``, added as given: T5's relative position bias, ``relative_position_bias``).
    - GQA: ``Hq`` must be a multiple of ``Hkv``; query head ``h`` uses kv head ``h // (Hq // Hkv)``.
    - soft-capping (``logit_cap``, > 0): ``logits = cap · tanh(logits / cap)``, applied before masking.
    - mask: query ``i`` sees key ``j`` iff ``j ≤ i`` and, with ``sliding_window = W`` (≥ 1), ``i - W < j``.
    - sinks (``sinks[Hq]``): one logit per head that joins the softmax denominator only:
      ``p_ij = exp(l_ij) / (exp(sink_h) + Σ_j' exp(l_ij'))``; it has no value, so the weights sum to < 1.
    - ``out_i = Σ_j p_ij · v_j``, returned in ``q``'s dtype.

    - packed (``seq_start``, int ``[N + 1]``, the cumulative starts of N texts along ``S``, with ``B`` 1): each query
      also sees only the keys of its own text (a decoder embedding model's texts in one row; the cache stage never
      sees this form). Positions are the row's, so a window or ALiBi counts the same distances as within the text.

    q, k and v share ``B`` and ``S``: this is the un-cached form; the cache stage replaces it.
    """
    batch, seq, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if k.shape != (batch, seq, kv_heads, head_dim) or v.shape[:3] != (batch, seq, kv_heads):
        raise ValueError(
            f"attention: expected k [B, S, Hkv, D] and v [B, S, Hkv, Dv] matching q {tuple(q.shape)}; "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}."
        )
    if q_heads % kv_heads != 0:
        raise ValueError(f"attention: query heads Hq={q_heads} must be a multiple of kv heads Hkv={kv_heads}.")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"attention: sliding_window must be ≥ 1 (or None for no window); got {sliding_window}.")
    if logit_cap is not None and not logit_cap > 0:
        raise ValueError(f"attention: logit_cap must be > 0 (or None for no capping); got {logit_cap}.")
    if sinks is not None and sinks.shape != (q_heads,):
        raise ValueError(f"attention: sinks must be [Hq={q_heads}]; got {tuple(sinks.shape)}.")
    check_alibi_slopes("attention", alibi_slopes, q_heads)
    check_bias("attention", bias, batch, q_heads, seq, seq)
    same_text = None
    if seq_start is not None:
        if batch != 1 or seq_start.dim() != 1 or seq_start.numel() < 2 or int(seq_start[0]) != 0 or int(seq_start[-1]) != seq \
                or bool((seq_start[1:] < seq_start[:-1]).any()):
            raise ValueError(f"attention: seq_start must be the non-decreasing starts 0 … S={seq} of texts packed in a batch "
                             f"of one; got {seq_start.tolist()} for batch {batch}.")
        text = torch.searchsorted(seq_start.to(q.device), torch.arange(seq, device=q.device, dtype=seq_start.dtype), right=True)
        same_text = text[:, None] == text[None, :]

    positions = torch.arange(seq, device=q.device)
    return attend(q, k, v, positions, positions, scale, sliding_window, logit_cap, sinks, alibi_slopes, visible_also=same_text,
                  bias=bias)


def check_alibi_slopes(op: str, alibi_slopes: Optional[List[float]], q_heads: int) -> None:
    if alibi_slopes is not None and len(alibi_slopes) != q_heads:
        raise ValueError(f"{op}: alibi_slopes must have one slope per query head (Hq={q_heads}); got {len(alibi_slopes)}.")


def check_bias(op: str, bias: Optional[torch.Tensor], batch: int, heads: int, queries: int, keys: int) -> None:
    """An additive bias must broadcast to the logits ``[B, H, Sq, Sk]`` over its batch and head dims only."""
    if bias is None:
        return
    if bias.dim() != 4 or bias.shape[0] not in (1, batch) or bias.shape[1] not in (1, heads) or tuple(bias.shape[2:]) != (queries, keys):
        raise ValueError(f"{op}: bias must be [1 or B={batch}, 1 or H={heads}, Sq={queries}, Sk={keys}]; got {tuple(bias.shape)}.")


def visible_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: Optional[int] = None,
                 last_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[Sq, Sk]``: which keys each query sees — those up to its position (or up to ``last_keys``, where past it)
    and, with a window, fewer than ``sliding_window`` back from its position."""
    query_pos, key_pos = query_positions[:, None], key_positions[None, :]
    visible = key_pos <= (query_pos if last_keys is None else torch.maximum(query_pos, last_keys[:, None]))
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return visible


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
    logit_cap: Optional[float],
    sinks: Optional[torch.Tensor],
    alibi_slopes: Optional[List[float]] = None,
    visible_also: Optional[torch.Tensor] = None,
    last_keys: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The attention arithmetic shared by the un-cached and cached references: ``q[B, Sq, Hq, D]`` at
    ``query_positions[Sq]`` over ``k[B, Sk, Hkv, D]``/``v`` at ``key_positions[Sk]``, masked causally
    (and by the window) on those absolute positions, and by ``visible_also[Sq, Sk]`` where given (a tree
    verification's: ``cached_attention``'s ``tree_mask``). ``last_keys[Sq]``: the last key position each query
    sees, where past its own (a bidirectional block's: ``cached_attention``'s ``attend_until``); the window
    still counts back from the query's own position. ``bias`` (broadcast to ``[B, Hq, Sq, Sk]``) is added to the
    logits with ALiBi's, before soft-capping. Every query must see at least one key."""
    batch, _, q_heads, _ = q.shape
    kv_heads = k.shape[2]
    dtype = compute_dtype(q.dtype)
    kv_head_of = torch.arange(q_heads, device=q.device) // (q_heads // kv_heads)
    keys = k.to(dtype)[:, :, kv_head_of]  # [B, Sk, Hq, D]
    values = v.to(dtype)[:, :, kv_head_of]  # [B, Sk, Hq, Dv]
    logits = torch.einsum("bihd,bjhd->bhij", q.to(dtype), keys) * scale  # [B, Hq, Sq, Sk]
    if alibi_slopes is not None:
        slopes = torch.tensor(alibi_slopes, dtype=dtype, device=q.device).view(1, q_heads, 1, 1)
        logits = logits + slopes * (key_positions[None, :] - query_positions[:, None]).to(dtype)
    if bias is not None:
        logits = logits + bias.to(dtype)
    if logit_cap is not None:
        logits = logit_cap * torch.tanh(logits / logit_cap)

    visible = visible_keys(query_positions, key_positions, sliding_window, last_keys)
    if visible_also is not None:
        visible &= visible_also
    logits = logits.masked_fill(~visible, float("-inf"))

    if sinks is not None:
        sink_logits = sinks.to(dtype).view(1, q_heads, 1, 1).expand(batch, q_heads, logits.shape[2], 1)
        probs = torch.softmax(torch.cat((logits, sink_logits), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", probs, values)
    return out.to(q.dtype).contiguous()


def attention_fake(q, k, v, scale, sliding_window=None, logit_cap=None, sinks=None, alibi_slopes=None, bias=None, seq_start=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


attention = register_op(
    "attention",
    attention_reference,
    attention_fake,
    example_inputs=(
        torch.ones(1, 3, 4, 8, dtype=torch.bfloat16),
        torch.ones(1, 3, 2, 8, dtype=torch.bfloat16),
        torch.ones(1, 3, 2, 6, dtype=torch.bfloat16),
        8**-0.5,
    ),
)
