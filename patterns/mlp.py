"""MLP family: feed-forward blocks → ``autodeploy.gated_mlp`` / ``autodeploy.mlp``.

What Hugging Face (5.17) MLPs export to (``act`` is ``silu``, ``gelu``, ``gelu(approximate="tanh")``
or ``relu``; each activation is its own pattern because each is a different aten op or argument)::

    gated, Llama/Mistral/Qwen/Gemma:  linear(act(linear(x, gate)) * linear(x, up), down)
    gated, T5 v1.1 (gelu_new):        the same, act spelled out: 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))
    gated, Phi-3 (fused gate_up):     g, u = chunk(linear(x, gate_up), 2, -1);  linear(u * act(g), down)
    plain, GPT-NeoX (biases):         linear(act(linear(x, up, up_bias)), down, down_bias)
    plain, no biases:                 linear(act(linear(x, up)), down)

``gelu_new`` is ``gelu(approximate="tanh")``'s formula written in aten ops; its gated form becomes the canonical
``gelu_tanh`` (equal to rounding). Plain ``gelu_new`` MLPs (GPT-2, GPT-J, CodeGen) stay as exported, as the coverage
sweep measured them.

The fused Phi-3 weight is split in the graph (``chunk`` of the ``gate_up`` parameter along dim 0, a
view), so the checkpoint still loads into the one parameter it names.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match
from torch.fx.experimental.symbolic_shapes import statically_known_true

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.*)
from autodeploy.custom_ops.activations import ACTIVATIONS
from autodeploy.patterns.registry import register_pattern



def _returns_x_shape(match: Match) -> bool:
    """The down projection maps back to x's width, as the ops' ``-> like x`` contract requires."""
    x, down = match.kwargs["x"].meta["val"], match.kwargs["down_weight"].meta["val"]
    return down.dim() == 2 and statically_known_true(down.shape[0] == x.shape[-1])


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation`` (``gelu_new``), as it is written there."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _register_gated(activation: str, act: Callable[[torch.Tensor], torch.Tensor], spelled: str | None = None) -> None:
    """Register the gated MLP patterns of ``act`` as ``activation``; ``spelled`` names a second spelling of it."""
    def gated_mlp(x, gate_weight, up_weight, down_weight):
        return F.linear(act(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)

    def gated_mlp_replacement(x, gate_weight, up_weight, down_weight):
        return torch.ops.autodeploy.gated_mlp(x, gate_weight, up_weight, down_weight, activation)

    def fused_gated_mlp(x, gate_up_weight, down_weight):
        gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
        return F.linear(up * act(gate), down_weight)

    def fused_gated_mlp_replacement(x, gate_up_weight, down_weight):
        gate_weight, up_weight = gate_up_weight.chunk(2, dim=0)
        return torch.ops.autodeploy.gated_mlp(x, gate_weight, up_weight, down_weight, activation)

    x, up, down = torch.empty(2, 3, 8), torch.empty(12, 8), torch.empty(8, 12)
    name = spelled or activation
    register_pattern(f"gated_mlp_{name}", gated_mlp, gated_mlp_replacement, [x, up, up, down],
                     family="mlp", extra_check=_returns_x_shape)
    register_pattern(f"fused_gated_mlp_{name}", fused_gated_mlp, fused_gated_mlp_replacement,
                     [x, torch.empty(24, 8), down], family="mlp", extra_check=_returns_x_shape)


def _register_plain(activation: str, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    def mlp_with_bias(x, up_weight, up_bias, down_weight, down_bias):
        return F.linear(act(F.linear(x, up_weight, up_bias)), down_weight, down_bias)

    def mlp_with_bias_replacement(x, up_weight, up_bias, down_weight, down_bias):
        return torch.ops.autodeploy.mlp(x, up_weight, up_bias, down_weight, down_bias, activation)

    def mlp(x, up_weight, down_weight):
        return F.linear(act(F.linear(x, up_weight)), down_weight)

    def mlp_replacement(x, up_weight, down_weight):
        return torch.ops.autodeploy.mlp(x, up_weight, None, down_weight, None, activation)

    x, up, down = torch.empty(2, 3, 8), torch.empty(12, 8), torch.empty(8, 12)
    register_pattern(f"mlp_{activation}_bias", mlp_with_bias, mlp_with_bias_replacement,
                     [x, up, torch.empty(12), down, torch.empty(8)], family="mlp", extra_check=_returns_x_shape)
    register_pattern(f"mlp_{activation}", mlp, mlp_replacement, [x, up, down], family="mlp",
                     extra_check=_returns_x_shape)


for _activation, _act in ACTIVATIONS.items():
    _register_gated(_activation, _act)
    _register_plain(_activation, _act)
_register_gated("gelu_tanh", _gelu_new, spelled="gelu_new")
