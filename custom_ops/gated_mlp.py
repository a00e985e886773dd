"""``torch.ops.autodeploy.gated_mlp``: the gated feed-forward block (SwiGLU, GeGLU, …) without biases."""

import torch
import torch.nn.functional as F

from .activations import activation_fn
from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def gated_mlp_reference(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` for ``x[..., H]``.

    Weights in ``nn.Linear`` layout: ``gate_weight[I, H]``, ``up_weight[I, H]``, ``down_weight[H, I]``;
    ``activation`` is one of "silu", "gelu_tanh", "gelu" (erf), "relu". Computed in float32 (float64 for
    float64 inputs); returns ``x``'s shape and dtype.
    """
    act = activation_fn(activation)
    hidden, inner = x.shape[-1], gate_weight.shape[0]
    if not gate_weight.shape == up_weight.shape == (inner, hidden) or down_weight.shape != (hidden, inner):
        raise ValueError(
            f"gated_mlp: expected gate/up [I, H={hidden}] and down [H, I]; got gate {tuple(gate_weight.shape)}, "
            f"up {tuple(up_weight.shape)}, down {tuple(down_weight.shape)}."
        )
    dtype = compute_dtype(x.dtype)
    x_up = x.to(dtype)
    hidden_states = act(F.linear(x_up, gate_weight.to(dtype))) * F.linear(x_up, up_weight.to(dtype))
    return F.linear(hidden_states, down_weight.to(dtype)).to(x.dtype)


def gated_mlp_fake(x, gate_weight, up_weight, down_weight, activation):
    return x.new_empty(x.shape)


gated_mlp = register_op(
    "gated_mlp",
    gated_mlp_reference,
    gated_mlp_fake,
    example_inputs=(
        torch.ones(2, 4, dtype=torch.bfloat16),
        torch.ones(6, 4),
        torch.ones(6, 4),
        torch.ones(4, 6),
        "silu",
    ),
)


def gated_mlp_torch(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor, activation: str
) -> torch.Tensor:
    """``gated_mlp`` in the inputs' own dtype (cuBLAS on GPUs); same arguments and result as the reference."""
    act = activation_fn(activation)
    return F.linear(act(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


def _gated_mlp_torch_supports(x, gate_weight, up_weight, down_weight, activation, *, device):
    if not x.dtype == gate_weight.dtype == up_weight.dtype == down_weight.dtype:
        return f"a weight dtype differs from x's {x.dtype} (computes in one native dtype)"
    return True


register_backend("gated_mlp", "torch", gated_mlp_torch, supports=_gated_mlp_torch_supports)
