"""``torch.ops.autodeploy.rope``: rotary position embedding of one q or k tensor, full or partial."""

import torch

from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``R`` dims of every head of ``x[B, S, H, D]`` by the angles in ``cos``/``sin[B, S, R]``.

    ``R = cos.shape[-1]`` must be even and at most ``D``; ``x[..., R:]`` passes through unchanged
    (partial rotary). ``cos``/``sin`` are shared by all heads and broadcast over ``B``/``S`` if those are 1.

    - ``interleaved=False`` (rotate-half, HF Llama): ``x_r = x[..., :R]``,
      ``out = x_r * cos + rotate_half(x_r) * sin`` with ``rotate_half(v) = cat(-v[..., R/2:], v[..., :R/2])``;
      cos/sin in HF's duplicated-halves layout (``cos[..., i] == cos[..., i + R/2]``).
    - ``interleaved=True`` (GPT-J style): dims ``(2i, 2i+1)`` form pair ``i``:
      ``out[2i] = x[2i]·cos - x[2i+1]·sin``, ``out[2i+1] = x[2i+1]·cos + x[2i]·sin``;
      cos/sin repeat-interleaved (``cos[..., 2i] == cos[..., 2i+1]``).

    RoPE scaling (llama3, linear, dynamic, yarn) is already in cos/sin. Computed in float32 (float64 for
    float64 inputs); returns ``x``'s shape and dtype.
    """
    rotary_dim = cos.shape[-1]
    if x.dim() != 4:
        raise ValueError(f"rope: x must be [B, S, H, D]; got shape {tuple(x.shape)}.")
    if sin.shape != cos.shape or cos.dim() != 3:
        raise ValueError(f"rope: cos and sin must both be [B, S, R]; got {tuple(cos.shape)} and {tuple(sin.shape)}.")
    if any(c not in (1, n) for c, n in zip(cos.shape[:2], x.shape[:2])):
        raise ValueError(
            f"rope: cos/sin [B, S] dims {tuple(cos.shape[:2])} must equal x's {tuple(x.shape[:2])} or be 1."
        )
    if rotary_dim % 2 != 0 or rotary_dim == 0 or rotary_dim > x.shape[-1]:
        raise ValueError(
            f"rope: rotary dim R={rotary_dim} must be even, positive and at most head dim D={x.shape[-1]}."
        )

    dtype = compute_dtype(x.dtype)
    x_rot = x[..., :rotary_dim].to(dtype)
    x_pass = x[..., rotary_dim:].to(dtype)
    cos = cos.to(dtype).unsqueeze(2)  # [B, S, 1, R]: the same angles for every head
    sin = sin.to(dtype).unsqueeze(2)
    out = x_rot * cos + _rotated(x_rot, interleaved) * sin
    return torch.cat((out, x_pass), dim=-1).to(x.dtype)


def _rotated(x_rot: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of every rotated dim, signed: ``(-x[2i+1], x[2i])`` pairs, or ``rotate_half``."""
    if interleaved:
        evens, odds = x_rot[..., 0::2], x_rot[..., 1::2]
        return torch.stack((-odds, evens), dim=-1).flatten(-2)
    first, second = x_rot.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_fake(x, cos, sin, interleaved=False):
    return x.new_empty(x.shape)


rope = register_op(
    "rope",
    rope_reference,
    rope_fake,
    example_inputs=(torch.ones(1, 2, 3, 8, dtype=torch.bfloat16), torch.ones(1, 2, 4), torch.zeros(1, 2, 4)),
)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``rope`` element-wise in ``x``'s dtype; same arguments and result as the reference.

    cos/sin are cast to ``x``'s dtype first, as HF's rotary embeddings do (they are [B, S, R], no weight).
    """
    rotary_dim = cos.shape[-1]
    cos = cos.to(x.dtype).unsqueeze(2)  # [B, S, 1, R]: the same angles for every head
    sin = sin.to(x.dtype).unsqueeze(2)
    x_rot = x[..., :rotary_dim]
    out = x_rot * cos + _rotated(x_rot, interleaved) * sin
    if rotary_dim == x.shape[-1]:
        return out.contiguous()  # element-wise ops follow x's layout; the reference's output is contiguous
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


register_backend("rope", "torch", rope_torch)
