"""Triton backends of ``rms_norm``, ``add_rms_norm`` and ``layer_norm``: one pass over each row, float32 statistics.

A norm reads a row once and writes it once, so it is bound by memory traffic; the kernel's whole job
is to keep that one read and one write. Each program loads ``rows_per_program`` whole rows as one
``[rows, next_pow2(H)]`` tile (padding masked), reduces in float32 registers, scales, and stores in
``x``'s dtype. A whole row in registers caps the hidden size at :data:`MAX_HIDDEN` (32768, twice Llama
3.1 405B's), and saves the second read that a loop over column blocks would need. Narrow rows share a
program, so a program still moves enough bytes to hide its launch and reduction latency.

Measured on an H200, bfloat16 ``[8192, 4096]``: rms_norm 38 µs (3.5 TB/s; ``torch.rms_norm`` 46 µs),
layer_norm 41 µs (``F.layer_norm`` 59 µs). A decode-sized ``[4, 4096]`` call costs about 27 µs, nearly
all of it Triton's host-side launch, against torch's 11 µs: outside CUDA graphs small batches favour torch.

Semantics are those of ``rms_norm_reference`` and ``layer_norm_reference``: float32 statistics and
scaling, the weight (plus ``weight_offset``) and bias cast to float32 first, one rounding to ``x``'s
dtype at the end; the output is contiguous, in ``x``'s shape. Any leading dims are flattened to rows;
``x`` may be a strided view whose last dim is contiguous (else it is copied first). ``add_rms_norm``'s
kernel is the RMSNorm kernel with a second input: it adds ``x`` and ``residual`` in float32, stores the
sum rounded to their dtype, and normalises that rounded sum (``add_rms_norm_reference``'s semantics), so
the residual stream costs two reads and two writes per row instead of the unfused three and two. Its
``add_rms_norm_fp8`` variant writes the norm as e4m3 rows with a float32 scale each, for the fp8 GEMM
after it (``custom_ops/fp8_activations.py``): the row is whole in registers, so its max |x| is one more
reduction.

Example (on a CPU with ``TRITON_INTERPRET=1`` set before the import, as the tests do)::

    import torch
    from autodeploy.custom_ops.triton.norms import add_rms_norm_triton, rms_norm_triton, layer_norm_triton

    x = torch.randn(2, 7, 4096, dtype=torch.bfloat16, device="cuda")
    weight = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    y = rms_norm_triton(x, weight, 1e-6)                  # Llama
    y = rms_norm_triton(x, weight - 1, 1e-6, 1.0)         # Gemma stores weight - 1
    z = layer_norm_triton(x, weight, torch.zeros_like(weight), 1e-5)
    normed, total = add_rms_norm_triton(x, torch.randn_like(x), weight, 1e-6)  # total: x + residual
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import INTERPRETED, SUPPORTED_DTYPES
from .fp8 import fp8_row_scale, to_e4m3
from .launch import dependent_launch, wait_for_previous_kernel

MAX_HIDDEN = 32768


@dataclass(frozen=True)
class NormConfig:
    """How the norm kernels are launched: whole rows per program, and warps per program."""

    rows_per_program: int
    num_warps: int


# The launch space: every variant is correct for every size. valid_configs() keeps those whose tile
# fits in registers (past _MAX_VALUES_PER_THREAD a thread spills, and compiles and runs slowly).
CONFIGS = tuple(NormConfig(rows, warps) for rows in (1, 2, 4, 8, 16) for warps in (1, 2, 4, 8, 16))
_MAX_VALUES_PER_THREAD = 64


def valid_configs(hidden: int) -> tuple[NormConfig, ...]:
    """The :data:`CONFIGS` whose ``[rows, next_pow2(hidden)]`` tile stays in registers: the autotuner's space."""
    block = triton.next_power_of_2(hidden)
    return tuple(c for c in CONFIGS if c.rows_per_program * block <= _MAX_VALUES_PER_THREAD * 32 * c.num_warps)


def norm_config(num_rows: int, hidden: int) -> NormConfig:
    """The default launch (one of :func:`valid_configs`): tiles of about 2048 elements, 16 values a
    thread; 16 warps, 64 values a thread, for the widest rows."""
    block = triton.next_power_of_2(hidden)
    # Pack narrow rows to ~2048 elements a program; a batch with few rows keeps one row each.
    rows = max(1, min(2048 // block, 16, triton.next_power_of_2(num_rows)))
    return NormConfig(rows, num_warps=max(1, min(rows * block // 512, 16)))


@triton.jit
def _load_rows(x_ptr, stride_row, num_rows, ROWS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's rows as a float32 ``[ROWS, BLOCK_H]`` tile; zeros outside ``[num_rows, HIDDEN]``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < HIDDEN)
    x = tl.load(x_ptr + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32), rows, cols, mask


@triton.jit
def _rms_normalise(x, cols, weight_ptr, eps, weight_offset, HIDDEN: tl.constexpr):
    """The float32 tile ``x`` RMS-normalised per row and scaled by ``weight + weight_offset`` (zero padding
    adds nothing to the sums of squares)."""
    inverse_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32) + weight_offset
    return x * inverse_rms[:, None] * weight[None, :]


@triton.jit(do_not_specialize=["num_rows"])  # the token count: one compile for all
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, stride_row, num_rows, eps, weight_offset,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    x, rows, cols, mask = _load_rows(x_ptr, stride_row, num_rows, ROWS, HIDDEN, BLOCK_H)
    out = _rms_normalise(x, cols, weight_ptr, eps, weight_offset, HIDDEN)
    tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_residual, num_rows, eps, weight_offset,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr,
    FP8_OUT: tl.constexpr = False, scale_ptr=None,
):
    wait_for_previous_kernel(USE_PDL)
    x, rows, cols, mask = _load_rows(x_ptr, stride_x, num_rows, ROWS, HIDDEN, BLOCK_H)
    residual, _, _, _ = _load_rows(residual_ptr, stride_residual, num_rows, ROWS, HIDDEN, BLOCK_H)
    # The sum is rounded to the model's dtype before it is normalised, as the unfused add rounds it.
    total = (x + residual).to(sum_ptr.dtype.element_ty)
    offsets = rows[:, None] * HIDDEN + cols[None, :]
    tl.store(sum_ptr + offsets, total, mask=mask)
    out = _rms_normalise(total.to(tl.float32), cols, weight_ptr, eps, weight_offset, HIDDEN)
    if FP8_OUT:
        # add_rms_norm_fp8: the norm rounded to the model's dtype (the unfused norm's output), then each
        # row to e4m3 with its own scale (quantize_activations_fp8's bits): out_ptr holds e4m3.
        normed = out.to(sum_ptr.dtype.element_ty).to(tl.float32)
        x_scale = fp8_row_scale(tl.max(tl.abs(normed), axis=1))
        tl.store(out_ptr + offsets, to_e4m3(normed, x_scale[:, None]), mask=mask)
        tl.store(scale_ptr + rows, x_scale, mask=rows < num_rows)
    else:
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])  # the token count: one compile for all
def _layer_norm_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, stride_row, num_rows, eps,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    x, rows, cols, mask = _load_rows(x_ptr, stride_row, num_rows, ROWS, HIDDEN, BLOCK_H)
    mean = tl.sum(x, axis=1) / HIDDEN
    # A row far from zero rounds that sum; the centred values' own mean is the rounding, taken back out
    # (corrected two-pass, free in registers: x ≈ 1000 ± 1 lands 2.6× nearer the float64 result, measured).
    mean += tl.sum(tl.where(mask, x - mean[:, None], 0.0), axis=1) / HIDDEN
    # The padding must not join the variance: centre only the real columns.
    centred = tl.where(mask, x - mean[:, None], 0.0)
    variance = tl.sum(centred * centred, axis=1) / HIDDEN  # biased, as F.layer_norm
    out = centred * tl.rsqrt(variance + eps)[:, None]
    if HAS_WEIGHT:
        out *= tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    *,
    config: Optional[NormConfig] = None,
) -> torch.Tensor:
    """``rms_norm`` with the Triton kernel: same arguments, same result as ``rms_norm_reference``.

    ``config`` overrides :func:`norm_config`'s launch. Raises ``ValueError`` for inputs the kernel
    does not take (dtype, hidden size, device, weight shape).
    """
    rows = _check_and_flatten("rms_norm_triton", x, weight=weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.numel() == 0:
        return out
    config = config or norm_config(rows.shape[0], rows.shape[1])
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], config.rows_per_program),)](
        rows, weight.contiguous(), out, rows.stride(0), rows.shape[0], eps, weight_offset,
        HIDDEN=rows.shape[1], BLOCK_H=triton.next_power_of_2(rows.shape[1]), ROWS=config.rows_per_program,
        num_warps=config.num_warps, **dependent_launch(out.device),
    )
    return out


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    *,
    config: Optional[NormConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` in one kernel: reads ``x`` and ``residual`` once, writes the norm and the sum;
    same arguments, same result as ``add_rms_norm_reference``.

    ``config`` overrides :func:`norm_config`'s launch. Raises ``ValueError`` for inputs the kernel
    does not take (dtype, hidden size, device, weight shape, a residual of another shape or dtype).
    """
    return _add_rms_norm(x, residual, weight, eps, weight_offset, config, fp8=False)


def add_rms_norm_fp8_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            weight_offset: float = 0.0, *, config: Optional[NormConfig] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm_fp8`` in one kernel: :func:`add_rms_norm_triton` whose norm leaves as e4m3 rows with
    their float32 scales, ``(x_q, x_scale [..., 1], total)``; same result as ``add_rms_norm_fp8_reference``.
    A norm row is whole in one program, so its max |x| costs one more reduction and no second pass."""
    return _add_rms_norm(x, residual, weight, eps, weight_offset, config, fp8=True)


def _add_rms_norm(x, residual, weight, eps, weight_offset, config, *, fp8: bool):
    name = "add_rms_norm_fp8_triton" if fp8 else "add_rms_norm_triton"
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"{name}: residual must have x's shape and dtype {tuple(x.shape)} {x.dtype}; "
            f"got {tuple(residual.shape)} {residual.dtype}."
        )
    rows = _check_and_flatten(name, x, weight=weight)
    residual_rows = _check_and_flatten(name, residual)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x_scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if fp8 else None
    if rows.numel():
        config = config or norm_config(rows.shape[0], rows.shape[1])
        _add_rms_norm_kernel[(triton.cdiv(rows.shape[0], config.rows_per_program),)](
            rows, residual_rows, weight.contiguous(), out, total, rows.stride(0), residual_rows.stride(0),
            rows.shape[0], eps, weight_offset,
            HIDDEN=rows.shape[1], BLOCK_H=triton.next_power_of_2(rows.shape[1]), ROWS=config.rows_per_program,
            FP8_OUT=fp8, scale_ptr=x_scale, num_warps=config.num_warps, **dependent_launch(out.device),
        )
    return (out, x_scale, total) if fp8 else (out, total)


def layer_norm_triton(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    *,
    config: Optional[NormConfig] = None,
) -> torch.Tensor:
    """``layer_norm`` with the Triton kernel: same arguments, same result as ``layer_norm_reference``.

    ``weight`` and ``bias`` may each be None. ``config`` overrides :func:`norm_config`'s launch.
    Raises ``ValueError`` for inputs the kernel does not take (dtype, hidden size, device, shapes).
    """
    rows = _check_and_flatten("layer_norm_triton", x, weight=weight, bias=bias)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.numel() == 0:
        return out
    config = config or norm_config(rows.shape[0], rows.shape[1])
    _layer_norm_kernel[(triton.cdiv(rows.shape[0], config.rows_per_program),)](
        rows, None if weight is None else weight.contiguous(), None if bias is None else bias.contiguous(), out,
        rows.stride(0), rows.shape[0], eps,
        HIDDEN=rows.shape[1], BLOCK_H=triton.next_power_of_2(rows.shape[1]), ROWS=config.rows_per_program,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, num_warps=config.num_warps,
    )
    return out


def _check_and_flatten(op: str, x: torch.Tensor, **params: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` as ``[rows, H]`` with a contiguous last dim (a view where possible); ``ValueError`` for
    an input the kernels cannot take."""
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"{op}: x is on {x.device}; the Triton kernels need CUDA tensors, "
            f"or TRITON_INTERPRET=1 set before this module is imported to run on the CPU."
        )
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: x must be one of {SUPPORTED_DTYPES}; got {x.dtype}. Use the reference backend.")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(
            f"{op}: hidden sizes up to {MAX_HIDDEN} are supported (a whole row is one tile); got {hidden}."
        )
    for name, param in params.items():
        if param is not None and param.shape != (hidden,):
            raise ValueError(f"{op}: {name} must be [H={hidden}] for x {tuple(x.shape)}; got {tuple(param.shape)}.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, hidden)
