"""``fp8``: float8_e4m3fn weights and activations.

``qweight`` float8_e4m3fn ``[N, K]`` and ``scale`` float32 ``[N]`` (``per_channel``) or ``[1]`` (per tensor),
``scale = max|w| / 448``. Activations are quantized the same way, per token, when the op runs (dynamic,
``fp8_linear``): ``x ≈ x_q · x_scale``, ``x_scale = max|x[t]| / 448``. With ``static_activations`` one
``input_scale`` float32 ``[1]`` per layer serves every token instead: the largest input the layer took over
calibration text, over 448 (``fp8_static_linear``; values past it saturate at ±448). Needs a GPU of compute
capability 8.9 or later. compressed-tensors stores it float-quantized: ``weight``, ``weight_scale`` (and
``input_scale`` when static); ModelOpt's FP8 checkpoints hold the same tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..compute_dtype import compute_dtype
from ..quantized_linear import (
    FP8_MAX,
    QuantMethod,
    QuantScheme,
    check_linear,
    dequantize_weight,
    quantize_activations_fp8,
    quantize_activations_fp8_static,
    quantize_weight,
    register_scheme,
    safe_scale,
    scaled_mm_rows,
    scaled_mm_supports,
)
from ..quantized_tensors import FLOAT_SCALES, CheckpointLayer, checkpoint_scheme
from ..registry import register_backend, register_op


def fake_quantize_activations_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` through the fp8 op's activation rounding, in ``x``'s dtype (what verification's reference applies):
    per token, or with the layer's static ``input_scale``."""
    if input_scale is not None:
        return (quantize_activations_fp8_static(x, input_scale).to(torch.float32) * input_scale.to(x.device)).to(x.dtype)
    x_q, scale = quantize_activations_fp8(x)
    return (x_q.to(torch.float32) * scale).to(x.dtype)


def read_float8(layer: CheckpointLayer) -> dict[str, torch.Tensor]:
    """fp8 weights, their scales (and a static ``input_scale``) as compressed-tensors and ModelOpt store them."""
    rows, columns = layer.shape
    qweight = layer.tensor("weight", (torch.float8_e4m3fn,), ((rows, columns),))
    scale_shapes = ((rows, 1), (rows,)) if layer.scheme.per_channel else ((), (1,), (1, 1))
    scale = layer.tensor("weight_scale", FLOAT_SCALES, scale_shapes)
    stored = {"qweight": qweight, "scale": scale.to(torch.float32).reshape(-1)}
    if layer.scheme.static_activations:
        stored["input_scale"] = layer.tensor("input_scale", FLOAT_SCALES, ((), (1,), (1, 1))).to(torch.float32).reshape(1)
    return stored


@register_scheme
class Fp8(QuantMethod):
    name = "fp8"

    def statistics(self, scheme):
        return frozenset({"max_abs"}) if scheme.static_activations else frozenset()

    def check_device(self, scheme, device):
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            return f"fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); this one is {major}.{minor}"
        return None

    def quantize(self, scheme, w, statistics):
        amax = w.abs().amax(dim=1) if scheme.per_channel else w.abs().amax().reshape(1)
        scale = safe_scale(amax / FP8_MAX)
        qweight = (w / (scale[:, None] if scheme.per_channel else scale)).clamp_(-FP8_MAX, FP8_MAX)
        stored = {"qweight": qweight.to(torch.float8_e4m3fn), "scale": scale}
        if scheme.static_activations:
            if statistics is None or "max_abs" not in statistics:
                raise ValueError("fp8 with static activation scales needs the layer's input statistics (max_abs, from calibration)")
            stored["input_scale"] = safe_scale(statistics["max_abs"].to(w.device, torch.float32).amax().reshape(1) / FP8_MAX)
        return stored

    def dequantize(self, scheme, stored, dtype):
        scale = stored["scale"].to(dtype)
        return stored["qweight"].to(dtype) * (scale[:, None] if scale.numel() > 1 else scale)

    def op(self, scheme):
        if scheme.static_activations:
            return torch.ops.autodeploy.fp8_static_linear.default
        return torch.ops.autodeploy.fp8_linear.default

    def row_wise_ops(self):
        return {torch.ops.autodeploy.fp8_linear.default: ()}  # a per-tensor scale [1] has no rows: fuse_gemms leaves it

    def row_scaled_ops(self):
        return {torch.ops.autodeploy.fp8_linear.default: 2}

    def round_input(self, scheme, stored):
        input_scale = stored.get("input_scale")
        return lambda x: fake_quantize_activations_fp8(x, input_scale)

    def compressed_tensors_args(self, scheme):
        from compressed_tensors.quantization import QuantizationArgs

        weights = QuantizationArgs(num_bits=8, type="float", strategy="channel" if scheme.per_channel else "tensor", symmetric=True)
        inputs = QuantizationArgs(num_bits=8, type="float", strategy="tensor" if scheme.static_activations else "token",
                                  symmetric=True, dynamic=not scheme.static_activations)
        return weights, inputs, "float-quantized"

    def to_compressed_tensors(self, scheme, stored):
        scale = stored["scale"].to(torch.float32)
        static = {"input_scale": stored["input_scale"].to(torch.float32).reshape(1)} if scheme.static_activations else {}
        return {"weight": stored["qweight"], "weight_scale": scale.reshape(-1, 1) if scheme.per_channel else scale.reshape(1),
                **static}

    def from_compressed_tensors(self, weights, inputs, fmt, where):
        strategy = str(weights.strategy)
        if not (str(weights.type) == "float" and int(weights.num_bits) == 8 and strategy in ("channel", "tensor")
                and fmt in ("float-quantized", "naive-quantized")):
            return None
        static = inputs is not None and not inputs.dynamic and str(inputs.strategy) == "tensor"
        note = None
        if inputs is None or not (static or str(inputs.strategy) == "token"):
            note = (f"{where}: activations {'unquantized' if inputs is None else inputs.strategy} in the checkpoint are "
                    f"quantized to fp8 per token at run time")
        described = f"{where} (format {fmt}, weights {weights}, input activations {inputs})"
        return checkpoint_scheme(self.name, described, per_channel=strategy == "channel", static_activations=static), note

    def read_compressed_tensors(self, layer):
        return read_float8(layer)


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``F.linear(x_q · x_scale, qweight · scale, bias)``: float8_e4m3fn weights ``[N, K]`` with float32 scales
    per output channel ``[N]`` or per tensor ``[1]``, activations quantized to float8_e4m3fn per token here;
    returns ``[..., N]`` in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    check_linear("fp8_linear", x, qweight.shape[0], qweight.shape[1], bias)
    dtype = compute_dtype(x.dtype)
    x_q, x_scale = quantize_activations_fp8(x)
    activations = x_q.to(dtype) * x_scale.to(dtype)
    weight = dequantize_weight(QuantScheme("fp8"), {"qweight": qweight, "scale": scale}, dtype)
    return F.linear(activations, weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def fp8_static_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``fp8_linear`` with one static activation scale ``input_scale`` float32 ``[1]`` (from calibration) for
    every token: ``F.linear(fp8(x / input_scale) · input_scale, qweight · scale, bias)``; returns ``[..., N]``
    in ``x``'s dtype, computed in float32 (float64 for float64 x)."""
    check_linear("fp8_static_linear", x, qweight.shape[0], qweight.shape[1], bias)
    if input_scale.numel() != 1:
        raise ValueError(f"fp8_static_linear: input_scale must hold one value; got shape {tuple(input_scale.shape)}.")
    dtype = compute_dtype(x.dtype)
    activations = quantize_activations_fp8_static(x, input_scale).to(dtype) * input_scale.to(dtype)
    weight = dequantize_weight(QuantScheme("fp8"), {"qweight": qweight, "scale": scale}, dtype)
    return F.linear(activations, weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def _fake(x, qweight, *rest):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


_W = torch.linspace(-1.0, 1.0, 32).reshape(4, 8)  # the example inputs register_op checks the fake against
_DYNAMIC = quantize_weight(QuantScheme("fp8"), _W)
_STATIC = quantize_weight(QuantScheme("fp8", static_activations=True), _W, {"max_abs": torch.linspace(1.0, 8.0, 8)})
fp8_linear = register_op(
    "fp8_linear", fp8_linear_reference, _fake,
    example_inputs=(torch.ones(2, 8), _DYNAMIC["qweight"], _DYNAMIC["scale"], torch.zeros(4)),
)
fp8_static_linear = register_op(
    "fp8_static_linear", fp8_static_linear_reference, lambda x, qweight, scale, input_scale, bias: _fake(x, qweight),
    example_inputs=(torch.ones(2, 8), _STATIC["qweight"], _STATIC["scale"], _STATIC["input_scale"], torch.zeros(4)),
)


def fp8_linear_torch(x, qweight, scale, bias):
    """``fp8_linear`` with ``torch._scaled_mm`` (CUTLASS/cuBLASLt on Hopper): activations quantized per token
    here, the product scaled by the token's and the output channel's scales (row-wise scaling)."""
    x_q, x_scale = quantize_activations_fp8(x)
    return scaled_mm_rows(x_q, x_scale, qweight, scale, bias, x.dtype)


def _fp8_scaled_mm_supports(x, qweight, scale, bias, *, device):
    return scaled_mm_supports(x.dtype, qweight, bias, device)


register_backend("fp8_linear", "torch", fp8_linear_torch, supports=_fp8_scaled_mm_supports)


def fp8_static_linear_torch(x, qweight, scale, input_scale, bias):
    """``fp8_static_linear`` with ``torch._scaled_mm``: activations quantized with the layer's one scale, passed
    row-wise (every row the same) beside the weight's row-wise scales."""
    rows = x.reshape(-1, qweight.shape[1])
    x_scale = input_scale.reshape(1, 1).to(torch.float32).expand(rows.shape[0], 1).contiguous()
    return scaled_mm_rows(quantize_activations_fp8_static(x, input_scale), x_scale, qweight, scale, bias, x.dtype)


register_backend("fp8_static_linear", "torch", fp8_static_linear_torch,
                 supports=lambda x, qweight, scale, input_scale, bias, *, device: _fp8_scaled_mm_supports(x, qweight, scale, bias, device=device))
