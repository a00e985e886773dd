"""The ``triton`` backends of ``rms_norm``, ``add_rms_norm``, ``layer_norm``, ``rope``, ``gated_activation``,
``gated_mlp``, ``fused_gated_mlp`` (also ``triton_skinny``), ``linear`` (a few-row GEMM), the quantized linears
(dequantising GEMVs and tile kernels; for fp8 also ``triton_scaled_mm``: the Triton row quantizer, then
``torch._scaled_mm``) and the fp8-writing ops (``add_rms_norm_fp8``, ``gated_activation_fp8``,
``fp8_prequantized_linear``): registration only.

The kernels live in ``custom_ops/triton/`` (``norms.py``, ``rope.py``, ``gated_activation.py``,
``skinny_gemm.py``, ``quantized_gemv.py``); each
backend below imports its kernel module on its first call, not here: Triton decides at kernel
definition whether to interpret (``TRITON_INTERPRET``), and importing the ops must neither fix that
choice nor need Triton. For the same reason each ``supports`` restates its kernel's limits instead of
importing them; ``tests/custom_ops/test_triton_kernels.py`` checks that the two agree.

Example (``supports`` reads only shapes and dtypes, so meta tensors will do)::

    import torch
    from autodeploy.custom_ops import candidates

    triton = next(b for b in candidates("rms_norm") if b.name == "triton")
    meta = dict(dtype=torch.bfloat16, device="meta")
    x, weight = torch.empty(3, 4096, **meta), torch.empty(4096, **meta)
    assert triton.check((x, weight, 1e-6), torch.device("cuda")) is None   # would serve a CUDA deploy
    assert "CUDA" in triton.check((x, weight, 1e-6), torch.device("cpu"))  # never a CPU one
"""

from __future__ import annotations

from typing import Optional

import torch

from . import add_rms_norm, fp8_activations, fused_gated_mlp, gated_activation, gated_mlp, layer_norm, linear, quantization, quantized_linear, rms_norm, rope  # noqa: F401  (the ops must exist before their backends)
from .activations import unsupported_activation
from .registry import register_backend
from .triton import triton_unavailable

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NORM_MAX_HIDDEN = 32768  # norms.MAX_HIDDEN: a whole row is one tile
_ROPE_MAX_HEAD_DIM = 1024  # rope.MAX_HEAD_DIM
_SKINNY_DTYPES = (torch.float16, torch.bfloat16)  # skinny_gemm.DTYPES


def _unsupported_dtypes(device: torch.device, x: torch.Tensor, **params: Optional[torch.Tensor]) -> Optional[str]:
    """Why these kernels cannot run on ``device`` with these dtypes, or ``None``: Triton must be
    usable there, ``x`` a float type the kernels read, and every given parameter in ``x``'s dtype."""
    reason = triton_unavailable(device)
    if reason:
        return reason
    if x.dtype not in _DTYPES:
        return f"needs float32, float16 or bfloat16 activations (x is {x.dtype})"
    for name, param in params.items():
        if param is not None and param.dtype != x.dtype:
            return f"needs {name} in x's dtype ({name} is {param.dtype}, x is {x.dtype})"
    return None


def _norm_too_wide(x: torch.Tensor) -> Optional[str]:
    if x.shape[-1] > _NORM_MAX_HIDDEN:
        return f"hidden sizes up to {_NORM_MAX_HIDDEN} (H={x.shape[-1]})"
    return None


def _rms_norm_triton(x, weight, eps, weight_offset=0.0):
    from .triton.norms import rms_norm_triton  # on first call: see the module docstring

    return rms_norm_triton(x, weight, eps, weight_offset)


def _rms_norm_supports(x, weight, eps, weight_offset=0.0, *, device):
    return _unsupported_dtypes(device, x, weight=weight) or _norm_too_wide(x) or True


def _add_rms_norm_triton(x, residual, weight, eps, weight_offset=0.0):
    from .triton.norms import add_rms_norm_triton

    return add_rms_norm_triton(x, residual, weight, eps, weight_offset)


def _add_rms_norm_supports(x, residual, weight, eps, weight_offset=0.0, *, device):
    return _unsupported_dtypes(device, x, residual=residual, weight=weight) or _norm_too_wide(x) or True


def _layer_norm_triton(x, weight, bias, eps):
    from .triton.norms import layer_norm_triton

    return layer_norm_triton(x, weight, bias, eps)


def _layer_norm_supports(x, weight, bias, eps, *, device):
    return _unsupported_dtypes(device, x, weight=weight, bias=bias) or _norm_too_wide(x) or True


def _rope_triton(x, cos, sin, interleaved=False):
    from .triton.rope import rope_triton

    return rope_triton(x, cos, sin, interleaved)


def _rope_supports(x, cos, sin, interleaved=False, *, device):
    # cos/sin are angles, not weights: the kernel reads them in float32 whatever their (float) dtype.
    reason = _unsupported_dtypes(device, x)
    if reason:
        return reason
    if cos.dtype not in _DTYPES or sin.dtype != cos.dtype:
        return f"needs cos and sin in one of float32/float16/bfloat16 (cos {cos.dtype}, sin {sin.dtype})"
    if x.shape[-1] > _ROPE_MAX_HEAD_DIM:
        return f"head dims up to {_ROPE_MAX_HEAD_DIM} (D={x.shape[-1]})"
    return True


def _gated_mlp_triton(x, gate_weight, up_weight, down_weight, activation):
    from .triton.gated_activation import gated_mlp_triton

    return gated_mlp_triton(x, gate_weight, up_weight, down_weight, activation)


def _gated_activation_triton(gate, up, activation):
    from .triton.gated_activation import gated_activation

    return gated_activation(gate, up, activation)


def _gated_activation_supports(gate, up, activation, *, device):
    return _unsupported_dtypes(device, gate, up=up) or unsupported_activation(activation) or True


def _gated_mlp_supports(x, gate_weight, up_weight, down_weight, activation, *, device):
    return (
        _unsupported_dtypes(device, x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
        or unsupported_activation(activation)
        or True
    )


def _fused_gated_mlp_triton(x, gate_up_weight, down_weight, activation):
    from .triton.gated_activation import fused_gated_mlp_triton

    return fused_gated_mlp_triton(x, gate_up_weight, down_weight, activation)


def _fused_gated_mlp_supports(x, gate_up_weight, down_weight, activation, *, device):
    return (
        _unsupported_dtypes(device, x, gate_up_weight=gate_up_weight, down_weight=down_weight)
        or unsupported_activation(activation)
        or True
    )


def _fused_gated_mlp_skinny(x, gate_up_weight, down_weight, activation):
    from .triton.skinny_gemm import fused_gated_mlp_skinny

    return fused_gated_mlp_skinny(x, gate_up_weight, down_weight, activation)


def _fused_gated_mlp_skinny_supports(x, gate_up_weight, down_weight, activation, *, device):
    reason = _fused_gated_mlp_supports(x, gate_up_weight, down_weight, activation, device=device)
    if reason is not True:
        return reason
    return _skinny_unsupported(x, gate_up_weight, down_weight) or True


def _skinny_unsupported(x: torch.Tensor, *weights: torch.Tensor) -> Optional[str]:
    """Why the few-row GEMM kernel cannot take ``x`` and these weights, or ``None`` when it can."""
    if x.dtype not in _SKINNY_DTYPES:
        return f"needs float16 or bfloat16 x, weight and bias in one dtype (x is {x.dtype})"
    if any(weight.stride(1) != 1 for weight in weights):
        return "needs weights with contiguous rows"
    return None  # any row count is correct; the autotuner keeps it where it is fast (decode sizes)


def _linear_triton(x, weight, bias):
    from .triton.skinny_gemm import skinny_linear

    return skinny_linear(x, weight, bias)


def _linear_supports(x, weight, bias, *, device):
    reason = triton_unavailable(device)
    if reason:
        return reason
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"needs float16 or bfloat16 x, weight and bias in one dtype (x is {x.dtype}, weight {weight.dtype})"
    return _skinny_unsupported(x, weight) or True


def _int8_wo_linear_triton(x, qweight, scale, bias):
    from .triton.quantized_gemv import int8_wo_gemv

    return int8_wo_gemv(x, qweight, scale, bias)


def _int4_wo_linear_triton(x, qweight, scale, zero, bias):
    from .triton.quantized_gemv import int4_wo_gemv

    return int4_wo_gemv(x, qweight, scale, zero, bias)


def _int4_awq_linear_triton(x, qweight, scale, zero, smooth, bias):
    from .triton.quantized_gemv import int4_wo_gemv

    return int4_wo_gemv(x * smooth.to(x.dtype), qweight, scale, zero, bias)


def _fp8_linear_triton(x, qweight, scale, bias):
    from .triton.quantized_gemv import fp8_gemv

    return fp8_gemv(x, qweight, scale, bias)


def _fp8_static_linear_triton(x, qweight, scale, input_scale, bias):
    from .triton.quantized_gemv import fp8_gemv

    return fp8_gemv(x, qweight, scale, bias, input_scale)


def _fp8_linear_scaled_mm(x, qweight, scale, bias):
    from .triton.quantized_gemv import fp8_scaled_mm

    return fp8_scaled_mm(x, qweight, scale, bias)


def _fp8_static_linear_scaled_mm(x, qweight, scale, input_scale, bias):
    from .triton.quantized_gemv import fp8_scaled_mm

    return fp8_scaled_mm(x, qweight, scale, bias, input_scale)


def _no_fp8(device: torch.device) -> Optional[str]:
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
        return "float8 conversions need compute capability 8.9 or later (Ada, Hopper)"
    return None


def _add_rms_norm_fp8_triton(x, residual, weight, eps, weight_offset=0.0):
    from .triton.norms import add_rms_norm_fp8_triton

    return add_rms_norm_fp8_triton(x, residual, weight, eps, weight_offset)


def _add_rms_norm_fp8_supports(x, residual, weight, eps, weight_offset=0.0, *, device):
    return _unsupported_dtypes(device, x, residual=residual, weight=weight) or _norm_too_wide(x) or _no_fp8(device) or True


def _gated_activation_fp8_triton(gate, up, activation):
    from .triton.gated_activation import gated_activation_fp8

    return gated_activation_fp8(gate, up, activation)


def _gated_activation_fp8_supports(gate, up, activation, *, device):
    return _unsupported_dtypes(device, gate, up=up) or unsupported_activation(activation) or _no_fp8(device) or True


def _fp8_prequantized_linear_triton(x_q, x_scale, qweight, scale, bias, dtype):
    from .triton.quantized_gemv import fp8_prequantized_gemm

    return fp8_prequantized_gemm(x_q, x_scale, qweight, scale, bias, dtype)


def _fp8_prequantized_linear_supports(x_q, x_scale, qweight, scale, bias, dtype, *, device):
    # quantized_gemv.fp8_prequantized_gemm's limits, restated
    reason = triton_unavailable(device) or _no_fp8(device)
    if reason:
        return reason
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the e4m3 tile kernel writes float16 or bfloat16 (the output is {dtype})"
    if bias is not None and bias.dtype != dtype:
        return f"needs the bias in the output's dtype (bias {bias.dtype}, output {dtype})"
    if not (qweight.is_contiguous() and scale.is_contiguous()):
        return "needs the quantized weight and its scales contiguous"
    return True


def _fp8_scaled_mm_supports(x, qweight, scale, bias, *, device):
    # the Triton row quantizer's limits, then torch._scaled_mm's (fp8_linear's torch backend)
    reason = _fp8_supports(x, qweight, scale, bias, device=device)
    if reason is not True:
        return reason
    return quantized_linear.scaled_mm_supports(x.dtype, qweight, bias, device)


def _fp8_supports(x, qweight, scale, bias, *, device):
    return _no_fp8(device) or _weight_only_supports(x, qweight, scale, bias, device=device)


def _weight_only_supports(x, qweight, scale, *rest, device):
    # quantized_gemv.unsupported, restated: x in a float dtype, the bias in x's, int4 groups a power of two
    reason = _unsupported_dtypes(device, x, bias=rest[-1])
    if reason:
        return reason
    if not all(t.is_contiguous() for t in (qweight, scale, *rest[:-1])):
        return "needs the quantized weight, scales and zero points contiguous"
    if rest[:-1]:
        group_size = 2 * qweight.shape[1] // scale.shape[1]
        if group_size & (group_size - 1):
            return f"int4 groups of a power of two inputs (group_size {group_size})"
    return True


register_backend("rms_norm", "triton", _rms_norm_triton, supports=_rms_norm_supports)
register_backend("add_rms_norm", "triton", _add_rms_norm_triton, supports=_add_rms_norm_supports)
register_backend("layer_norm", "triton", _layer_norm_triton, supports=_layer_norm_supports)
register_backend("rope", "triton", _rope_triton, supports=_rope_supports)
register_backend("gated_activation", "triton", _gated_activation_triton, supports=_gated_activation_supports)
register_backend("gated_mlp", "triton", _gated_mlp_triton, supports=_gated_mlp_supports)
register_backend("fused_gated_mlp", "triton", _fused_gated_mlp_triton, supports=_fused_gated_mlp_supports)
register_backend("linear", "triton", _linear_triton, supports=_linear_supports)
register_backend("int8_wo_linear", "triton", _int8_wo_linear_triton, supports=_weight_only_supports)
register_backend("int4_wo_linear", "triton", _int4_wo_linear_triton, supports=_weight_only_supports)
register_backend("int4_awq_linear", "triton", _int4_awq_linear_triton, supports=_weight_only_supports)
register_backend("fp8_linear", "triton", _fp8_linear_triton, supports=_fp8_supports)
register_backend("fp8_static_linear", "triton", _fp8_static_linear_triton,
                 supports=lambda x, qweight, scale, input_scale, bias, *, device: _fp8_supports(x, qweight, scale, bias, device=device))
register_backend("fp8_linear", "triton_scaled_mm", _fp8_linear_scaled_mm, supports=_fp8_scaled_mm_supports)
register_backend("fp8_static_linear", "triton_scaled_mm", _fp8_static_linear_scaled_mm,
                 supports=lambda x, qweight, scale, input_scale, bias, *, device: _fp8_scaled_mm_supports(
                     x, qweight, scale, bias, device=device))
register_backend(
    "fused_gated_mlp", "triton_skinny", _fused_gated_mlp_skinny, supports=_fused_gated_mlp_skinny_supports
)
register_backend("add_rms_norm_fp8", "triton", _add_rms_norm_fp8_triton, supports=_add_rms_norm_fp8_supports)
register_backend("gated_activation_fp8", "triton", _gated_activation_fp8_triton, supports=_gated_activation_fp8_supports)
register_backend("fp8_prequantized_linear", "triton", _fp8_prequantized_linear_triton,
                 supports=_fp8_prequantized_linear_supports)
