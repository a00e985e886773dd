"""The deployment's tensors in one safetensors file: read without pickle, each onto the device it served on.

Loaded tensors are bit-identical to the saved ones and aligned as torch aligns its own, so the reloaded graph
computes bit-identical logits. A tensor that several graph inputs share (tied embeddings) is stored once, under one key; a tensor that
only overlaps another's memory (a view into it) is stored as a copy of its own, since safetensors holds
no views.

The file is read once, its ``manifest.DIGEST_CHUNK`` chunks shared among threads: each piece read is hashed
for the file's digest (``manifest.file_digest``) and copied from where it was read into the tensors it
holds; for a GPU, that buffer is pinned and the copy runs on the thread's own stream while it reads the next.

    keys = save_tensors({"lm_head_weight": w, "embed_weight": w}, path)   # both → "lm_head_weight"
    tensors, digest = load_tensors(path, {"lm_head_weight": "cpu"})
"""

from __future__ import annotations

import hashlib
import json
import os
import contextlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from autodeploy.errors import CheckpointError

from . import manifest

_READ_THREADS = 16  # at most
_READ_BYTES = 16 << 20  # a thread reads a digest chunk in pieces of this size into two buffers (pinned for a GPU)


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


def load_tensors(path: Path, devices: Mapping[str, str]) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors under ``devices``' keys, each on its device, and the file's digest (:func:`file_digest`'s),
    from one read of the file. safetensors checks the header (offsets inside the file, no overlaps, sizes
    that match dtypes and shapes) and gives each tensor's dtype and shape; nothing is unpickled."""
    chunk_bytes = manifest.DIGEST_CHUNK
    read_bytes = min(_READ_BYTES, chunk_bytes)
    spans = _spans(path, devices)
    tensors = {key: torch.empty(shape, dtype=dtype, device=devices[key]) for key, (dtype, shape, _, _) in spans.items()}
    pieces = {}  # a read's file offset → [(key, offset in the read, offset in the tensor, bytes)]
    for key, (_, _, begin, end) in spans.items():
        for read in range(begin - begin % read_bytes, end, read_bytes):
            first, last = max(begin, read), min(end, read + read_bytes)
            pieces.setdefault(read, []).append((key, first - read, first - begin, last - first))
    size = path.stat().st_size
    chunks = list(range(0, size, chunk_bytes))
    workers = max(1, min(_READ_THREADS, os.cpu_count() or 1, len(chunks)))
    reader = _ShareReader(path, size, chunk_bytes, read_bytes, pieces, tensors, pinned=any(t.is_cuda for t in tensors.values()))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        sha256s = {}
        for share in pool.map(reader, [chunks[worker::workers] for worker in range(workers)]):
            sha256s.update(share)
    return tensors, manifest.digest_of_chunks([sha256s[chunk] for chunk in chunks])


def _spans(path: Path, devices: Mapping[str, str]) -> dict[str, tuple[torch.dtype, torch.Size, int, int]]:
    """Per key: dtype, shape and the byte range it takes in the file."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:  # validates the header; maps, reads nothing
            missing = sorted(set(devices) - set(file.keys()))
            if missing:
                raise CheckpointError(f"{path} lacks tensor(s) {', '.join(missing[:4])}; save the deployment again")
            mapped = {key: file.get_tensor(key) for key in devices}
            kinds = {key: (tensor.dtype, tensor.shape, tensor.numel() * tensor.element_size()) for key, tensor in mapped.items()}
            del mapped
    except SafetensorError as error:
        raise CheckpointError(f"{path} is not a readable safetensors file ({error}); save the deployment again") from error
    with open(path, "rb") as file:  # the layout (https://github.com/huggingface/safetensors#format): u64 n, n bytes of JSON, data
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    spans = {}
    for key, (dtype, shape, nbytes) in kinds.items():
        begin, end = (8 + length + offset for offset in header[key]["data_offsets"])
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {key} takes {end - begin} bytes, not the {nbytes} its dtype and shape need")
        spans[key] = (dtype, shape, begin, end)
    return spans


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class _ShareReader:
    """Reads a thread's share of the digest chunks, each in ``read_bytes`` pieces into the thread's two
    buffers in turn: hashes it for the chunk's sha256 and copies each piece into the tensors it holds. For
    a GPU the copies run on the thread's own stream, and a buffer is refilled once its copies have left
    it. The reads, hashing and copies leave the GIL."""

    def __init__(self, path: Path, size: int, chunk_bytes: int, read_bytes: int, pieces: dict,
                 tensors: dict[str, torch.Tensor], pinned: bool):
        self.path, self.size, self.chunk_bytes, self.read_bytes = path, size, chunk_bytes, read_bytes
        self.pieces, self.tensors, self.pinned = pieces, tensors, pinned

    def __call__(self, chunks: list[int]) -> dict[int, bytes]:
        stream = torch.cuda.Stream() if self.pinned else None
        buffers = [torch.empty(self.read_bytes, dtype=torch.uint8, pin_memory=self.pinned) for _ in range(2)]
        sent: list[torch.cuda.Event | None] = [None, None]
        sha256s, slot = {}, 0
        with open(self.path, "rb") as file:
            for chunk in chunks:
                sha256 = hashlib.sha256()
                for read in range(chunk, min(chunk + self.chunk_bytes, self.size), self.read_bytes):
                    slot = 1 - slot
                    if sent[slot] is not None:
                        sent[slot].synchronize()  # its last copies have left the buffer
                    view = memoryview(buffers[slot].numpy())[: min(self.read_bytes, self.size - read)]
                    filled = 0
                    while filled < len(view):
                        got = os.preadv(file.fileno(), [view[filled:]], read + filled)
                        if got == 0:
                            raise CheckpointError(f"{self.path} ended at byte {read + filled} while it was read; save the deployment again")
                        filled += got
                    sha256.update(view)
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        for key, at, start, length in self.pieces.get(read, ()):
                            _as_bytes(self.tensors[key])[start:start + length].copy_(
                                buffers[slot][at:at + length], non_blocking=stream is not None)
                    if stream is not None:
                        sent[slot] = torch.cuda.Event()
                        sent[slot].record(stream)
                sha256s[chunk] = sha256.digest()
        if stream is not None:
            stream.synchronize()
        return sha256s
