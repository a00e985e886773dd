"""A vision tower's outputs kept per image, so that an image seen again is not encoded again.

Chats resend the same picture with every turn, and many requests share one (a logo, a screenshot); encoding
it is a full forward of the vision tower. The cache is least-recently-used within a byte budget and safe to
share between threads. Its key joins the image's pixel digest (``autodeploy.runtime.images``) with a digest
of the preprocessing settings, so that two processor configurations never share an entry.

>>> import torch
>>> cache = EncoderCache(budget_bytes=1024)
>>> cache.put(key("9f2c", "a1"), torch.zeros(4, 8))  # 128 bytes
True
>>> cache.get(key("9f2c", "a1")).shape, cache.get(key("9f2c", "b2"))
(torch.Size([4, 8]), None)
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

from autodeploy.errors import ConfigError


def key(image_digest: str, settings_digest: str) -> str:
    """The cache key of one image under one preprocessing configuration (length-prefixed, so no two pairs
    of strings join to the same text)."""
    joined = f"{len(image_digest)}:{image_digest}:{settings_digest}"
    return hashlib.blake2b(joined.encode(), digest_size=32).hexdigest()


def tensor_bytes(value: torch.Tensor) -> int:
    """What an entry costs in the budget: the bytes of its elements."""
    return value.numel() * value.element_size()


class EncoderCache:
    """Least-recently-used tensors within ``budget_bytes``; ``budget_bytes=0`` turns caching off.

    The cache holds the tensors it is given, not copies: do not modify one in place after ``put`` or ``get``.
    ``hits``, ``misses``, ``evictions`` and ``bytes_used`` are counts for metrics, read without the lock.
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ConfigError(f"the encoder cache budget must be 0 or more bytes (0 turns the cache off); got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor stored under ``key``, now the most recently used, or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: str, value: torch.Tensor) -> bool:
        """Store ``value`` under ``key`` (replacing what was there), evicting the least recently used entries
        until it fits. False, and nothing stored, when it is larger than the whole budget."""
        size = tensor_bytes(value)
        with self._lock:
            self._remove(key)  # a value that cannot be stored must not leave the old one standing in for it
            if self.budget_bytes == 0 or size > self.budget_bytes:
                return False
            while self.bytes_used + size > self.budget_bytes:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
            self._entries[key] = value
            self.bytes_used += size
            return True

    def clear(self) -> None:
        """Forget every entry (benchmarks measure each run from a cold cache); the counts stay."""
        with self._lock:
            self._entries.clear()
            self.bytes_used = 0

    def _remove(self, key: str) -> None:
        value = self._entries.pop(key, None)
        if value is not None:
            self.bytes_used -= tensor_bytes(value)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
