"""``torch.ops.autodeploy.linear``: a dense projection."""

from typing import Optional

import torch
import torch.nn.functional as F

from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``out[..., n] = Σ_k x[..., k] · weight[n, k] + bias[n]``.

    Layouts: ``x[..., K]``, ``weight[N, K]`` (PyTorch's ``nn.Linear`` layout), ``bias[N]`` or None.
    Returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 inputs).
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"linear: weight must be [N, K={x.shape[-1]}] for x {tuple(x.shape)}; got {tuple(weight.shape)}."
        )
    dtype = compute_dtype(x.dtype)
    out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return out.to(x.dtype)


def linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


linear = register_op(
    "linear",
    linear_reference,
    linear_fake,
    example_inputs=(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4)),
)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the inputs' own dtype (cuBLAS on GPUs); same result as the reference."""
    return F.linear(x, weight, bias)


def _linear_torch_supports(x, weight, bias, *, device):
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"weight/bias dtype differs from x's {x.dtype} (computes in one native dtype)"
    return True


register_backend("linear", "torch", linear_torch, supports=_linear_torch_supports)
