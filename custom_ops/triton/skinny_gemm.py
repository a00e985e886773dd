"""Triton backend of ``linear`` for few rows: ``x[M, K] @ weight[N, K]ᵀ`` when ``M`` is a decode batch.

With one to a few dozen rows a projection reads its whole weight once and does almost no arithmetic, so
its floor is the weight's bytes over the memory bandwidth. cuBLAS reaches 72% of that floor for the
Llama-3-8B q/k/v projection at one row and 63% for o_proj (the H200 profile in ``notes/perf.md``): its
M = 1 kernels tile the weight in too few, too large blocks for those widths, and split ``K`` across a
second reduction kernel. Here every program streams a ``[BLOCK_N, K / SPLIT_K]`` slab of contiguous
weight rows, so a 4096 × 4096 weight is spread over hundreds of programs, all loading at once:

- one row (``M = 1``, :func:`_gemv_kernel`): an element-wise multiply into a ``[BLOCK_N, BLOCK_K]``
  float32 accumulator, summed over ``K`` once at the end (no tensor cores needed, any ``BLOCK_N``);
- more rows (:func:`_skinny_kernel`): ``tl.dot`` of a ``[BLOCK_M ≥ 16, BLOCK_K]`` tile of ``x`` (rows past
  ``M`` masked to zero) with the weight tile, accumulated in float32; :func:`_skinny_swapped_kernel` with
  the weight tile as the dot's left operand, and :func:`_skinny_tma_kernel` the same with both tiles
  fetched by Hopper's TMA unit (``SkinnyConfig.tma``), the default on Hopper: 1 – 9% faster than the
  swapped kernel at 32 rows in ``scripts/sweep_skinny_gemm.py``;
- a gated MLP's gate/up GEMM with its activation (:func:`skinny_gated_linear`): the TMA kernel with an
  ``ACTIVATION``, where a program owns ``BLOCK_N`` columns of ``act(x·gateᵀ) · (x·upᵀ)``, fetches the gate
  tile and the up tile ``I`` rows below it through one weight descriptor each step into two float32
  accumulators, and writes the product (``gated_activation.activate``'s formulas). It saves the separate
  activation kernel and the ``[rows, 2I]`` round trip: Llama-3-8B's gate/up at 32 rows on an H200, 57.9 µs
  against 61.4 for the two kernels (``scripts/sweep_skinny_gemm.py gated``).

When the weight is too narrow to fill the card (fewer than ``4 × SMs`` programs) ``K`` is split and each
split writes float32 partial sums that are added in a fixed order (deterministic, unlike atomic adds),
with the bias: by the TMA kernel's last split of each tile to arrive (an arrival counter, no second kernel),
by :func:`_split_sum_kernel` after the other kernels. Math in float32, one rounding to ``x``'s dtype: the reference's result up
to the half-precision contract. :func:`skinny_config` picks the launch from the shape alone (no timing:
the op runs inside CUDA-graph capture, where a benchmark cannot), and the autotuner decides per
token bucket whether this backend beats cuBLAS at all.

Example (on a CPU with ``TRITON_INTERPRET=1`` set before the import, as the tests do)::

    import torch
    from autodeploy.custom_ops.triton.skinny_gemm import skinny_linear

    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(6144, 4096, dtype=torch.bfloat16, device="cuda")
    out = skinny_linear(x, weight, None)               # [1, 6144], x @ weight.T
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ..fused_gated_mlp import fused_gated_mlp_inner_size
from . import INTERPRETED, hopper_or_later
from .gated_activation import ACTIVATIONS, activate, check_gemm_weights, gated_activation
from .launch import arrival_counters, dependent_launch, wait_for_previous_kernel

DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SkinnyConfig:
    """How the kernel is launched: rows of ``x``, weight rows and reduction columns per program (``block_m``
    is 1 for the one-row kernel, else at least 16: ``tl.dot``'s smallest tile), ``K`` splits, warps, stages,
    and which several-row kernel runs (``swap``, ``tma``; a ``tma`` launch whose rows or weight are not
    16-byte aligned runs the swapped kernel)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # several rows: the weight tile as the dot's left operand (out[N, M] = W · xᵀ)
    tma: bool = False  # swapped only: the tiles fetched by the Tensor Memory Accelerator (Hopper), not by threads


def skinny_config(rows: int, out_features: int, in_features: int, num_sms: int, tma: bool = False) -> SkinnyConfig:
    """The launch for ``x[rows, in_features] @ weight[out_features, in_features]ᵀ`` on ``num_sms`` SMs, with
    the TMA kernel for several rows when ``tma`` (a Hopper GPU).

    From ``scripts/sweep_skinny_gemm.py`` on an H200 (``notes/perf.md``), Llama-3-8B's projections:

    - one row: narrow weight blocks (8 rows, 1,024 columns a step) put hundreds of programs on the card,
      all resident and streaming;
    - several rows: the swapped kernel over 64 weight rows and 256 columns a step, best or within 3% of
      the best at 8 and 32 rows for every projection but gate/up, whose 28,672-row weight does best
      stepping 64 columns (57.7 against 61.0 µs at 32 rows);
    - ``K`` is split only where the blocks leave SMs idle and each split keeps at least 4,096 columns (a
      split's partial sums cost a second kernel: o_proj split in two measured 12.0 against 10.4 µs at one
      row, 12.6 against 11.9 µs at 32; the 14,336-deep down projection gains from it);
    - on Hopper, several rows take the TMA kernel: at 32 rows (2026-12-03 sweep) q/k/v 15.7 µs (128 columns
      a step) against the swapped kernel's 16.6, o_proj 10.3 against 11.2 and down 30.3 against 30.8 (256
      columns a step), gate/up 58.1 against 63.1 (128 weight rows × 128 columns, three stages; cuBLAS 57.3).
    """
    if rows == 1:
        block_m, block_n, block_k, swap = 1, 8, 1024, False
    elif tma:
        block_m, swap = min(max(16, triton.next_power_of_2(rows)), 64), False
        block_n, block_k = (128, 128) if out_features >= 16384 else (64, 256 if out_features <= 4096 else 128)
    else:
        block_m, swap = min(max(16, triton.next_power_of_2(rows)), 64), True
        block_n, block_k = 64, 64 if out_features >= 16384 else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(in_features)))
    programs = triton.cdiv(out_features, block_n) * triton.cdiv(rows, block_m)
    split = 1
    while programs * split < num_sms // 2 and in_features // (2 * split) >= 4096:
        split *= 2
    # Up to four stages of the x and weight tiles in flight (three for the 128-row TMA tiles, as swept), as
    # many as fit in shared memory (64 rows of x beside 64 weight rows, 256 columns a step, take 64 KB a
    # stage: three).
    most = 3 if tma and block_n == 128 else 4
    stages = max(1, min(most, _PIPELINE_BYTES // ((block_m + block_n) * block_k * 2)))
    return SkinnyConfig(block_m, block_n, block_k, split, num_stages=stages, swap=swap, tma=tma and rows > 1)


def skinny_gated_config(rows: int, inner: int, in_features: int, num_sms: int, tma: bool = False) -> SkinnyConfig:
    """The launch of :func:`skinny_gated_linear` for ``gate_up_weight[2 · inner, in_features]``: that weight's
    :func:`skinny_config` with half its ``block_n`` (rows of each half), so a step fetches as many weight rows
    into as much shared memory over as many programs, and ``K`` never split (the activation needs whole sums).
    Up to four stages, as fit: at 32 rows for Llama-3-8B's gate/up (64 rows a half, 128 columns a step) 57.9
    µs with four against 58.8 with three, and 61.4 for the GEMM and the activation kernel apart
    (``scripts/sweep_skinny_gemm.py gated`` on an H200, 2026-12-03).
    """
    config = skinny_config(rows, 2 * inner, in_features, num_sms, tma=tma)
    if not config.tma:
        return replace(config, block_n=config.block_n // 2, split_k=1)
    stages = max(1, min(4, _PIPELINE_BYTES // ((config.block_m + config.block_n) * config.block_k * 2)))
    return replace(config, block_n=config.block_n // 2, split_k=1, num_stages=stages)


_PIPELINE_BYTES = 200 << 10  # of the H100/H200's 227 KB of shared memory a block, with room for the epilogue


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, N, K, w_row_stride,
    HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program: BLOCK_N weight rows × one K split, for the single row of x.
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_row_stride + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        if MASKED:
            in_k = (offs_k + k0) < K
            x = tl.load(x_ptrs, mask=in_k, other=0.0)
            w = tl.load(w_ptrs, mask=(cols[:, None] < N) & in_k[None, :], other=0.0)
        else:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    total = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)
    else:
        tl.store(out_ptr + pid_k * N + cols, total, mask=cols < N)


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_row_stride, w_row_stride,
    HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program: BLOCK_M rows of x × BLOCK_N weight rows × one K split, on the tensor cores.
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_row_stride + offs_k[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_row_stride + offs_k[None, :]
    in_m = rows[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        if MASKED:
            in_k = (offs_k[None, :] + k0) < K
            x = tl.load(x_ptrs, mask=in_m & in_k, other=0.0)
            w = tl.load(w_ptrs, mask=(cols[:, None] < N) & in_k, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=in_m, other=0.0)
            w = tl.load(w_ptrs)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = in_m & (cols[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _store_swapped(acc, rows, cols, pid_k, bias_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    # A swapped tile acc[BLOCK_N, BLOCK_M] into out[M, N]: with the bias and in out's dtype when K is whole,
    # else as float32 partial sums of split pid_k.
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[None, :] * N + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + rows[None, :] * N + cols[:, None], acc, mask=mask)


@triton.jit
def _skinny_swapped_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_row_stride, w_row_stride,
    HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # _skinny_kernel with the operands swapped: acc[BLOCK_N, BLOCK_M] = w_tile · x_tileᵀ, so the wide weight
    # tile is the dot's M side (64+ rows: Hopper's warpgroup MMA) and the few rows of x its N side.
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_row_stride + offs_k[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_row_stride + offs_k[None, :]
    in_m = rows[:, None] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        if MASKED:
            in_k = (offs_k[None, :] + k0) < K
            x = tl.load(x_ptrs, mask=in_m & in_k, other=0.0)
            w = tl.load(w_ptrs, mask=(cols[:, None] < N) & in_k, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=in_m, other=0.0)
            w = tl.load(w_ptrs)
        acc += tl.dot(w, tl.trans(x))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store_swapped(acc, rows, cols, pid_k, bias_ptr, out_ptr, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _skinny_tma_kernel(
    x_desc, w_desc, bias_ptr, out_ptr, sum_ptr, arrivals_ptr, M, N, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr, ACTIVATION: tl.constexpr = None,
):
    # _skinny_swapped_kernel with its tiles fetched through tensor descriptors: on Hopper the TMA unit copies
    # each tile into shared memory (past the tensor's edges as zeros), so no thread computes addresses or
    # masks, and the loop keeps NUM_STAGES tiles in flight.
    # With an ACTIVATION the weight is gate_up[2N, K] and out[M, N] = act(x·gateᵀ) · (x·upᵀ): each step also
    # fetches the up tile N rows below the gate tile, into a second accumulator (SPLIT_K is 1: the activation
    # needs whole sums). A gate tile that runs past row N reads up rows, whose columns the store masks.
    # With SPLIT_K > 1, out_ptr holds the float32 partial sums and the last split of a tile to arrive adds
    # them into sum_ptr (_sum_splits_on_arrival): no second kernel.
    wait_for_previous_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        k = pid_k * K_PER_SPLIT + k0
        w = w_desc.load([pid_n * BLOCK_N, k])
        x = tl.trans(x_desc.load([pid_m * BLOCK_M, k]))
        acc = tl.dot(w, x, acc)
        if ACTIVATION is not None:
            up = tl.dot(w_desc.load([N + pid_n * BLOCK_N, k]), x, up)
    if ACTIVATION is not None:
        acc = activate(acc, ACTIVATION) * up
    _store_swapped(acc, rows, cols, pid_k, bias_ptr, out_ptr, M, N, HAS_BIAS, SPLIT_K)
    if SPLIT_K > 1:
        _sum_splits_on_arrival(out_ptr, sum_ptr, bias_ptr, arrivals_ptr + pid_m * tl.num_programs(0) + pid_n,
                               rows, cols, M, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _sum_splits_on_arrival(part_ptr, sum_ptr, bias_ptr, arrival, rows, cols, M, N, HAS_BIAS: tl.constexpr,
                           SPLIT_K: tl.constexpr):
    # The tile's split programs count their arrival once their partial sums are stored (the barrier puts
    # every thread's stores before the counter's release); the last adds the partials in split order, as
    # _split_sum_kernel does (the same bits), and resets the counter for the next launch (a replayed
    # graph's too). The partials were written by other programs: loads go through L2 (.cg), not L1.
    tl.debug_barrier()
    if tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1:
        mask = (cols[:, None] < N) & (rows[None, :] < M)
        offsets = rows[None, :] * N + cols[:, None]
        total = tl.load(part_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        for split in tl.static_range(1, SPLIT_K):
            total += tl.load(part_ptr + split * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        tl.store(sum_ptr + offsets, total.to(sum_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(arrival, 0, sem="relaxed")


@triton.jit
def _split_sum_kernel(
    part_ptr, bias_ptr, out_ptr, total, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # out[i] = Σ_s part[s, i] (+ bias[i % N]) over the flattened [M, N] output, splits in a fixed order.
    wait_for_previous_kernel(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + split * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count will do, an H200's keeps the CPU tests' launches like the GPU's
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether the TMA unit can fetch tiles of these row-major tensors: 16-byte aligned bases and row
    strides (else thread loads serve the launch)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, config: Optional[SkinnyConfig] = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x[..., K]`` with few rows, ``weight[N, K]`` with contiguous rows and
    ``bias[N]`` or None, all float16 or bfloat16 in one dtype; returns ``[..., N]`` in that dtype.

    ``x``'s rows may be strided (the gate half of a ``[T, 2I]`` GEMM output is read in place); other layouts
    are copied first. ``config`` overrides :func:`skinny_config`'s launch. Raises ``ValueError`` for inputs
    the kernel does not take.
    """
    rows = _input_rows("skinny_linear", x, weight, bias)
    num_rows, in_features = rows.shape
    out_features = weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out.view(*x.shape[:-1], out_features)
    if in_features == 0:
        out.zero_()
        return (out if bias is None else out.add_(bias)).view(*x.shape[:-1], out_features)
    config = config or skinny_config(num_rows, out_features, in_features, num_sms(x.device), tma=hopper_or_later(x.device))
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(in_features, split), config.block_k) * config.block_k
    split = triton.cdiv(in_features, k_per_split)  # a split past the end would only add zeros
    masked = in_features % k_per_split != 0 or out_features % config.block_n != 0
    target = out if split == 1 else torch.empty((split, num_rows, out_features), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    common = dict(
        HAS_BIAS=bias is not None, MASKED=masked, K_PER_SPLIT=k_per_split, SPLIT_K=split, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
        **dependent_launch(x.device),
    )
    grid = (triton.cdiv(out_features, config.block_n), triton.cdiv(num_rows, config.block_m), split)
    if config.block_m == 1:
        if num_rows != 1:
            raise ValueError(f"skinny_linear: a block_m = 1 launch takes one row of x; got {num_rows}.")
        _gemv_kernel[(triton.cdiv(out_features, config.block_n), split)](
            rows, weight, bias_arg, target, out_features, in_features, weight.stride(0), **common
        )
    elif config.tma and tma_aligned(rows, weight):
        _launch_tma_kernel(rows, weight, bias, target, out_features, config, k_per_split, split, out=out)
        return out.view(*x.shape[:-1], out_features)  # a split launch sums its partials itself
    else:
        kernel = _skinny_swapped_kernel if config.swap or config.tma else _skinny_kernel
        kernel[grid](
            rows, weight, bias_arg, target, num_rows, out_features, in_features, rows.stride(0), weight.stride(0),
            BLOCK_M=config.block_m, **common,
        )
    if split > 1:
        total = num_rows * out_features
        _split_sum_kernel[(triton.cdiv(total, 1024),)](
            target, bias_arg, out, total, out_features, HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=1024,
            num_warps=4, **dependent_launch(x.device),
        )
    return out.view(*x.shape[:-1], out_features)


def skinny_gated_linear(
    x: torch.Tensor, gate_up_weight: torch.Tensor, activation: str, *, config: Optional[SkinnyConfig] = None
) -> torch.Tensor:
    """``act(x @ gateᵀ) * (x @ upᵀ)`` for ``x[..., H]`` with few rows and ``gate_up_weight[2I, H]`` (gate rows
    first, contiguous rows), float16 or bfloat16 in one dtype; returns ``[..., I]`` in that dtype, the
    activation and product in float32 and rounded once.

    Several rows on Hopper take one kernel: the TMA kernel with the activation in its epilogue, at
    :func:`skinny_gated_config`'s launch or ``config`` (``block_n`` rows of each half, ``split_k`` 1). Any
    other case (one row, an older GPU, rows TMA cannot fetch, a ``config`` that is not ``tma``) runs
    :func:`skinny_linear` at its own launch and then ``gated_activation`` over the output's two halves, in
    place over the gate half (the result's rows are then ``2I`` apart). Raises ``ValueError`` for an unknown
    activation or inputs the kernels do not take.

    Example::

        x = torch.randn(32, 4096, dtype=torch.bfloat16, device="cuda")
        gate_up = torch.randn(2 * 14336, 4096, dtype=torch.bfloat16, device="cuda")
        h = skinny_gated_linear(x, gate_up, "silu")    # [32, 14336], silu(x @ gate.T) * (x @ up.T)
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"skinny_gated_linear: unknown activation {activation!r}; allowed: {', '.join(ACTIVATIONS)}.")
    rows = _input_rows("skinny_gated_linear", x, gate_up_weight, None)
    if gate_up_weight.shape[0] % 2:
        raise ValueError(
            f"skinny_gated_linear: gate_up_weight must stack gate [I, H] and up [I, H]; it has an odd "
            f"{gate_up_weight.shape[0]} rows."
        )
    (num_rows, in_features), inner = rows.shape, gate_up_weight.shape[0] // 2
    config = config or skinny_gated_config(
        num_rows, inner, in_features, num_sms(x.device), tma=hopper_or_later(x.device)
    )
    if num_rows < 2 or inner == 0 or in_features == 0 or not config.tma or not tma_aligned(rows, gate_up_weight):
        gate_up = skinny_linear(x, gate_up_weight, None)
        gate, up = gate_up[..., :inner], gate_up[..., inner:]
        return gated_activation(gate, up, activation, out=gate)
    if config.split_k != 1:
        raise ValueError(f"skinny_gated_linear: the activation needs whole sums, so split_k must be 1; got {config}.")
    out = torch.empty((num_rows, inner), dtype=x.dtype, device=x.device)
    k_steps = triton.cdiv(in_features, config.block_k) * config.block_k
    _launch_tma_kernel(rows, gate_up_weight, None, out, inner, config, k_steps, 1, activation)
    return out.view(*x.shape[:-1], inner)


def fused_gated_mlp_skinny(
    x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``gated_activation.fused_gated_mlp_triton`` with both GEMMs in the few-row kernels (float16 or bfloat16,
    a decode step's rows) instead of cuBLAS: :func:`skinny_gated_linear` for gate/up and the activation (one
    kernel on Hopper), :func:`skinny_linear` for down."""
    fused_gated_mlp_inner_size("fused_gated_mlp_skinny", x, gate_up_weight, down_weight)
    check_gemm_weights("fused_gated_mlp_skinny", x, gate_up=gate_up_weight, down=down_weight)
    return skinny_linear(skinny_gated_linear(x, gate_up_weight, activation), down_weight, None)


def _input_rows(name: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x[..., K]`` as ``[rows, K]`` with contiguous rows (a view where its layout allows, else a copy), once
    ``x``, ``weight[N, K]`` and ``bias[N]`` are checked to be tensors the kernels take."""
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"{name}: tensors are on {x.device}; the Triton kernel needs CUDA tensors, "
            f"or TRITON_INTERPRET=1 set before this module is imported to run on the CPU."
        )
    out_features, in_features = weight.shape
    if (
        x.dtype not in DTYPES
        or weight.dtype != x.dtype
        or (bias is not None and (bias.dtype != x.dtype or bias.shape != (out_features,)))
        or x.shape[-1] != in_features
        or weight.stride(1) != 1
    ):
        raise ValueError(
            f"{name}: needs x[..., K] and weight[N, K] (contiguous rows) and bias[N] in one dtype of "
            f"{DTYPES}; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} strides "
            f"{weight.stride()}, bias {None if bias is None else (tuple(bias.shape), bias.dtype)}."
        )
    rows = x.reshape(x.numel() // in_features if in_features else x.shape[:-1].numel(), in_features)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch_tma_kernel(
    rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor, out_features: int,
    config: SkinnyConfig, k_per_split: int, split: int, activation: Optional[str] = None, out: Optional[torch.Tensor] = None,
) -> None:
    """:func:`_skinny_tma_kernel` over 16-byte aligned ``rows[M, K]`` and ``weight``, into ``target`` (``out``,
    or the float32 partial sums of ``split`` splits, which the kernel then adds into ``out``); gated by
    ``activation`` when given."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (num_rows, in_features), block_k = rows.shape, config.block_k
    grid = (triton.cdiv(out_features, config.block_n), triton.cdiv(num_rows, config.block_m), split)
    _skinny_tma_kernel[grid](
        TensorDescriptor(rows, [num_rows, in_features], [rows.stride(0), 1], [config.block_m, block_k]),
        TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [config.block_n, block_k]),
        bias if bias is not None else target, target, out if split > 1 else target,
        arrival_counters(grid[0] * grid[1], rows.device) if split > 1 else target,
        num_rows, out_features, K_PER_SPLIT=k_per_split, SPLIT_K=split,
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        NUM_STAGES=config.num_stages, ACTIVATION=activation, num_warps=config.num_warps,
        **dependent_launch(rows.device),
    )
