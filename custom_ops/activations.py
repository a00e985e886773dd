"""The activation functions canonical MLP and MoE ops accept, by name: the one table that ops, kernels, patterns
and passes read."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,  # the exact, erf-based GELU
    "relu": F.relu,
}

# The aten op (and keyword arguments) each activation is in an exported graph: what the MoE pattern reads back
# to a name, and what the quantize stage writes when it splits an MLP into its projections.
ATEN_ACTIVATIONS: dict[str, tuple[torch._ops.OpOverload, dict]] = {
    "silu": (torch.ops.aten.silu.default, {}),
    "gelu_tanh": (torch.ops.aten.gelu.default, {"approximate": "tanh"}),
    "gelu": (torch.ops.aten.gelu.default, {}),
    "relu": (torch.ops.aten.relu.default, {}),
}


def unsupported_activation(name: str) -> str | None:
    """Why a kernel taking the ``ACTIVATIONS`` by name cannot take ``name`` (a backend's ``supports`` answer), or
    None."""
    return None if name in ACTIVATIONS else f"activations {', '.join(ACTIVATIONS)} only (got {name!r})"


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function for ``name``; an unknown name is a ``ValueError`` listing the allowed ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(repr(n) for n in ACTIVATIONS)}.")
    return ACTIVATIONS[name]

