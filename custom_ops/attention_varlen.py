"""The ``varlen`` backend of the canonical causal ``attention`` in its packed form (``seq_start``: a decoder embedding
model's texts in one row, ``autodeploy/export/encoder_only.py``): flash attention's variable-length kernel through
``aten::_flash_attention_forward`` (``bidirectional_attention.flash_varlen``), causal, with its window ``(W - 1, 0)`` for a
sliding window of ``W``."""

from typing import List, Optional

import torch

from .bidirectional_attention import flash_varlen, flash_varlen_refusal
from .registry import register_backend


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: Optional[int] = None,
                     logit_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     alibi_slopes: Optional[List[float]] = None, bias: Optional[torch.Tensor] = None,
                     seq_start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[1, T, H, D]`` packed texts, each attending causally to itself (``flash_varlen``, causal, its window ``(W - 1,
    0)`` for a sliding window of ``W``)."""
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    return flash_varlen(q, k, v, seq_start, scale, window, causal=True)


def _supports(q, k, v, scale, sliding_window=None, logit_cap=None, sinks=None, alibi_slopes=None, bias=None, seq_start=None,
              *, device):
    extras = [name for name, value in (("soft-capping", logit_cap), ("sinks", sinks), ("ALiBi", alibi_slopes), ("a bias", bias))
              if value is not None]
    if extras:
        return f"flash attention's varlen kernel has no {', '.join(extras)}"
    return flash_varlen_refusal(q, k, v, seq_start, device, windowed=True) or True


register_backend("attention", "varlen", attention_varlen, supports=_supports)
