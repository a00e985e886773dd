"""Triton backends of ``gated_mlp`` and ``fused_gated_mlp``: cuBLAS GEMMs, one Triton kernel for ``act(gate) * up``.

``down(act(gate(x)) * up(x))`` is matrix products and an element-wise step between them. The products
are left to ``F.linear`` in the input dtype (cuBLAS is hard to beat there); in eager PyTorch the step in
between is two kernels, ``act(gate)`` then ``* up``, with a round trip of the ``[tokens, I]``
intermediate through memory. :func:`gated_activation` fuses them: it reads ``gate`` and ``up`` once and
writes the product once, in float32 registers between. It reads rows through their strides, so
``gate`` and ``up`` may be the two halves of one ``[tokens, 2I]`` GEMM output (views, no copy):

- ``gated_mlp_triton`` (separate weights) runs two GEMMs and writes the product over ``up``, which it owns;
- ``fused_gated_mlp_triton`` (one ``gate_up_weight[2I, H]``) runs one GEMM, writes the product over that
  output's gate half and hands the down GEMM that half as a strided view; either way the block holds
  two ``[tokens, I]`` buffers' worth at its peak instead of three;
- ``skinny_gemm.fused_gated_mlp_skinny`` (a decode step's few rows) runs both GEMMs in that module's few-row
  kernels; with several rows on Hopper its gate/up GEMM computes the activation in its epilogue
  (``skinny_gemm.skinny_gated_linear``), so :func:`gated_activation` runs only in its fall-back.

Activations (those of ``custom_ops/activations.py``), in float32, written once in :func:`activate`
(this kernel's and the gated GEMM's):

- ``silu``: ``g · σ(g)``;
- ``gelu_tanh``: ``½g(1 + tanh(u)) = g · σ(2u)``, ``u = √(2/π)(g + 0.044715 g³)`` (no tanh needed);
- ``gelu``: ``½g(1 + erf(g/√2))``, exact;
- ``relu``: ``max(g, 0)``.

Measured on an H200, bfloat16 ``[8192, 14336]``, with the kernel's earlier launch over two contiguous
tensors: the fused step 167 µs (4.2 TB/s) against eager's 286 µs, the whole 4096→14336→4096 block
4.19 ms against 4.48 ms for three GEMMs and eager element-wise ops. At 16 tokens the step is
launch-bound (14 µs against eager's 8 µs; the block 110 against 113 µs). The strided launch (one
program per row and column block, the same element count per program) and the one-GEMM
``fused_gated_mlp_triton`` have not been timed on a GPU yet.

Numerics: the reference runs the GEMMs in float32; here they run in the input dtype, so half-precision
results differ by the GEMMs' own rounding (well inside the 1e-2 relative contract); float32 agrees
to rounding.

Example (on a CPU with ``TRITON_INTERPRET=1`` set before the import, as the tests do)::

    import torch
    from autodeploy.custom_ops.triton.gated_activation import (
        fused_gated_mlp_triton, gated_activation, gated_mlp_triton)

    cuda = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 512, **cuda)
    gate_w, up_w = torch.randn(1376, 512, **cuda), torch.randn(1376, 512, **cuda)
    down_w = torch.randn(512, 1376, **cuda)
    y = gated_mlp_triton(x, gate_w, up_w, down_w, "silu")                    # SwiGLU: [4, 512]
    y = fused_gated_mlp_triton(x, torch.cat([gate_w, up_w]), down_w, "silu")  # the same, one gate/up GEMM
    gate_up = x @ torch.cat([gate_w, up_w]).T                                # [4, 2752]
    h = gated_activation(gate_up[:, :1376], gate_up[:, 1376:], "gelu_tanh")  # GeGLU's middle step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..activations import ACTIVATIONS as ACTIVATION_FUNCTIONS
from ..fused_gated_mlp import fused_gated_mlp_inner_size
from . import INTERPRETED, SUPPORTED_DTYPES
from .fp8 import fp8_row_scale, to_e4m3
from .launch import dependent_launch, wait_for_previous_kernel

ACTIVATIONS = tuple(ACTIVATION_FUNCTIONS)  # each written out below as a formula for a float32 block


_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_SQRT_HALF = tl.constexpr(0.7071067811865476)


@dataclass(frozen=True)
class ActivationConfig:
    """How the gated-activation kernel is launched: elements of one row per program, and warps per program."""

    block_size: int
    num_warps: int


# The launch space (the autotuner's): every variant is correct for every size and keeps at most 64
# values of each tensor a thread, past which a thread spills registers.
CONFIGS = tuple(
    ActivationConfig(block, warps)
    for block in (256, 512, 1024, 2048, 4096)
    for warps in (1, 2, 4, 8)
    if block <= 64 * 32 * warps
)


def activation_config(num_rows: int, inner: int) -> ActivationConfig:
    """The default launch for ``[num_rows, inner]``: 8 elements a thread (16-byte accesses in half
    precision); small blocks for a small tensor (a decode step), so it still spreads over many programs,
    and no block much wider than a row, whose lanes past the row's end would idle."""
    num_elements = num_rows * inner
    if num_elements >= 1 << 22:
        block = 2048
    elif num_elements >= 1 << 18:
        block = 1024
    else:
        block = 256
    block = max(256, min(block, triton.next_power_of_2(inner)))
    return ActivationConfig(block, block // 256)


@triton.jit
def activate(gate, ACTIVATION: tl.constexpr):
    """``ACTIVATION(gate)`` for a float32 block, one of :data:`ACTIVATIONS` (the formulas above): shared by
    this module's kernel and the few-row GEMM's gated epilogue (``skinny_gemm.skinny_gated_linear``)."""
    if ACTIVATION == "silu":
        activated = gate * tl.sigmoid(gate)
    elif ACTIVATION == "gelu_tanh":
        activated = gate * tl.sigmoid(2.0 * _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate))
    elif ACTIVATION == "gelu":
        activated = 0.5 * gate * (1.0 + tl.math.erf(gate * _SQRT_HALF))
    else:  # relu
        activated = tl.maximum(gate, 0.0)
    return activated


@triton.jit
def _gated_activation_kernel(
    gate_ptr, up_ptr, out_ptr, inner, gate_row_stride, up_row_stride, out_row_stride,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per (row, column block): rows may be strided (the halves of one [T, 2I] GEMM output).
    # int64 row offsets: a long prefill's [tokens, 2I] passes 2**31 elements (128k tokens × 2 × 14336).
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < inner
    gate = tl.load(gate_ptr + row * gate_row_stride + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + columns, mask=mask, other=0.0).to(tl.float32)
    out = (activate(gate, ACTIVATION) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + columns, out, mask=mask)


@triton.jit
def _gated_block(gate_row, up_row, columns, inner, ACTIVATION: tl.constexpr):
    """``act(gate) * up`` at ``columns`` of one row, rounded to the inputs' dtype and back to float32 (zeros
    past ``inner``)."""
    mask = columns < inner
    gate = tl.load(gate_row + columns, mask=mask, other=0.0)
    up = tl.load(up_row + columns, mask=mask, other=0.0).to(tl.float32)
    return (activate(gate.to(tl.float32), ACTIVATION) * up).to(gate.dtype).to(tl.float32)


@triton.jit
def _gated_activation_fp8_kernel(
    gate_ptr, up_ptr, q_ptr, scale_ptr, inner, gate_row_stride, up_row_stride,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per row: the row's max |act(gate)·up| (rounded to the model's dtype, as the unfused op
    # writes it), then each value divided by the row's scale into e4m3. A row of at most BLOCK columns
    # stays in registers between the two; a wider one is computed twice, a block at a time.
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    gate_row, up_row, q_row = gate_ptr + row * gate_row_stride, up_ptr + row * up_row_stride, q_ptr + row * inner
    offsets = tl.arange(0, BLOCK)
    if ONE_BLOCK:  # inner <= BLOCK
        product = _gated_block(gate_row, up_row, offsets, inner, ACTIVATION)
        x_scale = fp8_row_scale(tl.max(tl.abs(product), axis=0))
        tl.store(q_row + offsets, to_e4m3(product, x_scale), mask=offsets < inner)
    else:
        peak = tl.zeros((BLOCK,), dtype=tl.float32)
        for first in range(0, inner, BLOCK):
            peak = tl.maximum(peak, tl.abs(_gated_block(gate_row, up_row, first + offsets, inner, ACTIVATION)))
        x_scale = fp8_row_scale(tl.max(peak, axis=0))
        for first in range(0, inner, BLOCK):
            columns = first + offsets
            product = _gated_block(gate_row, up_row, columns, inner, ACTIVATION)
            tl.store(q_row + columns, to_e4m3(product, x_scale), mask=columns < inner)
    tl.store(scale_ptr + row, x_scale)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[rows, inner]`` with contiguous rows: a view where its layout allows, else a copy."""
    rows = tensor.reshape(-1, tensor.shape[-1] if tensor.dim() else 1)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _writable_rows(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor`` as a ``[rows, inner]`` view with contiguous rows, or ``None`` when no such view exists."""
    try:
        rows = tensor.view(-1, tensor.shape[-1] if tensor.dim() else 1)
    except RuntimeError:  # leading dims that no single row stride spans
        return None
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else None


def _check_inputs(name: str, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """``ValueError`` for an unknown activation or inputs the kernels do not take."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: unknown activation {activation!r}; allowed: {', '.join(ACTIVATIONS)}.")
    if gate.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"{name}: tensors are on {gate.device}; the Triton kernel needs CUDA tensors, "
            f"or TRITON_INTERPRET=1 set before this module is imported to run on the CPU."
        )
    if gate.dtype not in SUPPORTED_DTYPES or up.dtype != gate.dtype or gate.shape != up.shape:
        raise ValueError(
            f"{name}: gate and up must share one shape and one dtype of {SUPPORTED_DTYPES}; "
            f"got gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}."
        )


def gated_activation(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    out: Optional[torch.Tensor] = None,
    config: Optional[ActivationConfig] = None,
) -> torch.Tensor:
    """``act(gate) * up`` element-wise, computed in float32 and returned in ``gate``'s dtype and shape.

    ``gate`` and ``up`` are read in place when each row is contiguous, at any row stride (the two
    halves ``t[..., :I]`` and ``t[..., I:]`` of one tensor); other layouts are copied first. ``out``
    (``gate``'s shape and dtype, contiguous rows at any row stride: it may be ``gate`` or ``up`` itself)
    receives the result instead of a new tensor. ``config`` overrides :func:`activation_config`'s launch.
    Raises ``ValueError`` for an unknown activation or inputs the kernel does not take.
    """
    _check_inputs("gated_activation", gate, up, activation)
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.dtype != gate.dtype:
        raise ValueError(
            f"gated_activation: out must be {tuple(gate.shape)} {gate.dtype}; got {tuple(out.shape)} {out.dtype}."
        )
    if gate.numel() == 0:
        return out
    out_rows = _writable_rows(out)
    if out_rows is None:
        raise ValueError(
            f"gated_activation: out must have contiguous rows to be written in place; its strides are {out.stride()}."
        )
    gate_rows, up_rows = _rows(gate), _rows(up)
    num_rows, inner = gate_rows.shape
    config = config or activation_config(num_rows, inner)
    _gated_activation_kernel[(num_rows, triton.cdiv(inner, config.block_size))](
        gate_rows, up_rows, out_rows, inner, gate_rows.stride(0), up_rows.stride(0), out_rows.stride(0),
        ACTIVATION=activation, BLOCK=config.block_size, num_warps=config.num_warps, **dependent_launch(out.device),
    )
    return out


def gated_activation_fp8(gate: torch.Tensor, up: torch.Tensor, activation: str, *, block: int = 16384,
                         num_warps: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_activation_fp8``: ``act(gate) * up`` rounded to ``gate``'s dtype, then each row to e4m3 with
    its float32 scale, ``(x_q, x_scale [..., 1])``, in one kernel (one program a row, ``block`` columns a
    step: Llama-3-8B's 14,336 in one, 28 values of each input a thread); same result as
    ``gated_activation_fp8_reference``. Inputs as :func:`gated_activation`'s.

    On an H200 the first version, 2,048 columns a step in two passes, took 16.7 µs at 256 rows of 14,336
    (one row: 20 µs with the wait on the GEMM before it) where gated_activation takes 6."""
    _check_inputs("gated_activation_fp8", gate, up, activation)
    x_q = torch.empty(gate.shape, dtype=torch.float8_e4m3fn, device=gate.device)
    x_scale = torch.empty((*gate.shape[:-1], 1), dtype=torch.float32, device=gate.device)
    if gate.numel():
        gate_rows, up_rows = _rows(gate), _rows(up)
        num_rows, inner = gate_rows.shape
        _gated_activation_fp8_kernel[(num_rows,)](
            gate_rows, up_rows, x_q, x_scale, inner, gate_rows.stride(0), up_rows.stride(0), ACTIVATION=activation,
            BLOCK=min(block, max(16, triton.next_power_of_2(inner))), ONE_BLOCK=inner <= block, num_warps=num_warps,
            **dependent_launch(gate.device),
        )
    return x_q, x_scale


def check_gemm_weights(name: str, x: torch.Tensor, **weights: torch.Tensor) -> None:
    """The GEMMs run in ``x``'s dtype: it must be one the kernel takes, and every weight in it."""
    if x.dtype not in SUPPORTED_DTYPES or any(w.dtype != x.dtype for w in weights.values()):
        got = ", ".join(f"{key} {w.dtype}" for key, w in weights.items())
        raise ValueError(
            f"{name}: x must be one of {SUPPORTED_DTYPES} and the weights in its dtype (the GEMMs run "
            f"in it); got x {x.dtype}, {got}."
        )


def gated_mlp_triton(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``gated_mlp``: ``down(act(gate(x)) * up(x))`` with cuBLAS GEMMs in ``x``'s dtype and the fused
    :func:`gated_activation` between them. Same arguments and result contract as ``gated_mlp_reference``.

    Raises ``ValueError`` for weights whose dtype or shapes disagree with ``x`` or an unknown activation.
    """
    hidden, inner = x.shape[-1], gate_weight.shape[0]
    if not gate_weight.shape == up_weight.shape == (inner, hidden) or down_weight.shape != (hidden, inner):
        raise ValueError(
            f"gated_mlp_triton: expected gate/up [I, H={hidden}] and down [H, I]; got gate {tuple(gate_weight.shape)}, "
            f"up {tuple(up_weight.shape)}, down {tuple(down_weight.shape)}."
        )
    check_gemm_weights("gated_mlp_triton", x, gate=gate_weight, up=up_weight, down=down_weight)
    up = F.linear(x, up_weight)
    # up is this function's own buffer: the activation's product overwrites it in place.
    hidden_states = gated_activation(F.linear(x, gate_weight), up, activation, out=up)
    return F.linear(hidden_states, down_weight)


def fused_gated_mlp_triton(
    x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``fused_gated_mlp``: one cuBLAS GEMM for gate and up (``gate_up_weight[2I, H]``, gate rows first),
    :func:`gated_activation` over the two halves of its output, the down GEMM; all in ``x``'s dtype. Same
    arguments and result contract as ``fused_gated_mlp_reference``.

    Raises ``ValueError`` for weights whose dtype or shapes disagree with ``x`` or an unknown activation.
    """
    inner = fused_gated_mlp_inner_size("fused_gated_mlp_triton", x, gate_up_weight, down_weight)
    check_gemm_weights("fused_gated_mlp_triton", x, gate_up=gate_up_weight, down=down_weight)
    gate_up = F.linear(x, gate_up_weight)
    gate, up = gate_up[..., :inner], gate_up[..., inner:]
    # The product overwrites the gate half in place; the down GEMM reads that half through its row
    # stride (cuBLAS takes a leading dimension of 2I), so nothing is copied.
    return F.linear(gated_activation(gate, up, activation, out=gate), down_weight)
