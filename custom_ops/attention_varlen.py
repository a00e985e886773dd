"""The ``varlen`` backend of the canonical causal ``attention`` in its packed form (``seq_start``: a decoder embedding
model's texts in one row, ``autodeploy/export/encoder_only.py``): flash attention's variable-length kernel through
PyTorch's ``varlen_attn``, causal by its window ``(-1, 0)`` (or ``(W - 1, 0)`` for a sliding window of ``W``)."""

from typing import List, Optional

import torch

from .bidirectional_attention import FLASH_MAX_HEAD_DIM, _varlen_attn
from .registry import register_backend


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: Optional[int] = None,
                     logit_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     alibi_slopes: Optional[List[float]] = None, bias: Optional[torch.Tensor] = None,
                     seq_start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[1, T, H, D]`` packed texts, each attending causally to itself. The longest text is bounded by ``T`` (at least
    2), so nothing is read on the host (``bidirectional_attention_varlen`` says why)."""
    cu_seqlens = seq_start.to(device=q.device, dtype=torch.int32).contiguous()
    longest = max(q.shape[1], 2)
    window = (-1 if sliding_window is None else sliding_window - 1, 0)
    out = _varlen_attn()(q[0], k[0], v[0], cu_seqlens, cu_seqlens, longest, longest, scale=scale, window_size=window,
                         enable_gqa=q.shape[2] != k.shape[2])
    return out.unsqueeze(0)


def _supports(q, k, v, scale, sliding_window=None, logit_cap=None, sinks=None, alibi_slopes=None, bias=None, seq_start=None,
              *, device):
    device = torch.device(device)
    if device.type != "cuda":
        return f"varlen_attn (flash attention) runs on CUDA GPUs only (the deploy runs on {device.type})"
    if seq_start is None:
        return "varlen_attn serves packed texts (seq_start) only; the cache stage serves the rest"
    extras = [name for name, value in (("soft-capping", logit_cap), ("sinks", sinks), ("ALiBi", alibi_slopes), ("a bias", bias))
              if value is not None]
    if extras:
        return f"flash attention's varlen kernel has no {', '.join(extras)}"
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"flash attention takes float16 or bfloat16 q, k and v (got {q.dtype}, {k.dtype}, {v.dtype})"
    head_dim = q.shape[-1]
    if v.shape[-1] != head_dim or head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash attention needs one head dim for q, k and v, a multiple of 8 up to {FLASH_MAX_HEAD_DIM}"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "flash attention needs q, k and v with a contiguous last dim"
    if _varlen_attn() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn taking scale= and enable_gqa="
    if not torch.backends.cuda.is_flash_attention_available() or torch.cuda.get_device_capability(device)[0] < 8:
        return "flash attention needs a PyTorch build with it and an Ampere or later GPU (sm80+)"
    return True


register_backend("attention", "varlen", attention_varlen, supports=_supports)
