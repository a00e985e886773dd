"""``int8_wo``: int8 weights, activations in the model's dtype (weight-only).

``qweight`` int8 ``[N, K]`` and ``scale`` float32 ``[N]``, symmetric per output channel:
``w ≈ qweight · scale``, ``scale = max|w[n]| / 127``. The op is ``int8_wo_linear`` (a Triton GEMV in
``triton_backends.py``); MoE experts take it expert by expert (``moe_int8_wo``). compressed-tensors stores it
pack-quantized: ``weight_packed`` (four values an int32), ``weight_scale`` ``[N, 1]``, ``weight_shape``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..compute_dtype import compute_dtype
from ..quantized_linear import (
    INT8_MAX,
    QuantMethod,
    QuantScheme,
    check_linear,
    dequantize_weight,
    native_dtype_supports,
    quantize_weight,
    register_scheme,
    safe_scale,
)
from ..quantized_tensors import FLOAT_SCALES, CheckpointLayer, checkpoint_scheme, require_compressed_tensors
from ..registry import register_backend, register_op


def quantize_int8_rows(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``int8_wo``'s tensors for a float32 ``w[N, K]``: a symmetric scale per row."""
    scale = safe_scale(w.abs().amax(dim=1) / INT8_MAX)
    qweight = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {"qweight": qweight, "scale": scale}


def dequantize_int8_rows(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return stored["qweight"].to(dtype) * stored["scale"].to(dtype)[:, None]


def read_int8_rows(layer: CheckpointLayer) -> dict[str, torch.Tensor]:
    """int8 rows and their scales from compressed-tensors' int-quantized or pack-quantized layout."""
    rows, columns = layer.shape
    if "weight_packed" in layer.tensors:  # pack-quantized: four int8 values a word
        require_compressed_tensors()
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed = layer.tensor("weight_packed", (torch.int32,), ((rows, -(-columns // 4)),))
        qweight = unpack_from_int32(packed, 8, torch.Size((rows, columns)))
    else:
        qweight = layer.tensor("weight", (torch.int8,), ((rows, columns),))
    scale = layer.tensor("weight_scale", FLOAT_SCALES, ((rows, 1), (rows,)))
    return {"qweight": qweight, "scale": scale.to(torch.float32).reshape(-1)}


def is_int8_channel_weights(weights, fmt: str) -> bool:
    """Whether compressed-tensors ``weights`` in format ``fmt`` are int8, symmetric, one scale per channel."""
    return (str(weights.type) == "int" and int(weights.num_bits) == 8 and str(weights.strategy) == "channel"
            and weights.symmetric and fmt in ("int-quantized", "pack-quantized", "naive-quantized"))


@register_scheme
class Int8WeightOnly(QuantMethod):
    name = "int8_wo"
    expert_ops = ("moe_int8_wo", "moe_expert_parallel_int8_wo")

    def quantize(self, scheme, w, statistics):
        return quantize_int8_rows(w)

    def dequantize(self, scheme, stored, dtype):
        return dequantize_int8_rows(stored, dtype)

    def op(self, scheme):
        return torch.ops.autodeploy.int8_wo_linear.default

    def row_wise_ops(self):
        return {torch.ops.autodeploy.int8_wo_linear.default: ()}

    def row_scaled_ops(self):
        return {torch.ops.autodeploy.int8_wo_linear.default: 2}

    def compressed_tensors_args(self, scheme):
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True), None, "pack-quantized"

    def to_compressed_tensors(self, scheme, stored):
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        qweight = stored["qweight"]
        return {"weight_packed": pack_to_int32(qweight, 8), "weight_scale": stored["scale"].to(torch.float32).reshape(-1, 1),
                "weight_shape": torch.tensor(list(qweight.shape))}

    def from_compressed_tensors(self, weights, inputs, fmt, where):
        if inputs is None and is_int8_channel_weights(weights, fmt):
            return checkpoint_scheme(self.name, f"{where} (format {fmt}, weights {weights}, input activations {inputs})"), None
        return None

    def read_compressed_tensors(self, layer):
        return read_int8_rows(layer)


def int8_wo_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``F.linear(x, qweight · scale[:, None], bias)``: int8 weights ``[N, K]`` with a float32 scale per output
    channel ``[N]``; returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    check_linear("int8_wo_linear", x, qweight.shape[0], qweight.shape[1], bias)
    dtype = compute_dtype(x.dtype)
    weight = dequantize_weight(QuantScheme("int8_wo"), {"qweight": qweight, "scale": scale}, dtype)
    return F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype)).to(x.dtype)


_EXAMPLE = quantize_weight(QuantScheme("int8_wo"), torch.linspace(-1.0, 1.0, 32).reshape(4, 8))
int8_wo_linear = register_op(
    "int8_wo_linear", int8_wo_linear_reference, lambda x, qweight, scale, bias: x.new_empty((*x.shape[:-1], qweight.shape[0])),
    example_inputs=(torch.ones(2, 8), _EXAMPLE["qweight"], _EXAMPLE["scale"], torch.zeros(4)),
)


def int8_wo_linear_torch(x, qweight, scale, bias):
    """gpt-fast's int8 weight-only linear: ``F.linear(x, qweight.to(x.dtype)) * scale`` in ``x``'s dtype."""
    out = F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


register_backend("int8_wo_linear", "torch", int8_wo_linear_torch, supports=native_dtype_supports)
