"""Activations written out from their definitions, as oracles independent of torch.nn.functional."""

import math

import torch

ACTIVATION_FORMULAS = {
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
}
