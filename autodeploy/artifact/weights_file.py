"""The deployment's tensors in one safetensors file: read without pickle, each onto the device it served on.

Loaded tensors are bit-identical to the saved ones and aligned as torch aligns its own, so the reloaded graph
computes bit-identical logits. A tensor that several graph inputs share (tied embeddings) is stored once, under one key; a tensor that
only overlaps another's memory (a view into it) is stored as a copy of its own, since safetensors holds
no views.

    keys = save_tensors({"lm_head_weight": w, "embed_weight": w}, path)   # both → "lm_head_weight"
    tensors = load_tensors(path, {"lm_head_weight": "cpu"})
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from autodeploy.errors import CheckpointError

_ALIGNMENT = 64  # bytes: torch's CPU allocator's alignment


def _identity(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype, tensor.device)


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, str]:
    """Write ``tensors`` to ``path``; returns each name's key in the file (shared tensors share a key)."""
    keys: dict[str, str] = {}
    stored: dict[str, torch.Tensor] = {}
    key_of: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        identity = _identity(tensor)
        if identity in key_of:
            keys[name] = key_of[identity]
            continue
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()  # a view into another stored tensor: safetensors stores no views
        storages.add(storage)
        key_of[identity] = keys[name] = name
        stored[name] = tensor
    save_file(stored, str(path))
    return keys


def load_tensors(path: Path, devices: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The tensors under ``devices``' keys, each on its device (safetensors reads no pickle)."""
    by_device: dict[str, list[str]] = {}
    for key, device in devices.items():
        by_device.setdefault(device, []).append(key)
    tensors: dict[str, torch.Tensor] = {}
    try:
        for device, keys in by_device.items():
            with safe_open(str(path), framework="pt", device=device) as file:
                missing = sorted(set(keys) - set(file.keys()))
                if missing:
                    raise CheckpointError(f"{path} lacks tensor(s) {', '.join(missing[:4])}; save the deployment again")
                for key in keys:
                    tensor = file.get_tensor(key)
                    # Memory-mapped tensors can start anywhere; CPU kernels take other code paths (and round
                    # differently) on memory that is not aligned as torch's allocator aligns it.
                    tensors[key] = tensor.clone() if tensor.data_ptr() % _ALIGNMENT else tensor
    except SafetensorError as error:
        raise CheckpointError(f"{path} is not a readable safetensors file ({error}); save the deployment again") from error
    return tensors
