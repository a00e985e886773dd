"""``save_hidden_states(x, out, column)``: a copy of the residual stream at a layer boundary, for a drafter.

EAGLE-3 and MTP heads draft from the model's own hidden states. ``transforms/expose_hidden_states.py`` adds
one of these ops per layer it exposes: the op writes the step's token rows of ``x`` (``[1, T, H]`` or
``[T, H]``) into columns ``column … column + H`` of ``out``, a buffer of the graph (``[rows, width]``, rows ≥
the step's token budget). The buffer keeps one address, so the eager graph, the decode and verification
CUDA graphs and the piecewise prefill graphs all leave a step's hidden states in the same place, and the
drafter reads them there after the step (``runtime/hidden_state_heads.py``). It returns nothing and is
registered as a side effect: dead-code elimination keeps it.

    out = torch.zeros(8, 6)
    torch.ops.autodeploy.save_hidden_states(torch.ones(1, 3, 2), out, 2)  # out[:3, 2:4] is ones
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .registry import register_op


def save_hidden_states_reference(x: torch.Tensor, out: torch.Tensor, column: int) -> None:
    """``out[:T, column:column + H] = x`` over ``x``'s ``T`` token rows of width ``H``."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > out.shape[0] or column + rows.shape[1] > out.shape[1]:
        raise ValueError(f"save_hidden_states: {tuple(rows.shape)} rows at column {column} do not fit the buffer "
                         f"{tuple(out.shape)}")
    out[: rows.shape[0], column : column + rows.shape[1]].copy_(rows)


def save_hidden_states_fake(x: torch.Tensor, out: torch.Tensor, column: int) -> None:
    return None


save_hidden_states = register_op("save_hidden_states", save_hidden_states_reference, save_hidden_states_fake,
                                 example_inputs=(torch.ones(1, 2, 4), torch.zeros(4, 8), 4), mutates_args=("out",))
has_side_effect(torch.ops.autodeploy.save_hidden_states.default)
