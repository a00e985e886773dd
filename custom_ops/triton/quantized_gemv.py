"""Triton backends of ``int8_wo_linear``, ``int4_wo_linear`` and ``fp8_linear`` for decode rows: dequantise in the kernel.

A decode step's projections read their whole weight for a few rows of activations. A weight-only
scheme's floor is its stored bytes over the memory bandwidth: half a bf16 weight's for int8 and fp8, a
quarter (plus the group scales) for int4. Two kernels, both float32 sums rounded once to ``x``'s dtype:

- **the GEMV** (one row of ``x`` a program, ``GemvLaunch``): ``BLOCK_N`` weight rows streamed and
  dequantised in registers. int8 (:func:`_int8_gemv_kernel`): ``Σ_k q[n, k] · x[k]``, times the row's scale
  once at the end; int4 (:func:`_int4_gemv_kernel`): ``GROUPS_PER_STEP`` groups a step, each weight
  ``q · scale − zero · scale``, the low and high nibbles against the even and odd ``x``; fp8
  (:func:`_fp8_gemv_kernel`): the row's max |x| first (or the layer's static scale), then
  ``Σ_k w[n, k] · e4m3(x[k] / s_x)``, times ``s_x`` and the channel's (or tensor's) weight scale.
  Integers become floats by placing them in the mantissa of 2²³ (one integer add or or, one float
  subtract) instead of a conversion instruction, which Hopper issues at an eighth of the float rate;
- **the tile kernel** (:func:`_tile_kernel`, ``TileLaunch``): up to 64 rows of ``x`` against 32 – 64 weight
  rows a program on the tensor cores, the weight tile dequantised to ``x``'s half-precision dtype (int8;
  int4 a group at a time, times the group's scale; with ``packed_dequant``, two values an instruction in
  inline PTX), or fp8 × fp8 after :func:`_fp8_rows_kernel` has rounded each row of ``x`` to e4m3 once, as
  ``quantize_activations_fp8`` does (or a norm or activation kernel has, for :func:`fp8_prequantized_gemm`).
  ``TileLaunch.tma`` fetches the tiles through tensor descriptors.

:func:`default_launch` picks between them from the shape (the sweep's findings: fp8 always takes the tile
kernel, int8 the GEMV for one row, int4 the tile kernel with its inputs split at up to 32 rows of half
precision); the autotuner keeps these backends where they beat the ``torch`` ones. Results are the
reference's up to float32 summation order.

Example (on a CPU with ``TRITON_INTERPRET=1`` set before the import, as the tests do)::

    import torch
    from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight
    from autodeploy.custom_ops.triton.quantized_gemv import int4_wo_gemv

    stored = quantize_weight(QuantScheme("int4_wo", group_size=32), torch.randn(64, 128))
    out = int4_wo_gemv(torch.randn(1, 128), stored["qweight"], stored["scale"], stored["zero"], None)  # [1, 64]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..quantized_linear import scaled_mm_rows
from . import INTERPRETED, hopper_or_later
from .fp8 import fp8_row_scale, to_e4m3
from .launch import arrival_counters, dependent_launch, wait_for_previous_kernel
from .skinny_gemm import _sum_splits_on_arrival, num_sms, tma_aligned

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GemvLaunch:
    """How a dequantising GEMV is launched: weight rows a program (``block_n``: Llama-3-8B's 4,096-row
    projections give 256 programs a row of x at 16), int8/fp8 input columns a step (``block_k``), int4
    groups a step (``groups_per_step``), warps, and pipeline stages (None: Triton's default). Sizes are
    powers of two.
    ``scripts/sweep_quantized_gemv.py`` times others; :func:`default_launch` picks one by shape."""

    block_n: int = 16
    block_k: int = 512
    groups_per_step: int = 1
    num_warps: int = 4
    num_stages: Optional[int] = None
    words: int = 0  # int4: the word-wise GEMV (_int4_words_gemv_kernel), this many int32 words a step; 0: group-wise

    def options(self) -> dict:
        return {"num_warps": self.num_warps, **({} if self.num_stages is None else {"num_stages": self.num_stages})}


@triton.jit
def _int8_to_float(q):
    # int8 → float32 without a conversion instruction (16 a clock an SM on Hopper, slower than the bytes
    # arrive): q + 128 ∈ [1, 255] in the low mantissa bits of 2²³ is the float 2²³ + 128 + q, exactly.
    bits = q.to(tl.int32) + 0x4B000080
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _nibble_to_float(bits):
    # The low 4 bits of int32 ``bits`` as float32, the same way: 2²³ + q, less 2²³.
    return ((bits & 0x0F) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibbles_to_float(packed):
    # The low and high 4-bit values of uint8 bytes as float32.
    word = packed.to(tl.int32)
    return _nibble_to_float(word), _nibble_to_float(word >> 4)


# Four packed bytes (eight 4-bit values, the even k in the low nibbles) to (q − zero) in half precision, two
# values an instruction (Marlin's trick): each byte is spread to a 16-bit lane (prmt), a nibble placed in
# the mantissa of 128.0 (bfloat16 0x4300) or 1024.0 (float16 0x6400) by one lop3, then (128 + zero) or
# (1024 + zero) subtracted two lanes at a time: exact, as every value is an integer in [-15, 15].
_NIBBLES_ASM = """
{
.reg .b32 t0, t1, s0, s1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.u32 s0, t0, 4;
shr.u32 s1, t1, 4;
lop3.b32 $0, t0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $1, t1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $2, s0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $3, s1, 0x000F000F, MAGIC, 0xEA;
sub.TYPE $0, $0, $5;
sub.TYPE $1, $1, $6;
sub.TYPE $2, $2, $5;
sub.TYPE $3, $3, $6;
}
"""
_BF16_NIBBLES_ASM = tl.constexpr(_NIBBLES_ASM.replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2"))
_FP16_NIBBLES_ASM = tl.constexpr(_NIBBLES_ASM.replace("MAGIC", "0x64006400").replace("TYPE", "f16x2"))


@triton.jit
def _nibbles_minus_zero(packed, zero, dtype: tl.constexpr):
    # (low − zero, high − zero) of uint8 ``packed`` [BLOCK_N, P] in ``dtype`` (bfloat16 or float16), ``zero``
    # [BLOCK_N] of float32, by _NIBBLES_ASM, four bytes an instance.
    if dtype == tl.bfloat16:
        offset = tl.broadcast_to((zero + 128.0).to(tl.bfloat16)[:, None], packed.shape)
        return tl.inline_asm_elementwise(_BF16_NIBBLES_ASM, "=r,=r,=r,=r,r,r,r", [packed, offset],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        offset = tl.broadcast_to((zero + 1024.0).to(tl.float16)[:, None], packed.shape)
        return tl.inline_asm_elementwise(_FP16_NIBBLES_ASM, "=r,=r,=r,=r,r,r,r", [packed, offset],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _int8_gemv_kernel(
    x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_q,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    col_ok = cols < N
    offsets = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offsets
        k_ok = k < K
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + cols[:, None].to(tl.int64) * stride_q + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0)
        acc += _int8_to_float(q) * x[None, :]
    total = tl.sum(acc, axis=1) * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _int4_gemv_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_q, stride_s,
    GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    col_ok = cols < N
    pairs = tl.arange(0, GROUP // 2)
    steps = tl.arange(0, GROUPS_PER_STEP)
    num_groups = K // GROUP
    # Element-wise sums, reduced once at the end: a weight is (q − zero) · scale = q · scale − zero · scale,
    # one multiply-add from the group's two values.
    acc = tl.zeros((BLOCK_N, GROUPS_PER_STEP, GROUP // 2), dtype=tl.float32)
    for first in range(0, num_groups, GROUPS_PER_STEP):
        groups = first + steps  # [S]
        group_ok = groups < num_groups
        x_at = x_ptr + row * stride_xm + groups[:, None] * GROUP + 2 * pairs[None, :]  # [S, GROUP / 2]
        x_even = tl.load(x_at, mask=group_ok[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_at + 1, mask=group_ok[:, None], other=0.0).to(tl.float32)
        packed = tl.load(q_ptr + cols[:, None, None].to(tl.int64) * stride_q + groups[None, :, None] * (GROUP // 2)
                         + pairs[None, None, :], mask=col_ok[:, None, None] & group_ok[None, :, None], other=0)
        low, high = _nibbles_to_float(packed)  # [BLOCK_N, S, GROUP / 2]
        tiles = cols[:, None] * stride_s + groups[None, :]
        tile_ok = col_ok[:, None] & group_ok[None, :]
        scale = tl.load(scale_ptr + tiles, mask=tile_ok, other=0.0)[:, :, None]
        offset = tl.load(zero_ptr + tiles, mask=tile_ok, other=0).to(tl.float32)[:, :, None] * scale
        acc += (low * scale - offset) * x_even[None, :, :] + (high * scale - offset) * x_odd[None, :, :]
    acc = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _int4_words_gemv_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_q, stride_s,
    GROUP: tl.constexpr, WORDS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    # The packed weight read as int32 words, eight 4-bit values each (input k = 8·word + i in bits 4i – 4i+3,
    # the byte layout's little-endian reading), WORDS words of BLOCK_N rows a step. Each nibble is shifted
    # into the top of the mantissa of 1.0, the float 1 + q/16 exactly (a shift and an and-or a value, no
    # subtract), so per word, in registers: d = Σ_i (1 + q_i/16) · x_i and Σ_i x_i, and Σ_i q_i x_i =
    # 16 · (d − Σ x); then the group's scale and zero point once: s · (16 · d − (16 + zero) · Σ x). Sums
    # element-wise over [BLOCK_N, WORDS], reduced across threads once at the end.
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    col_ok = cols < N
    offsets = tl.arange(0, WORDS)
    x_row = x_ptr + row * stride_xm
    w_rows = q_ptr + cols[:, None].to(tl.int64) * stride_q
    s_rows = cols[:, None] * stride_s
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for first in range(0, K // 8, WORDS):
        words = first + offsets
        word_ok = words < K // 8
        packed = tl.load(w_rows + words[None, :], mask=col_ok[:, None] & word_ok[None, :], other=0)
        dot = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((WORDS,), dtype=tl.float32)
        for i in tl.static_range(8):
            x = tl.load(x_row + words * 8 + i, mask=word_ok, other=0.0).to(tl.float32)
            shifted = packed << (19 - 4 * i) if 4 * i <= 19 else packed >> (4 * i - 19)
            dot += ((shifted & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True) * x[None, :]
            x_sum += x
        tile = s_rows + (words // (GROUP // 8))[None, :]
        tile_ok = col_ok[:, None] & word_ok[None, :]
        scale = tl.load(scale_ptr + tile, mask=tile_ok, other=0.0)
        zero = tl.load(zero_ptr + tile, mask=tile_ok, other=0).to(tl.float32)
        acc += scale * (16.0 * dot - (16.0 + zero) * x_sum[None, :])
    total = tl.sum(acc, axis=1)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _row_scale(x_row_ptr, input_scale_ptr, K, STATIC_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    # A row's fp8 scale: the layer's one static scale (from calibration), or the token's max |x| / 448
    # (1 for an all-zero row).
    if STATIC_SCALE:
        x_scale = tl.load(input_scale_ptr)
    else:
        offsets = tl.arange(0, BLOCK_K)
        peak = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offsets
            peak = tl.maximum(peak, tl.abs(tl.load(x_row_ptr + k, mask=k < K, other=0.0).to(tl.float32)))
        x_scale = fp8_row_scale(tl.max(peak, axis=0))
    return x_scale


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, q_ptr, scale_ptr, input_scale_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_q, stride_s,
    HAS_BIAS: tl.constexpr, STATIC_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    col_ok = cols < N
    offsets = tl.arange(0, BLOCK_K)
    x_scale = _row_scale(x_ptr + row * stride_xm, input_scale_ptr, K, STATIC_SCALE, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offsets
        k_ok = k < K
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
        x_q = to_e4m3(x, x_scale).to(tl.float32)
        q = tl.load(q_ptr + cols[:, None].to(tl.int64) * stride_q + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += q.to(tl.float32) * x_q[None, :]
    total = tl.sum(acc, axis=1) * x_scale * tl.load(scale_ptr + cols * stride_s, mask=col_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@dataclass(frozen=True)
class TileLaunch:
    """How the few-row tile kernel is launched: ``x`` rows a program (``block_m``, at least 16: ``tl.dot``'s
    smallest tile; the smallest power of two over the rows, up to 64, when None), weight rows a program
    (``block_n``), input columns a step (``block_k``; an int4 step stays inside one group), warps,
    pipeline stages, and whether tensor descriptors fetch the tiles (``tma``: rows or weights that are not
    16-byte aligned take thread loads instead). Sizes are powers of two; ``scripts/sweep_quantized_gemv.py``
    times others."""

    block_m: Optional[int] = None
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False  # the tiles fetched by Hopper's TMA unit (on Hopper; thread loads elsewhere)
    packed_dequant: bool = False  # int4: two values an instruction in inline PTX (on Hopper; elsewhere as without)
    split_k: int = 1  # the inputs split over this many programs a tile, their partial sums added by the last

    def options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


_INT8, _INT4, _FP8 = 0, 1, 2  # the tile kernel's SCHEME


def default_launch(scheme: int, num_rows: int, out_features: int, sms: int, in_features: int = 0) -> Launch:
    """The launch for ``num_rows`` rows of a ``[out_features, in_features]`` weight on ``sms`` SMs, from
    ``scripts/sweep_quantized_gemv.py`` on an H200 at Llama-3-8B's projections (``notes/quantization.md``,
    2026-12-03 evening). A weight is *wide* when its 64-row blocks number at least 0.7 an SM (q/k/v: 96
    blocks on 132 SMs, gate/up; not o_proj or down, whose 64 blocks leave half the SMs idle):

    - fp8, any rows: the tile kernel over 64 weight rows × 256 columns, five stages, after the one-pass row
      quantizer: at one row q/k/v / o_proj / gate/up / down 9.8 / 8.5 / 31.9 / 23.3 µs, where the GEMV
      (dividing each value by the row's scale in every program) takes 11.9 / 8.6 / 38.0 / 22.4; at 32 rows
      10.5 / 9.3 / 34.2 / 24.8 µs, where bf16 takes 16.7 / 11.3 / 64.5 / 31.5. Over rows a norm or
      activation kernel already rounded (``fp8_prequantized_gemm``; 2026-12-04 sweep, ``fp8_pre``) at one
      row 8.2 / 6.9 / 30.0 / 18.0 µs (72 / 57 / 92 / 77% of the floor), and down split over two programs
      a tile (a narrow weight, 64 blocks on 132 SMs, with deep rows) 16.6 µs (83%); at 32 rows down 19.2
      against 17.9 split (TMA). Splitting q/k/v, o_proj or gate/up gained nothing;
    - one row, int8: the GEMV over 16 weight rows × 512 columns a program for wide weights (q/k/v 11.7 µs,
      gate/up 39.9 µs), else 8 × 1,024 (o_proj 7.5 µs, down 20.7 µs, 66% of the floor); int4: the word-wise
      GEMV, 8 rows × 256 words, where the tile kernel does not serve (below);
    - int8, more rows: the tile kernel over 64 weight rows (wide) or 32, 128 columns a step, five stages;
    - int4 at 1 – 32 rows (2026-12-04 fourth-session sweeps): the tile kernel with the packed
      dequantisation over 64 weight rows through TMA, each tile's inputs split over four programs (gate/up,
      whose 448 tiles fill the SMs already: two), three stages (q/k/v at more than one row: five). At 32 rows
      q/k/v 13.0, o_proj 9.9, gate/up 39.5, down 23.4 µs against 18.4 / 15.5 / 46.9 / 53.0 unsplit (bf16
      15.8 / 10.7 / 59.1 / 31.4); at one row 10.8 / 8.7 / 34.2 / 21.9 against the word-wise GEMV's 13.1 / 9.8
      / 49.6 / 27.1 (bf16 14.3 / 9.6 / 53.7 / 28.0). Past 32 rows the packed tiles unsplit (2026-12-03 night
      sweep), over 64 weight rows with TMA for wide weights, else 32, five stages. Off Hopper the packed
      dequantisation falls back to the plain one; the GEMV keeps the rows the tile kernel does not take
      (float32 x, groups under 16 inputs).
    """
    wide = _wide(out_features, sms)
    if scheme == _FP8:
        deep = not wide and in_features >= 8192 and num_rows <= 32
        return TileLaunch(block_n=64, block_k=256, num_stages=5, split_k=2 if deep else 1)
    if scheme == _INT4 and num_rows <= 32:  # inputs split over programs: 4 a tile, 2 for gate/up's many tiles
        huge = out_features >= 16384
        return TileLaunch(block_n=64, block_k=128, num_stages=5 if wide and not huge and num_rows > 1 else 3,
                          tma=True, packed_dequant=True, split_k=2 if huge else 4)
    if scheme == _INT4:
        return TileLaunch(block_n=64 if wide else 32, block_k=128, num_stages=5, tma=wide, packed_dequant=True)
    if num_rows > 1:
        return TileLaunch(block_n=64 if wide else 32, block_k=128, num_stages=5)
    return _gemv_launch(scheme, out_features, sms)


def _wide(out_features: int, sms: int) -> bool:
    return triton.cdiv(out_features, 64) >= 0.7 * sms


def _gemv_launch(scheme: int, out_features: int, sms: int) -> GemvLaunch:
    # int4: word-wise, 8 rows × 256 words, 4 warps (2026-12-04 fourth-session sweep, nibbles as 1 + q/16:
    # q/k/v 13.5, o_proj 9.8, down 27.8 µs against 15.3 / 10.9 / 32.4 before); int8 and fp8 (whose rows the
    # tile kernel does not take): 16 × 512 for wide weights, else 8 × 1,024.
    if scheme == _INT4:
        return GemvLaunch(block_n=8, words=256)
    return GemvLaunch(block_n=16, block_k=512) if _wide(out_features, sms) else GemvLaunch(block_n=8, block_k=1024)


@triton.jit
def _fp8_rows_kernel(x_ptr, x_q_ptr, x_scale_ptr, input_scale_ptr, K, stride_xm, STATIC_SCALE: tl.constexpr,
                     BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # One row of x to e4m3 and its scale, as quantize_activations_fp8 (or, with STATIC_SCALE, the static
    # variant) computes them: max |x| / 448 (1 for an all-zero row), then x / scale saturated.
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_K)
    x_scale = _row_scale(x_ptr + row * stride_xm, input_scale_ptr, K, STATIC_SCALE, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offsets
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(x_q_ptr + row * K + k, to_e4m3(x, x_scale), mask=k < K)
    tl.store(x_scale_ptr + row, x_scale)


@triton.jit
def _tile_kernel(
    x_ptr, x_scale_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, x_desc, w_desc, M, N, K, stride_xm, stride_q,
    stride_s, SCHEME: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, TMA: tl.constexpr,
    PACKED_DEQUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, SPLIT_K: tl.constexpr = 1, K_PER_SPLIT=None, part_ptr=None, arrivals_ptr=None,
):
    # acc[BLOCK_N, BLOCK_M] = w_tile · x_tileᵀ on the tensor cores: the weight rows as the dot's wide side.
    # fp8 takes x already in e4m3 (_fp8_rows_kernel) with its row scales at x_scale_ptr. With TMA, the x and
    # weight tiles come through tensor descriptors (zeros past the edges) instead of masked thread loads.
    # With SPLIT_K > 1 a program takes K_PER_SPLIT of the inputs (a multiple of BLOCK_K), writes its scaled
    # partial sums to part_ptr, and the tile's last split to arrive adds them, with the bias, into out_ptr.
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_first = 0
    k_end = K
    if SPLIT_K > 1:
        k_first = tl.program_id(2) * K_PER_SPLIT
        k_end = tl.minimum(K, k_first + K_PER_SPLIT)
    col_ok, row_ok = cols < N, rows < M
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = q_ptr + cols[:, None].to(tl.int64) * stride_q
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if SCHEME == 1:
        # One group a step: Σ (q − zero) · x on the tensor cores (integers in [-15, 15], exact in half
        # precision), times the group's scale. (Meeting the low and high nibbles with the even and odd
        # columns of x in two dots instead of interleaving them ran 7× slower on an H200.)
        offsets = tl.arange(0, BLOCK_K)
        pairs = tl.arange(0, BLOCK_K // 2)
        for k0 in range(k_first, k_end, BLOCK_K):
            if TMA:
                x = x_desc.load([tl.program_id(1) * BLOCK_M, k0])
                packed = w_desc.load([tl.program_id(0) * BLOCK_N, k0 // 2])
            else:
                x = tl.load(x_rows + (k0 + offsets)[None, :], mask=row_ok[:, None], other=0.0)
                packed = tl.load(w_rows + (k0 // 2 + pairs)[None, :], mask=col_ok[:, None], other=0)
            at = cols * stride_s + k0 // GROUP
            zero = tl.load(zero_ptr + at, mask=col_ok, other=0).to(tl.float32)
            if PACKED_DEQUANT:  # two values an instruction, in inline PTX (GPU only)
                low, high = _nibbles_minus_zero(packed, zero, x.dtype)
                w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))  # even k low, odd k high
            else:
                low, high = _nibbles_to_float(packed)
                q = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
                w = (q - zero[:, None]).to(x.dtype)
            part = tl.dot(w, tl.trans(x))
            acc += part * tl.load(scale_ptr + at, mask=col_ok, other=0.0)[:, None]
    else:
        offsets = tl.arange(0, BLOCK_K)
        for k0 in range(k_first, k_end, BLOCK_K):
            k = k0 + offsets
            k_ok = k < K
            if TMA:
                x = x_desc.load([tl.program_id(1) * BLOCK_M, k0])
                q = w_desc.load([tl.program_id(0) * BLOCK_N, k0])
            elif SCHEME == 0:
                x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                q = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
            else:
                x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                q = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if SCHEME == 0:  # int8 values are exact in half precision; the channel's scale comes last
                acc = tl.dot(_int8_to_float(q).to(x.dtype), tl.trans(x), acc)
            else:  # e4m3 × e4m3
                acc = tl.dot(q, tl.trans(x), acc)
        if SCHEME == 0:
            acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[:, None]
        else:
            acc = acc * tl.load(scale_ptr + cols * stride_s, mask=col_ok, other=0.0)[:, None]
            acc = acc * tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if SPLIT_K > 1:
        offsets = rows[None, :].to(tl.int64) * N + cols[:, None]
        tl.store(part_ptr + tl.program_id(2) * M * N + offsets, acc, mask=col_ok[:, None] & row_ok[None, :])
        _sum_splits_on_arrival(part_ptr, out_ptr, bias_ptr, arrivals_ptr + tl.program_id(1) * tl.num_programs(0)
                               + tl.program_id(0), rows, cols, M, N, HAS_BIAS, SPLIT_K)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & row_ok[None, :])


def unsupported(x: torch.Tensor, bias: Optional[torch.Tensor], group_size: int | None = None) -> str | None:
    """Why these kernels cannot take ``x`` (and an int4 layout of ``group_size``), or None."""
    if x.dtype not in DTYPES:
        return f"needs float32, float16 or bfloat16 x (x is {x.dtype})"
    if bias is not None and bias.dtype != x.dtype:
        return f"needs the bias in x's dtype (bias {bias.dtype}, x {x.dtype})"
    if group_size is not None and group_size & (group_size - 1):
        return f"int4 groups of a power of two inputs (group_size {group_size})"
    return None


def _rows(x: torch.Tensor, name: str, bias: Optional[torch.Tensor], group_size: int | None = None) -> torch.Tensor:
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"{name}: tensors are on {x.device}; the Triton kernel needs CUDA tensors, "
                         f"or TRITON_INTERPRET=1 set before this module is imported to run on the CPU.")
    problem = unsupported(x, bias, group_size)
    if problem:
        raise ValueError(f"{name}: {problem}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _block_k(launch: GemvLaunch, in_features: int) -> int:
    return min(launch.block_k, max(16, triton.next_power_of_2(in_features)))


Launch = GemvLaunch | TileLaunch


def _tile_takes(x: torch.Tensor, scheme: int, group_size: int = 0) -> bool:
    # The tile kernel multiplies in x's half-precision dtype (fp8's in e4m3) and steps a whole int4 group of
    # at least tl.dot's 16 columns at a time; elsewhere the GEMV serves every row. A float32 x keeps the
    # GEMV's float32 sums for fp8 too: Hopper's e4m3 MMA accumulates with fewer bits than float32 (a relative
    # error of 4e-5 on the H200, against the reference's 1e-5 at float32).
    if scheme == _INT4 and group_size < 16:
        return False
    return x.dtype in (torch.float16, torch.bfloat16)


def _pick(launch: Optional[Launch], num_rows: int, out_features: int, x: torch.Tensor, scheme: int,
          group_size: int = 0) -> Launch:
    launch = launch or default_launch(scheme, num_rows, out_features, num_sms(x.device), x.shape[-1])
    if isinstance(launch, TileLaunch) and not _tile_takes(x, scheme, group_size):
        return _gemv_launch(scheme, out_features, num_sms(x.device))  # row by row
    return launch


def _fp8_rows(rows: torch.Tensor, input_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` (``[M, K]``, last dim contiguous) in e4m3, and its float32 scale ``[M]``: one
    kernel, the bits of ``quantize_activations_fp8`` (or, with ``input_scale``, the static variant's)."""
    num_rows, in_features = rows.shape
    x = torch.empty((num_rows, in_features), dtype=torch.float8_e4m3fn, device=rows.device)
    x_scale = torch.empty(num_rows, dtype=torch.float32, device=rows.device)
    if num_rows:
        _fp8_rows_kernel[(num_rows,)](
            rows, x, x_scale, input_scale if input_scale is not None else x_scale, in_features, rows.stride(0),
            STATIC_SCALE=input_scale is not None, BLOCK_K=min(2048, max(16, triton.next_power_of_2(in_features))),
            num_warps=4, **dependent_launch(rows.device),
        )
    return x, x_scale


def _tile(x, x_scale, q, scale, zero, bias, out, scheme: int, group_size: int, launch: TileLaunch) -> None:
    # x: [M, K] rows of activations; for fp8 already in e4m3, with their float32 scales x_scale [M].
    num_rows, in_features = x.shape
    out_features = q.shape[0]
    block_m = launch.block_m or min(max(16, triton.next_power_of_2(num_rows)), 64)
    block_k = max(16, min(launch.block_k, group_size) if scheme == _INT4 else _block_k(launch, in_features))
    w_block_k = block_k // 2 if scheme == _INT4 else block_k  # packed int4: two columns a byte
    x_desc = w_desc = None
    hopper = hopper_or_later(x.device)  # TMA, and the packed dequantisation's bf16x2 PTX, need compute capability 9.0
    tma_rows = w_block_k * q.element_size() >= 16  # a TMA tile row: 16 bytes or more
    if launch.tma and (hopper or INTERPRETED) and tma_aligned(x, q) and tma_rows:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor(x, [num_rows, in_features], [x.stride(0), 1], [block_m, block_k])
        w_desc = TensorDescriptor(q, [out_features, q.shape[1]], [q.stride(0), 1], [launch.block_n, w_block_k])
    grid = (triton.cdiv(out_features, launch.block_n), triton.cdiv(num_rows, block_m))
    steps = triton.cdiv(in_features, block_k)
    k_per_split = triton.cdiv(steps, max(1, min(launch.split_k, steps))) * block_k
    split_k = triton.cdiv(in_features, k_per_split)  # no split left without inputs
    split = {}
    if split_k > 1:
        split = dict(SPLIT_K=split_k, K_PER_SPLIT=k_per_split, arrivals_ptr=arrival_counters(grid[0] * grid[1], x.device),
                     part_ptr=torch.empty((split_k, num_rows, out_features), dtype=torch.float32, device=x.device))
    _tile_kernel[(*grid, split_k)](
        x, x_scale if x_scale is not None else scale, q, scale, zero if zero is not None else scale, bias if bias is not None else out, out, x_desc,
        w_desc, num_rows, out_features, in_features, x.stride(0), q.stride(0),
        scale.stride(0) if scheme == _INT4 else (1 if scale.numel() > 1 else 0), SCHEME=scheme, GROUP=group_size,
        HAS_BIAS=bias is not None, TMA=x_desc is not None,
        PACKED_DEQUANT=launch.packed_dequant and scheme == _INT4 and hopper,  # the interpreter runs no PTX
        BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=block_k,
        **split, **launch.options(), **dependent_launch(x.device),
    )


def int8_wo_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], *,
                 launch: Optional[Launch] = None) -> torch.Tensor:
    """``int8_wo_linear`` (same arguments and result): the GEMV for one row, the tile kernel for more (a
    ``launch`` of either kind overrides the choice)."""
    rows = _rows(x, "int8_wo_gemv", bias)
    (out_features, in_features), num_rows = qweight.shape, rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows and out_features:
        launch = _pick(launch, num_rows, out_features, x, _INT8)
        if isinstance(launch, TileLaunch):
            _tile(rows, None, qweight, scale, None, bias, out, _INT8, 0, launch)
        else:
            _int8_gemv_kernel[(triton.cdiv(out_features, launch.block_n), num_rows)](
                rows, qweight, scale, bias if bias is not None else out, out, out_features, in_features, rows.stride(0),
                qweight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=launch.block_n,
                BLOCK_K=_block_k(launch, in_features), **launch.options(), **dependent_launch(x.device),
            )
    return out.view(*x.shape[:-1], out_features)


def int4_wo_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: Optional[torch.Tensor], *,
    launch: Optional[Launch] = None,
) -> torch.Tensor:
    """``int4_wo_linear`` (same arguments and result): the GEMV for one row, the tile kernel for more (a
    ``launch`` of either kind overrides the choice; groups under 16 inputs always take the GEMV)."""
    out_features, in_features = qweight.shape[0], 2 * qweight.shape[1]
    group_size = in_features // scale.shape[1]
    rows = _rows(x, "int4_wo_gemv", bias, group_size)
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows and out_features:
        launch = _pick(launch, num_rows, out_features, x, _INT4, group_size)
        if isinstance(launch, TileLaunch):
            _tile(rows, None, qweight, scale, zero, bias, out, _INT4, group_size, launch)
        elif launch.words and group_size % 8 == 0 and qweight.is_contiguous():
            _int4_words_gemv_kernel[(triton.cdiv(out_features, launch.block_n), num_rows)](
                rows, qweight.view(torch.int32), scale, zero, bias if bias is not None else out, out, out_features, in_features,
                rows.stride(0), qweight.stride(0) // 4, scale.stride(0), GROUP=group_size,
                WORDS=min(launch.words, triton.next_power_of_2(in_features // 8)), HAS_BIAS=bias is not None,
                BLOCK_N=launch.block_n, **launch.options(), **dependent_launch(x.device),
            )
        else:
            _int4_gemv_kernel[(triton.cdiv(out_features, launch.block_n), num_rows)](
                rows, qweight, scale, zero, bias if bias is not None else out, out, out_features, in_features,
                rows.stride(0), qweight.stride(0), scale.stride(0), GROUP=group_size,
                GROUPS_PER_STEP=launch.groups_per_step, HAS_BIAS=bias is not None, BLOCK_N=launch.block_n,
                **launch.options(), **dependent_launch(x.device),
            )
    return out.view(*x.shape[:-1], out_features)


def fp8_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
             input_scale: Optional[torch.Tensor] = None, *, launch: Optional[Launch] = None) -> torch.Tensor:
    """``fp8_linear`` (same arguments and result) in two kernels, where ``torch._scaled_mm`` takes the
    activation quantization's half dozen plus the GEMM: by default the row quantizer (each row of ``x`` to
    e4m3 with the token's scale, as ``quantize_activations_fp8`` does), then the tile kernel (fp8 × fp8 on
    the tensor cores). A ``GemvLaunch`` takes the GEMV instead, which rounds each row as it streams the
    weight rows, in one kernel. With ``input_scale`` (float32 ``[1]``), ``fp8_static_linear``: that one
    scale serves every row."""
    rows = _rows(x, "fp8_gemv", bias)
    (out_features, in_features), num_rows = qweight.shape, rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows and out_features:
        launch = _pick(launch, num_rows, out_features, x, _FP8)
        if isinstance(launch, TileLaunch):
            _tile(*_fp8_rows(rows, input_scale), qweight, scale, None, bias, out, _FP8, 0, launch)
        else:
            _fp8_gemv_kernel[(triton.cdiv(out_features, launch.block_n), num_rows)](
                rows, qweight, scale, input_scale if input_scale is not None else scale,
                bias if bias is not None else out, out, out_features, in_features, rows.stride(0), qweight.stride(0),
                1 if scale.numel() > 1 else 0, HAS_BIAS=bias is not None, STATIC_SCALE=input_scale is not None,
                BLOCK_N=launch.block_n, BLOCK_K=_block_k(launch, in_features), **launch.options(),
                **dependent_launch(x.device),
            )
    return out.view(*x.shape[:-1], out_features)


def fp8_scaled_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                  input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fp8_linear`` (same arguments and result; with ``input_scale``, ``fp8_static_linear``) as the row
    quantizer above, then ``torch._scaled_mm`` (cuBLASLt, row-wise scales): the ``torch`` backend's product
    without its half dozen elementwise kernels for the activations' rounding."""
    x_q, x_scale = _fp8_rows(_rows(x, "fp8_scaled_mm", bias), input_scale)
    return scaled_mm_rows(x_q, x_scale, qweight, scale, bias, x.dtype).view(*x.shape[:-1], qweight.shape[0])


def fp8_prequantized_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: Optional[torch.Tensor], dtype: torch.dtype, *,
                          launch: Optional[TileLaunch] = None) -> torch.Tensor:
    """``fp8_prequantized_linear`` (same arguments and result): the tile kernel (e4m3 × e4m3 on the tensor
    cores) over rows that a norm or activation kernel already rounded, ``x_q [..., K]`` with their float32
    scales ``x_scale [..., 1]``; ``dtype`` is the output's, float16 or bfloat16."""
    if x_q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"fp8_prequantized_gemm: tensors are on {x_q.device}; the Triton kernel needs CUDA tensors, "
                         f"or TRITON_INTERPRET=1 set before this module is imported to run on the CPU.")
    if dtype not in (torch.float16, torch.bfloat16) or (bias is not None and bias.dtype != dtype):
        raise ValueError(f"fp8_prequantized_gemm: writes float16 or bfloat16 with the bias in that dtype "
                         f"(dtype {dtype}, bias {None if bias is None else bias.dtype})")
    out_features, in_features = qweight.shape
    rows = x_q.reshape(-1, in_features).contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=dtype, device=x_q.device)
    if rows.shape[0] and out_features:
        launch = launch or default_launch(_FP8, rows.shape[0], out_features, num_sms(x_q.device), in_features)
        _tile(rows, x_scale.reshape(-1).contiguous(), qweight, scale, None, bias, out, _FP8, 0, launch)
    return out.view(*x_q.shape[:-1], out_features)
