"""``int4_awq``: ``int4_wo``'s storage for ``w · diag(s)`` and ``smooth = 1 / s`` float32 ``[K]``, the op
(``int4_awq_linear``) computing ``x · smooth`` first (activation-aware: AWQ).

``s = a^α`` from the mean ``|x|`` of each input channel over calibration text (``a``), normalised, with ``α``
searched over 0, 0.1, …, 1 for the least error ``Σ_k E[x_k²] · Σ_n (w − ŵ)²_nk``. ``α = 0`` is
round-to-nearest, so it never does worse by that measure. compressed-tensors has no field for the smoothing:
``autodeploy quantize`` refuses it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..compute_dtype import compute_dtype
from ..quantized_linear import QuantMethod, QuantScheme, native_dtype_supports, quantize_weight, register_scheme
from ..registry import register_backend, register_op
from .int4_wo import check_groups, dequantize_int4_groups, int4_fake, int4_wo_linear_reference, int4_wo_linear_torch, quantize_int4_groups


@register_scheme
class Int4Awq(QuantMethod):
    name = "int4_awq"

    def statistics(self, scheme):
        return frozenset({"mean_abs", "mean_square"})

    def check_shape(self, scheme, shape):
        return check_groups(scheme, shape)

    def quantize(self, scheme, w, statistics):
        if statistics is None:
            raise ValueError("int4_awq needs the layer's calibration statistics (mean_abs, mean_square)")
        if w.device.type == "meta":  # shapes only (the quantize stage, before weights exist)
            return {**quantize_int4_groups(w, scheme.group_size), "smooth": torch.empty(w.shape[1], device="meta")}
        mean_abs = statistics["mean_abs"].to(w.device, torch.float32).clamp(min=1e-8)
        weights = statistics["mean_square"].to(w.device, torch.float32)
        best = None
        for step in range(11):
            s = mean_abs.pow(step / 10)
            s = (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)
            stored = quantize_int4_groups(w * s[None, :], scheme.group_size)
            error = ((dequantize_int4_groups(stored, torch.float32) / s[None, :] - w).square().sum(0) * weights).sum()
            if best is None or error < best[0]:
                best = (error, stored, s)
        _, stored, s = best
        return {**stored, "smooth": (1.0 / s).contiguous()}

    def dequantize(self, scheme, stored, dtype):
        return dequantize_int4_groups(stored, dtype) * stored["smooth"].to(dtype)[None, :]

    def op(self, scheme):
        return torch.ops.autodeploy.int4_awq_linear.default


def int4_awq_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, smooth: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """``int4_wo_linear(x · smooth, …)``: AWQ's 4-bit weights of ``w · diag(1 / smooth)`` over inputs scaled by
    ``smooth`` float32 ``[K]``; returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    if smooth.shape != (x.shape[-1],):
        raise ValueError(f"int4_awq_linear: smooth must be [K={x.shape[-1]}]; got {tuple(smooth.shape)}.")
    dtype = compute_dtype(x.dtype)
    smoothed = x.to(dtype) * smooth.to(dtype)
    return int4_wo_linear_reference(smoothed, qweight, scale, zero, None if bias is None else bias.to(dtype)).to(x.dtype)


_EXAMPLE = quantize_weight(QuantScheme("int4_awq", group_size=4), torch.linspace(-1.0, 1.0, 32).reshape(4, 8),
                           {"mean_abs": torch.linspace(0.5, 2.0, 8), "mean_square": torch.linspace(0.5, 4.0, 8)})
int4_awq_linear = register_op(
    "int4_awq_linear", int4_awq_linear_reference, lambda x, qweight, scale, zero, smooth, bias: int4_fake(x, qweight, scale, zero, bias),
    example_inputs=(torch.ones(2, 8), _EXAMPLE["qweight"], _EXAMPLE["scale"], _EXAMPLE["zero"], _EXAMPLE["smooth"], None),
)
register_backend("int4_awq_linear", "torch", lambda x, qweight, scale, zero, smooth, bias: int4_wo_linear_torch(
    x * smooth.to(x.dtype), qweight, scale, zero, bias), supports=native_dtype_supports)
