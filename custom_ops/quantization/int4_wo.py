"""``int4_wo``: 4-bit weights per group of inputs, activations in the model's dtype (weight-only).

``qweight`` uint8 ``[N, K/2]`` (two 4-bit values a byte, the even ``k`` in the low nibble), ``scale`` float32
and ``zero`` uint8 ``[N, K/group_size]``, asymmetric per group of ``group_size`` inputs (128 by default):
``w ≈ (q − zero) · scale`` with ``q, zero ∈ [0, 15]``. The op is ``int4_wo_linear`` (a dequantising Triton
GEMV in ``triton_backends.py``); MoE experts take it expert by expert (``moe_int4_wo``). ``int4_awq`` and
``int4_gptq`` store the same layout. compressed-tensors stores it pack-quantized, values and zero points
signed (``q − 8``): ``weight_packed``, ``weight_scale``, ``weight_zero_point``, ``weight_shape``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..compute_dtype import compute_dtype
from ..quantized_linear import (
    UINT4_MAX,
    QuantMethod,
    QuantScheme,
    check_linear,
    dequantize_weight,
    native_dtype_supports,
    pack_int4,
    quantize_weight,
    register_scheme,
    safe_scale,
    unpack_int4,
)
from ..quantized_tensors import FLOAT_SCALES, CheckpointLayer, checkpoint_scheme, nibbles, require_compressed_tensors
from ..registry import register_backend, register_op


def group_grid(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of ``int4_wo``'s asymmetric grid over the last dim of ``groups`` (``[..., G]``); the grid
    spans 0, so zero stays exact."""
    low, high = groups.amin(dim=-1).clamp(max=0.0), groups.amax(dim=-1).clamp(min=0.0)
    scale = safe_scale((high - low) / UINT4_MAX)
    return scale, torch.round(-low / scale).clamp_(0, UINT4_MAX)


def quantize_int4_groups(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """``int4_wo``'s tensors for a float32 ``w[N, K]``, rounding each value to its group's grid."""
    rows, columns = w.shape
    groups = w.reshape(rows, columns // group_size, group_size)
    scale, zero = group_grid(groups)
    q = torch.round(groups / scale[..., None] + zero[..., None]).clamp_(0, UINT4_MAX).to(torch.uint8)
    return {"qweight": pack_int4(q.reshape(rows, columns)), "scale": scale, "zero": zero.to(torch.uint8)}


def dequantize_int4_groups(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    scale = stored["scale"].to(dtype)
    q = unpack_int4(stored["qweight"]).to(dtype)
    rows, columns = q.shape
    group_size = columns // scale.shape[1]
    groups = q.reshape(rows, -1, group_size) - stored["zero"].to(dtype)[..., None]
    return (groups * scale[..., None]).reshape(rows, columns)


def check_groups(scheme: QuantScheme, shape: tuple[int, ...]) -> str | None:
    if shape[-1] % scheme.group_size:
        return f"{scheme.name} needs K ({shape[-1]}) to be a multiple of group_size {scheme.group_size}"
    return None


def int4_compressed_tensors_args(scheme: QuantScheme):
    from compressed_tensors.quantization import QuantizationArgs

    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=scheme.group_size, symmetric=False)
    return weights, None, "pack-quantized"


def int4_to_compressed_tensors(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed = (unpack_int4(stored["qweight"]).to(torch.int16) - 8).to(torch.int8)  # compressed-tensors' int4 range is [-8, 7]
    zero_point = (stored["zero"].to(torch.int16) - 8).to(torch.int8)
    return {"weight_packed": pack_to_int32(signed, 4), "weight_scale": stored["scale"].to(torch.float32),
            "weight_zero_point": pack_to_int32(zero_point, 4, packed_dim=0), "weight_shape": torch.tensor(list(signed.shape))}


@register_scheme
class Int4WeightOnly(QuantMethod):
    name = "int4_wo"
    expert_ops = ("moe_int4_wo", "moe_expert_parallel_int4_wo")

    def check_shape(self, scheme, shape):
        return check_groups(scheme, shape)

    def quantize(self, scheme, w, statistics):
        return quantize_int4_groups(w, scheme.group_size)

    def dequantize(self, scheme, stored, dtype):
        return dequantize_int4_groups(stored, dtype)

    def op(self, scheme):
        return torch.ops.autodeploy.int4_wo_linear.default

    def row_wise_ops(self):
        return {torch.ops.autodeploy.int4_wo_linear.default: ()}

    def compressed_tensors_args(self, scheme):
        return int4_compressed_tensors_args(scheme)

    def to_compressed_tensors(self, scheme, stored):
        return int4_to_compressed_tensors(stored)

    def from_compressed_tensors(self, weights, inputs, fmt, where):
        if (str(weights.type) == "int" and int(weights.num_bits) == 4 and str(weights.strategy) == "group"
                and fmt == "pack-quantized" and inputs is None):
            described = f"{where} (format {fmt}, weights {weights}, input activations {inputs})"
            return checkpoint_scheme(self.name, described, group_size=int(weights.group_size)), None
        return None

    def read_compressed_tensors(self, layer: CheckpointLayer):
        require_compressed_tensors()
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        from autodeploy.errors import CheckpointError

        rows, columns = layer.shape
        if "weight_shape" in layer.tensors and tuple(int(d) for d in layer.tensors["weight_shape"].tolist()) != layer.shape:
            raise CheckpointError(f"checkpoint tensor {layer.path}.weight_shape says {layer.tensors['weight_shape'].tolist()}, "
                                  f"but the model's layer is {list(layer.shape)}: does config.json match these weights?")
        packed = layer.tensor("weight_packed", (torch.int32,), ((rows, -(-columns // 8)),))
        signed = unpack_from_int32(packed, 4, torch.Size((rows, columns)))  # in [-8, 7]
        scale = layer.tensor("weight_scale", FLOAT_SCALES, ((rows, layer.groups),))
        if "weight_zero_point" in layer.tensors:  # asymmetric: zero points packed along the output dim
            zero_points = layer.tensor("weight_zero_point", (torch.int32,), ((-(-rows // 8), layer.groups),))
            # Unpacked here: compressed-tensors' unpack_from_int32 cannot read one packed row (a gate of fewer than 9
            # outputs, as Qwen2-MoE's shared-expert gate), whose transpose it cannot view as bytes. Nibbles hold value + 8.
            zero = nibbles(zero_points).transpose(1, 2).reshape(-1, layer.groups)[:rows].to(torch.int16)
        else:
            zero = torch.full((rows, layer.groups), 8, dtype=torch.int16)
        return {"qweight": pack_int4((signed.to(torch.int16) + 8).to(torch.uint8)), "scale": scale.to(torch.float32),
                "zero": zero.to(torch.uint8)}


def int4_wo_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``F.linear(x, (q − zero) · scale, bias)`` over packed 4-bit weights: ``qweight`` uint8 ``[N, K/2]``,
    ``scale`` float32 and ``zero`` uint8 ``[N, K/G]`` for groups of ``G = K / scale.shape[1]`` inputs;
    returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    rows, columns = qweight.shape[0], 2 * qweight.shape[1]
    check_linear("int4_wo_linear", x, rows, columns, bias)
    if scale.shape != zero.shape or scale.dim() != 2 or scale.shape[0] != rows or columns % scale.shape[1]:
        raise ValueError(
            f"int4_wo_linear: scale and zero must be [N={rows}, K/G] with G dividing K={columns}; "
            f"got {tuple(scale.shape)} and {tuple(zero.shape)}."
        )
    dtype = compute_dtype(x.dtype)
    stored = {"qweight": qweight, "scale": scale, "zero": zero}
    weight = dequantize_weight(QuantScheme("int4_wo", group_size=columns // scale.shape[1]), stored, dtype)
    return F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def int4_fake(x, qweight, scale, zero, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


_EXAMPLE = quantize_weight(QuantScheme("int4_wo", group_size=4), torch.linspace(-1.0, 1.0, 32).reshape(4, 8))
int4_wo_linear = register_op(
    "int4_wo_linear", int4_wo_linear_reference, int4_fake,
    example_inputs=(torch.ones(2, 8), _EXAMPLE["qweight"], _EXAMPLE["scale"], _EXAMPLE["zero"], None),
)


def int4_wo_linear_torch(x, qweight, scale, zero, bias):
    """The weight dequantized into ``x``'s dtype, then ``F.linear`` (cuBLAS on GPUs): a weight-sized temporary
    a call, the fallback for row counts past the dequantising GEMV's."""
    group_size = 2 * qweight.shape[1] // scale.shape[1]
    weight = dequantize_weight(QuantScheme("int4_wo", group_size=group_size), {"qweight": qweight, "scale": scale, "zero": zero}, x.dtype)
    return F.linear(x, weight, bias)


register_backend("int4_wo_linear", "torch", int4_wo_linear_torch, supports=native_dtype_supports)
