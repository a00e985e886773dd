"""The deployment's tensors in one safetensors file: read without pickle, each onto the device it served on.

Loaded tensors are bit-identical to the saved ones and aligned as torch aligns its own, so the reloaded graph
computes bit-identical logits. A tensor that several graph inputs share (tied embeddings) is stored once, under one key; a tensor that
only overlaps another's memory (a view into it) is stored as a copy of its own, since safetensors holds
no views.

Threads share the file's ``manifest.DIGEST_CHUNK`` chunks: first each chunk is read and copied into the
tensors it holds (for a GPU, from a pinned buffer on the thread's own stream), then each is read again and
hashed for the file's digest (``manifest.file_digest``), which the caller checks before serving
(:func:`start_reading`).

    keys = save_tensors({"lm_head_weight": w, "embed_weight": w}, path)   # both → "lm_head_weight"
    tensors, digest = load_tensors(path, {"lm_head_weight": "cpu"})
"""

from __future__ import annotations

import hashlib
import json
import os
import contextlib
from collections.abc import Mapping
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from autodeploy.errors import CheckpointError

from . import manifest

_READ_THREADS = 16  # at most, and two fewer than the cores: the caller's thread works meanwhile
_READ_BYTES = 32 << 20  # a thread reads its chunks in pieces of this size into its one buffer (pinned for a GPU)


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


class WeightsRead:
    """The deployment's tensors being read (:func:`start_reading`): ``tensors()`` waits for their copies,
    ``digest()`` for the file's digest (:func:`manifest.file_digest`'s); ``layout()`` waits for nothing.
    ``close()`` waits for the threads."""

    def __init__(self, pool: ThreadPoolExecutor, reader: _ChunkReader, copies: list[Future], hashes: list[Future]):
        self._pool, self._reader, self._copies, self._hashes = pool, reader, copies, hashes

    def tensors(self) -> dict[str, torch.Tensor]:
        for copy in self._copies:
            copy.result()
        return self._reader.tensors

    def digest(self) -> str:
        return manifest.digest_of_chunks([chunk.result() for chunk in self._hashes])

    def layout(self) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """Each key's dtype and shape as the file's header gives them, known before the copies end."""
        return {key: (tensor.dtype, tensor.shape) for key, tensor in self._reader.tensors.items()}

    def close(self) -> None:
        for future in (*self._copies, *self._hashes):
            future.cancel()
        self._pool.shutdown(wait=True)
        self._reader.close()


def start_reading(path: Path, devices: Mapping[str, str]) -> WeightsRead:
    """Start reading the tensors under ``devices``' keys, each onto its device, and hashing the file, on
    background threads. safetensors checks the header (offsets inside the file, no overlaps, sizes that
    match dtypes and shapes) and gives each tensor's dtype and shape; nothing is unpickled.

    The copies come first: each thread reads a ``manifest.DIGEST_CHUNK`` chunk, ``_READ_BYTES`` at a time,
    into its buffer (pinned for a GPU) and copies the pieces it holds into their tensors. The file is then read again, a chunk at a
    time, for its digest: sha256 is the slow half (~0.6 GB/s a core), so the caller can use the tensors
    (build CUDA graphs on them) while the digest is computed, as long as it checks the digest before
    anything is served. Each thread takes the GIL a few times a chunk (its reads, hashing and copies
    leave it), so the caller's own Python work (the graph's deserialization) keeps it nearly to itself."""
    chunk_bytes = manifest.DIGEST_CHUNK
    spans = _spans(path, devices)
    tensors = {key: torch.empty(shape, dtype=dtype, device=devices[key]) for key, (dtype, shape, _, _) in spans.items()}
    pieces = {}  # a chunk's file offset → [(key, offset in the chunk, offset in the tensor, bytes)]
    for key, (_, _, begin, end) in spans.items():
        for chunk in range(begin - begin % chunk_bytes, end, chunk_bytes):
            first, last = max(begin, chunk), min(end, chunk + chunk_bytes)
            pieces.setdefault(chunk, []).append((key, first - chunk, first - begin, last - first))
    size = path.stat().st_size
    chunks = list(range(0, size, chunk_bytes))
    pinned = any(t.is_cuda for t in tensors.values())
    pool = ThreadPoolExecutor(max_workers=max(1, min(_READ_THREADS, (os.cpu_count() or 3) - 2, len(chunks))))
    reader = _ChunkReader(path, size, chunk_bytes, tensors, pinned)
    try:
        copies = [pool.submit(reader.copy, chunk, pieces[chunk]) for chunk in chunks if chunk in pieces]
        hashes = [pool.submit(reader.sha256, chunk) for chunk in chunks]  # queued behind every copy
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        reader.close()
        raise
    return WeightsRead(pool, reader, copies, hashes)


def load_tensors(path: Path, devices: Mapping[str, str]) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors under ``devices``' keys, each on its device, and the file's digest, when both are done."""
    reading = start_reading(path, devices)
    try:
        return reading.tensors(), reading.digest()
    finally:
        reading.close()


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


class _ChunkReader:
    """Per thread: a buffer of ``_READ_BYTES`` (pinned for a GPU), an open file and a stream its copies run on."""

    def __init__(self, path: Path, size: int, chunk_bytes: int, tensors: dict[str, torch.Tensor], pinned: bool):
        self.path, self.size, self.chunk_bytes, self.tensors, self.pinned = path, size, chunk_bytes, tensors, pinned
        self.local = threading.local()
        self.files: list = []  # every thread's, closed by close()

    def _thread_state(self):
        state = self.local.__dict__
        if not state:
            state["file"] = open(self.path, "rb")
            self.files.append(state["file"])
            state["buffer"] = torch.empty(_READ_BYTES, dtype=torch.uint8, pin_memory=self.pinned)
            state["view"] = memoryview(state["buffer"].numpy())
            state["stream"] = torch.cuda.Stream() if self.pinned else None
        return state

    def _reads(self, chunk: int):
        """The chunk's pieces in turn, each read into the thread's buffer: (file offset, view of the buffer)."""
        state = self._thread_state()
        end = min(chunk + self.chunk_bytes, self.size)
        for read in range(chunk, end, _READ_BYTES):
            view = state["view"][: min(_READ_BYTES, end - read)]
            filled = 0
            while filled < len(view):
                got = os.preadv(state["file"].fileno(), [view[filled:]], read + filled)
                if got == 0:
                    raise CheckpointError(f"{self.path} ended at byte {read + filled} while it was read; save the deployment again")
                filled += got
            yield read, view

    def copy(self, chunk: int, pieces: list[tuple[str, int, int, int]]) -> None:
        state = self._thread_state()
        buffer, stream = state["buffer"], state["stream"]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for read, view in self._reads(chunk):
                for key, at, start, length in pieces:  # each piece's overlap with this read
                    first, last = max(chunk + at, read), min(chunk + at + length, read + len(view))
                    if first < last:
                        _as_bytes(self.tensors[key])[start + first - chunk - at:start + last - chunk - at].copy_(
                            buffer[first - read:last - read], non_blocking=stream is not None)
                if stream is not None:
                    stream.synchronize()  # the buffer is read into again next

    def sha256(self, chunk: int) -> bytes:
        sha256 = hashlib.sha256()
        for _, view in self._reads(chunk):
            sha256.update(view)
        return sha256.digest()

    def close(self) -> None:
        for file in self.files:
            file.close()
