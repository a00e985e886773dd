"""The per-token fp8 rounding of activations, as Triton helpers shared by every kernel that rounds a row.

``quantize_activations_fp8`` (``custom_ops/quantized_linear.py``) defines it: a row's scale is its max |x|
over 448 (1 for an all-zero row), and each value is ``x / scale`` correctly rounded, saturated at ±448,
then rounded to e4m3 to nearest even. The row quantizer before an fp8 GEMM (``quantized_gemv``) and the
kernels that round their own output for one (the norms' and the gated activation's ``_fp8`` variants)
produce these exact bits.
"""

import triton
import triton.language as tl


@triton.jit
def fp8_row_scale(peak):
    """A row's scale from its max |x| (float32): ``peak / 448``, or 1 for an all-zero row."""
    scale = peak / 448.0
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def to_e4m3(x, x_scale):
    """``x / x_scale`` correctly rounded, saturated at ±448, then to e4m3 to nearest even. (``x · (1 / scale)``
    would save the division but round differently: the demo model's fp8 perplexity went from +0.79% to
    +1.23%, notes/quantization.md.)"""
    quotient = tl.math.div_rn(x, x_scale + tl.zeros_like(x))
    return tl.clamp(quotient, -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
