"""Triton backends of canonical ops; each kernel module is imported on first use by the backend that
serves it (Triton decides at kernel definition whether to interpret, from ``TRITON_INTERPRET``)."""

import functools
import importlib.util
import os

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what every Triton kernel here takes

# Triton fixes this when a kernel is defined, at import: only then may the kernels run on CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable(device: torch.device) -> str | None:
    """Why Triton kernels cannot serve a deploy on ``device``, or ``None`` when they can.

    Only CUDA deploys select them: the interpreter (``TRITON_INTERPRET=1``) runs them on CPU tensors for
    tests, far too slowly to serve.
    """
    if torch.device(device).type != "cuda":
        return f"Triton kernels need a CUDA device (this deploy runs on {device})"
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    return None


def hopper_or_later(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.0 or later: Hopper's TMA unit, programmatic
    dependent launch and ``bf16x2`` PTX arithmetic, which the kernels here use where it holds."""
    return device.type == "cuda" and _capability(device.index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
