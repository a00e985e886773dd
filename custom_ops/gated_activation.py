"""``torch.ops.autodeploy.gated_activation``: ``act(gate) * up``, the step between a gated MLP's projections.

``gated_mlp`` and ``fused_gated_mlp`` hold it inside; ``quantize_linear`` splits a gated MLP whose
projections it quantizes into three quantized linears and this op, so the step keeps a fused kernel
(one read of ``gate`` and ``up``, one write) instead of eager PyTorch's activation and multiply, two
kernels and a round trip of the ``[tokens, I]`` intermediate through memory. ``gate`` and ``up`` may be
the two halves of one ``[tokens, 2I]`` output (``fuse_gemms`` concatenates the gate and up projections).
"""

import torch

from .activations import activation_fn
from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def gated_activation_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation(gate) * up`` element-wise, in float32 (float64 for float64 inputs), rounded once to
    ``gate``'s dtype; contiguous, ``gate``'s shape. ``activation`` is one of "silu", "gelu_tanh", "gelu"
    (erf), "relu". ``gate`` and ``up`` must share one shape and dtype.

    Example::

        gate, up = torch.randn(2, 8), torch.randn(2, 8)
        out = torch.ops.autodeploy.gated_activation(gate, up, "silu")
        assert torch.allclose(out, torch.nn.functional.silu(gate) * up)
    """
    act = activation_fn(activation)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gated_activation: gate and up must share one shape and dtype; got gate {tuple(gate.shape)} "
            f"{gate.dtype}, up {tuple(up.shape)} {up.dtype}."
        )
    dtype = compute_dtype(gate.dtype)
    return (act(gate.to(dtype)) * up.to(dtype)).to(gate.dtype).contiguous()


def gated_activation_fake(gate, up, activation):
    return gate.new_empty(gate.shape)


gated_activation = register_op(
    "gated_activation",
    gated_activation_reference,
    gated_activation_fake,
    example_inputs=(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16), "silu"),
)


def gated_activation_torch(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """Eager PyTorch in the inputs' dtype (two kernels, each rounding): what the graph ran before this op."""
    return activation_fn(activation)(gate) * up


register_backend("gated_activation", "torch", gated_activation_torch)
