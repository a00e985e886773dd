"""The dtype references compute in: float32, or the input's own when it is wider."""

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision and float32 inputs, float64 for float64 inputs (never below float32)."""
    return torch.promote_types(dtype, torch.float32)
