"""Triton backends of ``int8_wo_linear``, ``int4_wo_linear`` and ``fp8_linear`` for decode rows: dequantise in the GEMV.

A decode step's projections read their whole weight for a few rows of activations. A weight-only
scheme's floor is its stored bytes over the memory bandwidth: half a bf16 weight's for int8, a quarter
(plus the group scales) for int4. Each program streams ``BLOCK_N`` weight rows for one row of ``x``,
dequantises in registers and keeps float32 sums:

- int8 (:func:`_int8_gemv_kernel`): ``Σ_k q[n, k] · x[k]``, times the row's scale once at the end;
- int4 (:func:`_int4_gemv_kernel`): ``GROUPS_PER_STEP`` groups of ``GROUP`` inputs (``GROUP / 2`` packed
  bytes each) a step, the low and high nibbles against the even and odd ``x``; a group adds
  ``scale[n, g] · (Σ q · x − zero[n, g] · Σ x)``;
- fp8 (:func:`_fp8_gemv_kernel`): the row's max |x| first (or the layer's static scale), then
  ``Σ_k w[n, k] · round_e4m3(x[k] / s_x)``, times ``s_x`` and the channel's (or tensor's) weight scale.

More rows re-read the weight (from L2 while it stays there): the autotuner keeps these kernels where they
beat the reference, at decode sizes. Results are the reference's up to float32 summation order, rounded
once to ``x``'s dtype.

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

from . import INTERPRETED
from .launch import dependent_launch, wait_for_previous_kernel

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GemvLaunch:
    """How a dequantising GEMV is launched: weight rows a program (``block_n``: Llama-3-8B's 4,096-row
    projections give 256 programs a row of x at 16), int8/fp8 input columns a step (``block_k``), int4
    groups a step (``groups_per_step``), warps, and pipeline stages (None: Triton's default). Sizes are
    powers of two.
    ``scripts/sweep_quantized_gemv.py`` times others against the default on a GPU."""

    block_n: int = 16
    block_k: int = 512
    groups_per_step: int = 1
    num_warps: int = 4
    num_stages: Optional[int] = None

    def options(self) -> dict:
        return {"num_warps": self.num_warps, **({} if self.num_stages is None else {"num_stages": self.num_stages})}


DEFAULT_LAUNCH = GemvLaunch()


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
        acc += q.to(tl.float32) * x[None, :]
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
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for first in range(0, num_groups, GROUPS_PER_STEP):
        groups = first + steps  # [S]
        group_ok = groups < num_groups
        x_at = x_ptr + row * stride_xm + groups[:, None] * GROUP + 2 * pairs[None, :]  # [S, GROUP / 2]
        x_even = tl.load(x_at, mask=group_ok[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_at + 1, mask=group_ok[:, None], other=0.0).to(tl.float32)
        packed = tl.load(q_ptr + cols[:, None, None].to(tl.int64) * stride_q + groups[None, :, None] * (GROUP // 2)
                         + pairs[None, None, :], mask=col_ok[:, None, None] & group_ok[None, :, None], other=0)
        low, high = (packed & 0x0F).to(tl.float32), (packed >> 4).to(tl.float32)  # [BLOCK_N, S, GROUP / 2]
        products = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)  # [BLOCK_N, S]
        tiles = cols[:, None] * stride_s + groups[None, :]
        tile_ok = col_ok[:, None] & group_ok[None, :]
        zero = tl.load(zero_ptr + tiles, mask=tile_ok, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + tiles, mask=tile_ok, other=0.0)
        acc += tl.sum(scale * (products - zero * tl.sum(x_even + x_odd, axis=1)[None, :]), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


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
    if STATIC_SCALE:  # the layer's one scale, from calibration
        x_scale = tl.load(input_scale_ptr)
    else:  # the token's scale: max |x| / 448 (1 for an all-zero row)
        peak = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offsets
            peak = tl.maximum(peak, tl.abs(tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)))
        x_scale = tl.max(peak, axis=0) / 448.0
        x_scale = tl.where(x_scale > 0, x_scale, 1.0)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offsets
        k_ok = k < K
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
        # x / scale correctly rounded, then to e4m3 to nearest even: the bits torch's rounding gives
        x_q = tl.clamp(tl.math.div_rn(x, x_scale + tl.zeros_like(x)), -448.0, 448.0)
        x_q = x_q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
        q = tl.load(q_ptr + cols[:, None].to(tl.int64) * stride_q + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += q.to(tl.float32) * x_q[None, :]
    total = tl.sum(acc, axis=1) * x_scale * tl.load(scale_ptr + cols * stride_s, mask=col_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


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


def int8_wo_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], *,
                 launch: GemvLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """``int8_wo_linear`` (same arguments and result) with the dequantising GEMV kernel."""
    rows = _rows(x, "int8_wo_gemv", bias)
    (out_features, in_features), num_rows = qweight.shape, rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows and out_features:
        _int8_gemv_kernel[(triton.cdiv(out_features, launch.block_n), num_rows)](
            rows, qweight, scale, bias if bias is not None else out, out, out_features, in_features, rows.stride(0),
            qweight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=launch.block_n, BLOCK_K=_block_k(launch, in_features),
            **launch.options(), **dependent_launch(x.device),
        )
    return out.view(*x.shape[:-1], out_features)


def int4_wo_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: Optional[torch.Tensor], *,
    launch: GemvLaunch = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """``int4_wo_linear`` (same arguments and result) with the dequantising GEMV kernel."""
    out_features, in_features = qweight.shape[0], 2 * qweight.shape[1]
    group_size = in_features // scale.shape[1]
    rows = _rows(x, "int4_wo_gemv", bias, group_size)
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows and out_features:
        _int4_gemv_kernel[(triton.cdiv(out_features, launch.block_n), num_rows)](
            rows, qweight, scale, zero, bias if bias is not None else out, out, out_features, in_features,
            rows.stride(0), qweight.stride(0), scale.stride(0), GROUP=group_size, GROUPS_PER_STEP=launch.groups_per_step,
            HAS_BIAS=bias is not None, BLOCK_N=launch.block_n, **launch.options(), **dependent_launch(x.device),
        )
    return out.view(*x.shape[:-1], out_features)


def fp8_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
             input_scale: Optional[torch.Tensor] = None, *, launch: GemvLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """``fp8_linear`` (same arguments and result) as one GEMV: each program rounds its row of ``x`` to e4m3
    with the token's scale (as ``quantize_activations_fp8`` does) while it streams the fp8 weight rows, so
    a decode row costs one kernel instead of the activation quantization's half dozen plus the GEMM. With
    ``input_scale`` (float32 ``[1]``), ``fp8_static_linear``: that one scale serves every row."""
    rows = _rows(x, "fp8_gemv", bias)
    (out_features, in_features), num_rows = qweight.shape, rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows and out_features:
        _fp8_gemv_kernel[(triton.cdiv(out_features, launch.block_n), num_rows)](
            rows, qweight, scale, input_scale if input_scale is not None else scale, bias if bias is not None else out, out,
            out_features, in_features, rows.stride(0), qweight.stride(0), 1 if scale.numel() > 1 else 0,
            HAS_BIAS=bias is not None, STATIC_SCALE=input_scale is not None, BLOCK_N=launch.block_n,
            BLOCK_K=_block_k(launch, in_features), **launch.options(), **dependent_launch(x.device),
        )
    return out.view(*x.shape[:-1], out_features)
