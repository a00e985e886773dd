"""``torch.ops.autodeploy.rms_norm``: RMSNorm over the last dim (Llama; Gemma with ``weight_offset=1.0``)."""

import torch

from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """RMS normalisation of ``x[..., H]`` scaled by ``weight[H] + weight_offset``.

    ``y = x.float() * rsqrt(mean(x.float()², -1) + eps)``;
    ``out = (y * (weight.float() + weight_offset)).to(x.dtype)``. Gemma stores ``weight - 1`` and uses
    ``weight_offset=1.0``. Computed in float32 (float64 for float64 inputs); returns ``x``'s shape and dtype.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight must be [H={x.shape[-1]}] for x {tuple(x.shape)}; got {tuple(weight.shape)}."
        )
    dtype = compute_dtype(x.dtype)
    x_up = x.to(dtype)
    normalised = x_up * torch.rsqrt(x_up.pow(2).mean(-1, keepdim=True) + eps)
    # Element-wise ops follow x's memory layout; the fake promises a contiguous output.
    return (normalised * (weight.to(dtype) + weight_offset)).to(x.dtype).contiguous()


def rms_norm_fake(x, weight, eps, weight_offset=0.0):
    return x.new_empty(x.shape)


rms_norm = register_op(
    "rms_norm",
    rms_norm_reference,
    rms_norm_fake,
    example_inputs=(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6),
)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """``torch.rms_norm`` in ``x``'s dtype; same arguments and result as the reference.

    Its fused kernel reduces and scales in float32 internally and rounds once, as the reference does
    (bit-equal to it for bfloat16 on CPUs without ``weight_offset``, measured), without a float32 copy of ``x``.
    """
    scale = weight + weight_offset if weight_offset else weight  # Gemma's offset: an [H] add in weight's dtype
    return torch.rms_norm(x, x.shape[-1:], scale, eps).contiguous()


def _rms_norm_torch_supports(x, weight, eps, weight_offset=0.0, *, device):
    if weight.dtype != x.dtype:  # torch.rms_norm then falls back to an unfused, upcasting formula
        return f"weight dtype {weight.dtype} differs from x's {x.dtype}"
    return True


register_backend("rms_norm", "torch", rms_norm_torch, supports=_rms_norm_torch_supports)
