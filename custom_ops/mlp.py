"""``torch.ops.autodeploy.mlp``: the plain two-layer feed-forward block, with optional biases."""

from typing import Optional

import torch
import torch.nn.functional as F

from .activations import activation_fn
from .compute_dtype import compute_dtype
from .registry import register_backend, register_op


def mlp_reference(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    down_bias: Optional[torch.Tensor],
    activation: str,
) -> torch.Tensor:
    """``down(act(up(x)))`` for ``x[..., H]``, i.e. ``F.linear(act(F.linear(x, up_w, up_b)), down_w, down_b)``.

    Weights in ``nn.Linear`` layout: ``up_weight[I, H]``, ``up_bias[I]`` or None, ``down_weight[H, I]``,
    ``down_bias[H]`` or None; ``activation`` is one of "silu", "gelu_tanh", "gelu" (erf), "relu".
    Computed in float32 (float64 for float64 inputs); returns ``x``'s shape and dtype.
    """
    act = activation_fn(activation)
    hidden, inner = x.shape[-1], up_weight.shape[0]
    if (
        up_weight.shape != (inner, hidden)
        or down_weight.shape != (hidden, inner)
        or (up_bias is not None and up_bias.shape != (inner,))
        or (down_bias is not None and down_bias.shape != (hidden,))
    ):
        weights = {"up_weight": up_weight, "up_bias": up_bias, "down_weight": down_weight, "down_bias": down_bias}
        got = ", ".join(f"{name} {None if t is None else tuple(t.shape)}" for name, t in weights.items())
        raise ValueError(
            f"mlp: expected up_weight [I, H={hidden}], up_bias [I], down_weight [H, I], down_bias [H]; got {got}."
        )
    dtype = compute_dtype(x.dtype)

    def upcast(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(dtype)

    hidden_states = act(F.linear(x.to(dtype), upcast(up_weight), upcast(up_bias)))
    return F.linear(hidden_states, upcast(down_weight), upcast(down_bias)).to(x.dtype)


def mlp_fake(x, up_weight, up_bias, down_weight, down_bias, activation):
    return x.new_empty(x.shape)


mlp = register_op(
    "mlp",
    mlp_reference,
    mlp_fake,
    example_inputs=(
        torch.ones(2, 4, dtype=torch.bfloat16),
        torch.ones(6, 4),
        torch.zeros(6),
        torch.ones(4, 6),
        None,
        "gelu_tanh",
    ),
)


def mlp_torch(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    down_bias: Optional[torch.Tensor],
    activation: str,
) -> torch.Tensor:
    """``mlp`` in the inputs' own dtype (cuBLAS on GPUs); same arguments and result as the reference."""
    act = activation_fn(activation)
    return F.linear(act(F.linear(x, up_weight, up_bias)), down_weight, down_bias)


def _mlp_torch_supports(x, up_weight, up_bias, down_weight, down_bias, activation, *, device):
    if any(t is not None and t.dtype != x.dtype for t in (up_weight, up_bias, down_weight, down_bias)):
        return f"a weight or bias dtype differs from x's {x.dtype} (computes in one native dtype)"
    return True


register_backend("mlp", "torch", mlp_torch, supports=_mlp_torch_supports)
