"""Triton backend of ``gated_mlp``: cuBLAS for the three GEMMs, one Triton kernel for ``act(gate) * up``.

``down(act(gate(x)) * up(x))`` is three matrix products and an element-wise step between them. The
products are left to ``F.linear`` in the input dtype (cuBLAS is hard to beat there); in eager PyTorch
the step in between is two kernels, ``act(gate)`` then ``* up``, with a round trip of the
``[tokens, I]`` intermediate through memory. :func:`gated_activation` fuses them: it reads ``gate``
and ``up`` once and writes the product once, in float32 registers between, over the flattened
tensors in ``block_size`` chunks. ``gated_mlp_triton`` writes that product over ``up``, which it
owns, so the block holds two ``[tokens, I]`` buffers at its peak instead of three.

Activations (those of ``custom_ops/activations.py``), in float32:

- ``silu``: ``g · σ(g)``;
- ``gelu_tanh``: ``½g(1 + tanh(u)) = g · σ(2u)``, ``u = √(2/π)(g + 0.044715 g³)`` (no tanh needed);
- ``gelu``: ``½g(1 + erf(g/√2))``, exact;
- ``relu``: ``max(g, 0)``.

Measured on an H200, bfloat16 ``[8192, 14336]``: the fused step 167 µs (4.2 TB/s) against eager's
286 µs, the whole 4096→14336→4096 block 4.19 ms against 4.48 ms for three GEMMs and eager element-wise
ops. At 16 tokens the step is launch-bound (14 µs against eager's 8 µs; the block 110 against 113 µs).

Numerics: the reference runs the GEMMs in float32; here they run in the input dtype, so half-precision
results differ by the GEMMs' own rounding (well inside the 1e-2 relative contract); float32 agrees
to rounding.

Example (on a CPU with ``TRITON_INTERPRET=1`` set before the import, as the tests do)::

    import torch
    from autodeploy.custom_ops.triton.gated_activation import gated_activation, gated_mlp_triton

    cuda = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 512, **cuda)
    gate_w, up_w = torch.randn(1376, 512, **cuda), torch.randn(1376, 512, **cuda)
    down_w = torch.randn(512, 1376, **cuda)
    y = gated_mlp_triton(x, gate_w, up_w, down_w, "silu")                    # SwiGLU: [4, 512]
    h = gated_activation(x @ gate_w.T, x @ up_w.T, "gelu_tanh")             # GeGLU's middle step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import INTERPRETED, SUPPORTED_DTYPES

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu")


_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_SQRT_HALF = tl.constexpr(0.7071067811865476)


@dataclass(frozen=True)
class ActivationConfig:
    """How the gated-activation kernel is launched: elements per program, and warps per program."""

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


def activation_config(num_elements: int) -> ActivationConfig:
    """The default launch: 8 elements a thread (16-byte accesses in half precision); small blocks for a
    small tensor (a decode step), so it still spreads over many programs."""
    if num_elements >= 1 << 22:
        return ActivationConfig(2048, 8)
    if num_elements >= 1 << 18:
        return ActivationConfig(1024, 4)
    return ActivationConfig(256, 1)


@triton.jit
def _gated_activation_kernel(gate_ptr, up_ptr, out_ptr, num_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    # int64 offsets: a long prefill's [tokens, I] passes 2**31 elements (128k tokens × 28672).
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        activated = gate * tl.sigmoid(gate)
    elif ACTIVATION == "gelu_tanh":
        activated = gate * tl.sigmoid(2.0 * _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate))
    elif ACTIVATION == "gelu":
        activated = 0.5 * gate * (1.0 + tl.math.erf(gate * _SQRT_HALF))
    else:  # relu
        activated = tl.maximum(gate, 0.0)
    tl.store(out_ptr + offsets, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated_activation(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    out: Optional[torch.Tensor] = None,
    config: Optional[ActivationConfig] = None,
) -> torch.Tensor:
    """``act(gate) * up`` element-wise, computed in float32 and returned in ``gate``'s dtype and shape.

    ``out`` (contiguous, ``gate``'s shape and dtype; may be ``up`` or ``gate`` itself) receives the
    result instead of a new tensor. ``config`` overrides :func:`activation_config`'s launch. Raises
    ``ValueError`` for an unknown activation or inputs the kernel does not take.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_activation: unknown activation {activation!r}; allowed: {', '.join(ACTIVATIONS)}.")
    if gate.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"gated_activation: tensors are on {gate.device}; the Triton kernel needs CUDA tensors, "
            f"or TRITON_INTERPRET=1 set before this module is imported to run on the CPU."
        )
    if gate.dtype not in SUPPORTED_DTYPES or up.dtype != gate.dtype or gate.shape != up.shape:
        raise ValueError(
            f"gated_activation: gate and up must share one shape and one dtype of {SUPPORTED_DTYPES}; "
            f"got gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}."
        )
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.dtype != gate.dtype or not out.is_contiguous():
        raise ValueError(
            f"gated_activation: out must be contiguous, {tuple(gate.shape)} {gate.dtype}; "
            f"got {tuple(out.shape)} {out.dtype}."
        )
    num_elements = gate.numel()
    if num_elements == 0:
        return out
    config = config or activation_config(num_elements)
    _gated_activation_kernel[(triton.cdiv(num_elements, config.block_size),)](
        gate.contiguous(), up.contiguous(), out, num_elements,
        ACTIVATION=activation, BLOCK=config.block_size, num_warps=config.num_warps,
    )
    return out


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
    if x.dtype not in SUPPORTED_DTYPES or not x.dtype == gate_weight.dtype == up_weight.dtype == down_weight.dtype:
        raise ValueError(
            f"gated_mlp_triton: x must be one of {SUPPORTED_DTYPES} and the weights in its dtype (the GEMMs run "
            f"in it); got x {x.dtype}, gate {gate_weight.dtype}, up {up_weight.dtype}, down {down_weight.dtype}."
        )
    up = F.linear(x, up_weight)
    # up is this function's own buffer: the activation's product overwrites it in place.
    hidden_states = gated_activation(F.linear(x, gate_weight), up, activation, out=up)
    return F.linear(hidden_states, down_weight)
