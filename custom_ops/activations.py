"""The activation functions canonical MLP and MoE ops accept, by name."""

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,  # the exact, erf-based GELU
    "relu": F.relu,
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function for ``name``; an unknown name is a ``ValueError`` listing the allowed ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(repr(n) for n in ACTIVATIONS)}.")
    return ACTIVATIONS[name]

