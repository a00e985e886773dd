"""The ``cutlass`` backend of ``linear``: PyTorch's CUTLASS GEMM on Hopper and Blackwell.

PyTorch ships CUTLASS kernels of its own: on sm90/sm100, ``torch._grouped_mm`` in bfloat16 runs a
CUTLASS 3 grouped GEMM (``bf16bf16_grouped_mm``, warp-specialized, TMA loads). One ``linear`` is a
group of one: ``x[T, K] @ weight[N, K]ᵀ`` as ``[1, T, K] @ [1, K, N]``, the weight read in place
through a transposed view (no copy). It competes with cuBLAS (``linear_torch``) in the autotuner; where
it cannot run (a CPU deploy, another GPU, another dtype, misaligned sizes) ``supports`` says why, that
reason is shown in the ``select`` report, and the node keeps another backend. Inductor's CUTLASS
template backend needs ``nvcc`` and the ``nvidia-cutlass`` package at build time and compiles for
minutes per shape, so it is not offered here.

Example (``supports`` reads only shapes and dtypes, so meta tensors will do)::

    import torch
    from autodeploy.custom_ops import candidates

    cutlass = next(b for b in candidates("linear") if b.name == "cutlass")
    meta = dict(dtype=torch.bfloat16, device="meta")
    x, weight = torch.empty(7, 4096, **meta), torch.empty(1024, 4096, **meta)
    assert "GPU" in cutlass.check((x, weight, None), torch.device("cpu"))
"""

from __future__ import annotations

from typing import Optional

import torch

from . import linear  # noqa: F401  (the op must exist before its backend)
from .registry import register_backend

# 16-byte alignment of every operand's leading dimension, in bfloat16 elements.
_ALIGNMENT = 8


def linear_cutlass(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through CUTLASS (``torch._grouped_mm``, one group); the reference's result."""
    out_shape = (*x.shape[:-1], weight.shape[0])
    if x.numel() == 0:
        return x.new_zeros(out_shape)
    rows = x.reshape(1, -1, x.shape[-1])
    out = torch._grouped_mm(rows, weight.t().unsqueeze(0)).view(out_shape)
    return out if bias is None else out.add_(bias)


def grouped_gemm_unavailable(device: torch.device) -> str | None:
    """Why ``torch._grouped_mm`` cannot run its CUTLASS kernel on ``device``, or ``None`` when it can
    (a CPU falls back to a loop of matmuls, other GPUs to a loop of cuBLAS calls with a host sync)."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return f"torch._grouped_mm (PyTorch's CUTLASS grouped GEMM) is missing from torch {torch.__version__}"
    if device.type != "cuda":
        return f"PyTorch's CUTLASS GEMM runs on NVIDIA GPUs only (the deploy runs on {device.type})"
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return "PyTorch's CUTLASS GEMM needs a Hopper or Blackwell GPU (sm90/sm100)"
    return None


def _linear_cutlass_supports(x, weight, bias, *, device):
    reason = grouped_gemm_unavailable(device)
    if reason:
        return reason
    if not x.dtype == weight.dtype == torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        return f"PyTorch's CUTLASS GEMM takes bfloat16 x, weight and bias (x is {x.dtype}, weight {weight.dtype})"
    out_features, in_features = weight.shape
    if in_features % _ALIGNMENT or out_features % _ALIGNMENT:
        return f"needs in and out features that are multiples of {_ALIGNMENT} (weight is {tuple(weight.shape)})"
    if weight.stride(1) != 1 or weight.stride(0) % _ALIGNMENT:
        return "needs a weight with contiguous, 16-byte aligned rows"
    return True


register_backend("linear", "cutlass", linear_cutlass, supports=_linear_cutlass_supports)
