"""``smoothquant`` (W8A8): int8 weights and int8 activations, per-input smoothing from calibration.

``int8_wo``'s storage for ``w · diag(s)`` and ``smooth = 1 / s`` float32 ``[K]``,
``s_k = max|x_k|^α / max_n |w_nk|^(1−α)`` from the largest input each channel took over calibration text
(``max_abs``; ``alpha`` 0.5 by default): outlier channels of the activations move into the weights. The op
(``int8_w8a8_linear``) quantizes ``x · smooth`` to int8 per token as it runs (``max|·| / 127``) and sums int8
products in int32. Projections over one input share ``s`` (its ``max_n`` taken over all their weights:
calibration's ``weight_max_abs``, combined by ``share_smoothing``), so the ``fold_smoothing`` transform can move
``smooth`` into the norm or linear before them. compressed-tensors' W8A8 checkpoints (int8 weights per channel,
int8 activations) read as this scheme with ``smooth`` one (llm-compressor folds the smoothing into the norms);
it is not written (the format has no field for the smoothing).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from autodeploy.errors import CheckpointError

from ..compute_dtype import compute_dtype
from ..quantized_linear import (
    QuantMethod,
    QuantScheme,
    check_linear,
    quantize_activations_int8,
    quantize_weight,
    register_scheme,
)
from ..quantized_tensors import checkpoint_scheme
from ..registry import register_backend, register_op
from .int8_wo import dequantize_int8_rows, is_int8_channel_weights, quantize_int8_rows, read_int8_rows


def fake_quantize_activations_int8(x: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """``x`` through the smoothquant op's rounding, in ``x``'s dtype, for a layer holding its effective weight
    ``w · diag(s) · diag(smooth)``: ``Q(x · smooth) / smooth`` (what verification's reference applies)."""
    smoothed = x.to(torch.float32) * smooth.to(x.device, torch.float32)
    x_q, scale = quantize_activations_int8(smoothed)
    return (x_q.to(torch.float32) * scale / smooth.to(x.device, torch.float32)).to(x.dtype)


@register_scheme
class SmoothQuant(QuantMethod):
    name = "smoothquant"

    def statistics(self, scheme):
        return frozenset({"max_abs", "weight_max_abs"})

    def quantize(self, scheme, w, statistics):
        if statistics is None or "max_abs" not in statistics:
            raise ValueError("smoothquant needs the layer's input statistics (max_abs, from calibration)")
        x_max = statistics["max_abs"].to(w.device, torch.float32)
        # Projections over one input take their group's largest weights (share_smoothing): one s for all of them.
        w_max = statistics["weight_max_abs"].to(w.device, torch.float32) if "weight_max_abs" in statistics else w.abs().amax(dim=0)
        # A channel that never carried a value (or whose weights are all zero) keeps s = 1.
        s = torch.where((x_max > 0) & (w_max > 0), x_max.pow(scheme.alpha) / w_max.pow(1.0 - scheme.alpha), torch.ones_like(x_max))
        s = s.clamp(min=1e-5)
        return {**quantize_int8_rows(w * s[None, :]), "smooth": 1.0 / s}

    def dequantize(self, scheme, stored, dtype):
        return dequantize_int8_rows(stored, dtype) * stored["smooth"].to(dtype)[None, :]

    def op(self, scheme):
        return torch.ops.autodeploy.int8_w8a8_linear.default

    def row_wise_ops(self):
        # Row-wise once fold_smoothing took its smoothing (argument 3, per input column) out of it.
        return {torch.ops.autodeploy.int8_w8a8_linear.default: (3,)}

    def row_scaled_ops(self):
        return {torch.ops.autodeploy.int8_w8a8_linear.default: 2}

    def round_input(self, scheme, stored):
        smooth = stored["smooth"]
        return lambda x: fake_quantize_activations_int8(x, smooth)

    def from_compressed_tensors(self, weights, inputs, fmt, where):
        if inputs is None or not is_int8_channel_weights(weights, fmt):
            return None
        described = f"{where} (format {fmt}, weights {weights}, input activations {inputs})"
        if str(inputs.type) != "int" or int(inputs.num_bits) != 8:
            raise CheckpointError(f"{described}: int8 weights with {inputs.type}{inputs.num_bits} activations; autodeploy "
                                  f"serves int8 weights with int8 activations (W8A8) or unquantized ones")
        note = None
        if not inputs.dynamic or str(inputs.strategy) != "token":
            note = f"{where}: int8 activations with static scales in the checkpoint are quantized per token at run time"
        return checkpoint_scheme(self.name, described), note  # its smoothing is folded into the checkpoint's norms

    def read_compressed_tensors(self, layer):
        """W8A8: int8 weights, activations quantized per token by the op; llm-compressor folds SmoothQuant's
        smoothing into the preceding weights, so the op's own smoothing is one."""
        return {**read_int8_rows(layer), "smooth": torch.ones(layer.shape[1])}


def int8_w8a8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, smooth: Optional[torch.Tensor], bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """SmoothQuant's W8A8 linear: ``x · smooth`` quantized to int8 per token (``quantize_activations_int8``),
    times the int8 weights ``[N, K]``, the int32 sums scaled by the token's and the output channel's scale
    ``[N]``; returns ``[..., N]`` in ``x``'s dtype. ``smooth`` None: ``x`` arrives smoothed (the
    ``fold_smoothing`` transform moved the factors into the op before, or a W8A8 checkpoint into its norms).
    The rounding is computed in float32 (float64 for float64 x), the sums exactly (float64 holds them)."""
    check_linear("int8_w8a8_linear", x, qweight.shape[0], qweight.shape[1], bias)
    if smooth is not None and smooth.shape != (x.shape[-1],):
        raise ValueError(f"int8_w8a8_linear: smooth must be [K={x.shape[-1]}]; got {tuple(smooth.shape)}.")
    smoothed = x.to(compute_dtype(x.dtype))
    x_q, x_scale = quantize_activations_int8(smoothed if smooth is None else smoothed * smooth.to(smoothed.dtype))
    sums = F.linear(x_q.to(torch.float64), qweight.to(torch.float64))
    out = sums * x_scale.to(torch.float64) * scale.to(torch.float64)
    return (out if bias is None else out + bias.to(torch.float64)).to(x.dtype)


_EXAMPLE = quantize_weight(QuantScheme("smoothquant"), torch.linspace(-1.0, 1.0, 32).reshape(4, 8),
                           {"max_abs": torch.linspace(1.0, 8.0, 8)})
int8_w8a8_linear = register_op(
    "int8_w8a8_linear", int8_w8a8_linear_reference,
    lambda x, qweight, scale, smooth, bias: x.new_empty((*x.shape[:-1], qweight.shape[0])),
    example_inputs=(torch.ones(2, 8), _EXAMPLE["qweight"], _EXAMPLE["scale"], _EXAMPLE["smooth"], torch.zeros(4)),
)

# cuBLASLt's int8 GEMM takes more than 16 rows, and K and N multiples of 8: decode rows are padded up.
_INT_MM_MIN_ROWS = 17


def int8_w8a8_linear_torch(x, qweight, scale, smooth, bias):
    """``int8_w8a8_linear`` with ``torch._int_mm`` (int8 × int8 → int32: cuBLASLt on GPUs, oneDNN on CPUs): the
    activations quantized per token here, the sums scaled in float32."""
    out_features, in_features = qweight.shape
    rows = x.reshape(-1, in_features)
    x_q, x_scale = quantize_activations_int8(rows.to(torch.float32) if smooth is None else rows.to(torch.float32) * smooth)
    padding = _INT_MM_MIN_ROWS - x_q.shape[0] if x.device.type == "cuda" else 0
    if padding > 0:
        x_q = F.pad(x_q, (0, 0, 0, padding))
    sums = torch._int_mm(x_q, qweight.t())[: rows.shape[0]]
    out = (sums.to(torch.float32) * x_scale * scale).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out_features)


def _int_mm_supports(x, qweight, scale, smooth, bias, *, device):
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"writes float32/float16/bfloat16 (x is {x.dtype})"
    if device.type == "cuda" and (qweight.shape[0] % 8 or qweight.shape[1] % 8):
        return f"cuBLASLt's int8 GEMM needs N and K multiples of 8 (weight {tuple(qweight.shape)})"
    if bias is not None and bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype} differs from x's {x.dtype}"
    return True


register_backend("int8_w8a8_linear", "torch", int8_w8a8_linear_torch, supports=_int_mm_supports)
