"""fp8 activations rounded where they are made: a norm or gated activation that writes e4m3 rows for an fp8 GEMM.

``fp8_linear`` rounds its input per token (``quantize_activations_fp8``) before its product: one more
kernel that reads the activations and writes them again at a quarter of their bytes. The norm before
q/k/v and gate/up, and the gated activation before down, already hold each row whole; they can round it
as they write it. The ``fuse_fp8_quantization`` transform rewrites

- ``fp8_linear(add_rms_norm(x, residual)[0])`` to ``fp8_prequantized_linear(*add_rms_norm_fp8(x, residual)[:2])``
  (the sum, ``add_rms_norm_fp8(...)[2]``, feeds the residual stream as before);
- ``fp8_linear(gated_activation(gate, up))`` to ``fp8_prequantized_linear(*gated_activation_fp8(gate, up))``.

Each op's reference is the unfused ops' references composed, so a fused graph computes exactly the bits
of the unfused one: the norm or activation rounded to the model's dtype, then each row's max |x| / 448 as
its scale and ``x / scale`` to e4m3.

Example::

    import torch
    from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight

    x, residual = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    stored = quantize_weight(QuantScheme("fp8"), torch.randn(4, 8))
    ops = torch.ops.autodeploy
    x_q, x_scale, total = ops.add_rms_norm_fp8(x, residual, torch.ones(8), 1e-6)
    out = ops.fp8_prequantized_linear(x_q, x_scale, stored["qweight"], stored["scale"], None, torch.bfloat16)
    normed, _ = ops.add_rms_norm(x, residual, torch.ones(8), 1e-6)
    assert torch.equal(out, ops.fp8_linear(normed, stored["qweight"], stored["scale"], None))
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .add_rms_norm import add_rms_norm_reference
from . import quantization  # noqa: F401  (registers the fp8 scheme that QuantScheme("fp8") names below)
from .compute_dtype import compute_dtype
from .gated_activation import gated_activation_reference
from .quantized_linear import (
    QuantScheme,
    check_linear,
    dequantize_weight,
    quantize_activations_fp8,
    quantize_weight,
    scaled_mm_rows,
    scaled_mm_supports,
)
from .registry import register_backend, register_op


def add_rms_norm_fp8_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_q, x_scale, total)``: ``add_rms_norm``'s norm (rounded to ``x``'s dtype) quantized per token,
    e4m3 ``[..., H]`` and float32 scales ``[..., 1]`` (``quantize_activations_fp8``), and its sum
    ``x + residual`` in ``x``'s dtype. Arguments as ``add_rms_norm``'s."""
    normed, total = add_rms_norm_reference(x, residual, weight, eps, weight_offset)
    x_q, x_scale = quantize_activations_fp8(normed)
    return x_q, x_scale, total


def add_rms_norm_fp8_fake(x, residual, weight, eps, weight_offset=0.0):
    return _fp8_rows_fake(x) + (x.new_empty(x.shape),)


def gated_activation_fp8_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, x_scale)``: ``gated_activation(gate, up, activation)`` (rounded to ``gate``'s dtype) quantized
    per token, e4m3 ``[..., I]`` and float32 scales ``[..., 1]``."""
    return quantize_activations_fp8(gated_activation_reference(gate, up, activation))


def gated_activation_fp8_fake(gate, up, activation):
    return _fp8_rows_fake(gate)


def _fp8_rows_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def fp8_prequantized_linear_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``fp8_linear`` over activations already quantized per token (``x_q [..., K]`` e4m3, ``x_scale
    [..., 1]`` float32): ``F.linear(x_q · x_scale, qweight · scale, bias)`` computed in float32 (float64
    for a float64 ``dtype``), returned ``[..., N]`` in ``dtype``, the dtype of the activations before they
    were rounded. Equal to ``fp8_linear(x, ...)`` when ``(x_q, x_scale) = quantize_activations_fp8(x)``."""
    check_linear("fp8_prequantized_linear", x_q, qweight.shape[0], qweight.shape[1], bias)
    if x_q.dtype != torch.float8_e4m3fn or x_scale.shape != (*x_q.shape[:-1], 1):
        raise ValueError(f"fp8_prequantized_linear: x_q must be float8_e4m3fn [..., K] and x_scale [..., 1]; got "
                         f"x_q {tuple(x_q.shape)} {x_q.dtype}, x_scale {tuple(x_scale.shape)}.")
    compute = compute_dtype(dtype)
    activations = x_q.to(compute) * x_scale.to(compute)
    weight = dequantize_weight(QuantScheme("fp8"), {"qweight": qweight, "scale": scale}, compute)
    return F.linear(activations, weight, None if bias is None else bias.to(compute)).to(dtype)


def fp8_prequantized_linear_fake(x_q, x_scale, qweight, scale, bias, dtype):
    return x_q.new_empty((*x_q.shape[:-1], qweight.shape[0]), dtype=dtype)


_EXAMPLE = torch.linspace(-2.0, 2.0, 16, dtype=torch.bfloat16).reshape(2, 8)
_FP8 = quantize_weight(QuantScheme("fp8"), torch.linspace(-1.0, 1.0, 32).reshape(4, 8))
add_rms_norm_fp8 = register_op(
    "add_rms_norm_fp8", add_rms_norm_fp8_reference, add_rms_norm_fp8_fake,
    example_inputs=(_EXAMPLE, _EXAMPLE.flip(0), torch.ones(8), 1e-6),
)
gated_activation_fp8 = register_op(
    "gated_activation_fp8", gated_activation_fp8_reference, gated_activation_fp8_fake,
    example_inputs=(_EXAMPLE, _EXAMPLE.flip(0), "silu"),
)
fp8_prequantized_linear = register_op(
    "fp8_prequantized_linear", fp8_prequantized_linear_reference, fp8_prequantized_linear_fake,
    example_inputs=(*quantize_activations_fp8(_EXAMPLE), _FP8["qweight"], _FP8["scale"], None, torch.bfloat16),
)


def fp8_prequantized_linear_torch(x_q, x_scale, qweight, scale, bias, dtype):
    """``torch._scaled_mm`` with row-wise scales (cuBLASLt on Hopper), as ``fp8_linear``'s ``torch`` backend
    after its rounding."""
    return scaled_mm_rows(x_q, x_scale, qweight, scale, bias, dtype)


register_backend("fp8_prequantized_linear", "torch", fp8_prequantized_linear_torch, supports=lambda x_q, x_scale, qweight, scale, bias, dtype, *, device: scaled_mm_supports(dtype, qweight, bias, device))
