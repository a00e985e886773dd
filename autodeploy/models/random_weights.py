"""Random weights for benchmarking without a checkpoint (``weights=random``): one value per parameter name, so
the deployed graph (``transforms/load_weights.py``) and the Hugging Face baselines (``bench/hf_baselines.py``)
are filled alike."""

from __future__ import annotations

import torch


def random_parameter(name: str, shape: torch.Size, std: float, device: torch.device, generator=None) -> torch.Tensor:
    """The benchmarking value of one parameter (float32): N(0, std) matrices, unit norm scales
    (a 1-D tensor with "norm" in its qualified name), zero biases."""
    if len(shape) == 1:
        return torch.ones(shape, device=device) if "norm" in name else torch.zeros(shape, device=device)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).mul_(std)
