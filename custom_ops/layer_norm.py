"""``torch.ops.autodeploy.layer_norm``: LayerNorm over the last dim, optional affine weight and bias."""

from typing import Optional

import torch
import torch.nn.functional as F

from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def layer_norm_reference(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """``F.layer_norm(x, (H,), weight, bias, eps)`` over the last dim of ``x[..., H]``.

    ``out = (x - mean) / sqrt(var + eps) * weight + bias`` with the biased variance; ``weight[H]`` and
    ``bias[H]`` may each be None. Computed in float32 (float64 for float64 inputs), cast back to ``x``'s dtype.
    """
    hidden = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != x.shape[-1:]:
            raise ValueError(
                f"layer_norm: {name} must be [H={hidden}] for x {tuple(x.shape)}; got {tuple(param.shape)}."
            )
    dtype = compute_dtype(x.dtype)
    out = F.layer_norm(
        x.to(dtype),
        (hidden,),
        None if weight is None else weight.to(dtype),
        None if bias is None else bias.to(dtype),
        eps,
    )
    return out.to(x.dtype).contiguous()


def layer_norm_fake(x, weight, bias, eps):
    return x.new_empty(x.shape)


layer_norm = register_op(
    "layer_norm",
    layer_norm_reference,
    layer_norm_fake,
    example_inputs=(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), torch.zeros(4), 1e-5),
)


def layer_norm_torch(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """``F.layer_norm`` in ``x``'s dtype (its kernels keep the statistics in float32); same result as the reference."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps).contiguous()


def _layer_norm_torch_supports(x, weight, bias, eps, *, device):
    if any(t is not None and t.dtype != x.dtype for t in (weight, bias)):
        return f"weight/bias dtype differs from x's {x.dtype} (computes in one native dtype)"
    return True


register_backend("layer_norm", "torch", layer_norm_torch, supports=_layer_norm_torch_supports)
