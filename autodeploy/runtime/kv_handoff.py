"""``KVHandoff``: a prompt's KV-cache blocks out of one engine and into another (disaggregated serving).

A prefill worker computes a prompt, then *holds* its full blocks (references taken under a holder id, so neither
eviction nor a new request can reuse them) until the decode worker says it has them. The decode worker *adopts*
the prefix: the blocks its own prefix cache holds already are shared, each other one gets a new block, which is
written from the payload and checked, and only then put in its prefix cache. The request itself is then submitted
as usual and finds its prompt cached, so the decode worker computes at most the last partial block and samples
every token itself: what it generates is what one engine would have, whatever arrived or failed to.

Blocks go by the prefix cache's keys (``KVBlockPool.block_keys``: a hash of all the tokens up to a block's end),
so both sides name the same blocks without sharing ids. A payload is one block of every layer's K and V, cache
by cache in name order; two engines may exchange blocks only when their ``KVLayout``s match.

    prefill = engine.handoff                                      # on the prefill worker, after the prompt ran
    keys = prefill.hold("t1", prompt_ids)
    blocks = dict(prefill.payloads("t1", skip=decode.cached(keys)))   # index → bytes (sent over gRPC)
    new = decode.adopt("t1", keys)                                 # the indices to fill
    decode.write("t1", keys, {i: blocks[i] for i in new})          # checked payloads only
    prefill.release("t1"); …; decode.release("t1")                # once the request has its prefix
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from autodeploy.runtime.block_pool import KVBlockPool


@dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on to exchange KV blocks: the block size and each cache's per-block shape and dtype."""

    block_size: int
    caches: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape of one block, dtype), by name

    @classmethod
    def of(cls, caches: Mapping[str, torch.Tensor], block_size: int) -> KVLayout:
        return cls(block_size, tuple((name, tuple(caches[name].shape[1:]), str(caches[name].dtype)) for name in sorted(caches)))

    @property
    def block_bytes(self) -> int:
        return sum(_numel(shape) * torch.empty((), dtype=_dtype(dtype)).element_size() for _, shape, dtype in self.caches)

    def describe(self) -> str:
        name, shape, dtype = self.caches[0]
        return f"{len(self.caches)} caches of {shape} {dtype.removeprefix('torch.')} per block of {self.block_size} tokens"

    def digest(self) -> str:
        return hashlib.blake2b(repr(self).encode(), digest_size=8).hexdigest()


class KVHandoff:
    """One engine's side of KV hand-offs. ``lock``: the engine's (requests, scheduler and pool), held for every pool
    change and every read or write of the caches, so a step never plans with a half-adopted prefix."""

    def __init__(self, pool: KVBlockPool, caches: Mapping[str, torch.Tensor], lock: threading.RLock):
        self.pool = pool
        self.caches = caches
        self.layout = KVLayout.of(caches, pool.block_size)
        self._names = [name for name, _, _ in self.layout.caches]
        self._lock = lock
        self._holds: dict[str, float] = {}  # holder id → when it expires (time.monotonic)
        self._unwritten: dict[str, dict[int, int]] = {}  # an adopting holder's new blocks: index → block id
        self._writing: set[str] = set()  # holders whose blocks are being written (outside the lock): never expired

    # ---- the prefill side ----------------------------------------------------------------------
    def hold(self, holder: str, token_ids: Sequence[int], content_spans: Sequence[tuple[int, int, str]] = (),
             ttl_s: float = 60.0) -> list[bytes]:
        """Take a reference on each cached block of the longest cached prefix of ``token_ids`` (after its request ran,
        all its full blocks but one token's) and return their keys. They stay until ``release(holder)``, or ``ttl_s``
        seconds (``expire``): a decode worker that died does not pin them for ever."""
        with self._lock:
            self.pool.acquire_prefix(_key(holder), token_ids, content_spans, count=False)
            table = self.pool.block_table(_key(holder))
            self._holds[holder] = time.monotonic() + ttl_s
            return self.pool.block_keys(_key(holder), token_ids, len(table), content_spans)

    def payloads(self, holder: str, skip: set[bytes] = frozenset()) -> Iterator[tuple[int, bytes]]:
        """``(index, payload)`` of each held block whose key is not in ``skip`` (blocks the receiver has), in order.
        The engine's lock is held only to launch the gather (one row of bytes a block, every cache's part side by side):
        the copy to the host waits outside it, so the engine's steps go on meanwhile (a step launched later runs after
        the gather on the device, whatever happens to the hold)."""
        with self._lock:
            if holder not in self._holds:
                raise KeyError(holder)
            table = self.pool.block_table(_key(holder))
            keys = self.keys(holder)
            wanted = [index for index, key in enumerate(keys) if key not in skip]
            if not wanted:
                return
            ids = torch.tensor([table[i] for i in wanted], device=next(iter(self.caches.values())).device)
            gathered = torch.cat([_bytes_view(self.caches[name]).index_select(0, ids) for name in self._names], dim=1)
        rows = gathered.cpu()  # one copy to the host for all of them
        for row, index in zip(rows.numpy(), wanted):
            yield index, row.tobytes()

    def keys(self, holder: str) -> list[bytes]:
        """The keys of the blocks ``holder`` holds (computed when it took them: no tokens needed now)."""
        with self._lock:
            return self.pool.block_keys(_key(holder), (), len(self.pool.block_table(_key(holder))))

    def release(self, holder: str) -> bool:
        """Drop a hold (the prefill side's, once the receiver has the blocks; the decode side's, once its request has
        its prefix); False when it was not held (released already, or expired)."""
        with self._lock:
            self._unwritten.pop(holder, None)
            if self._holds.pop(holder, None) is None:
                return False
            if holder not in self._writing:  # else the writer frees the blocks once it is done with them
                self.pool.free(_key(holder))
            return True

    def expire(self, now: float | None = None) -> list[str]:
        """Release the holds past their time; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [holder for holder, deadline in self._holds.items() if deadline <= now and holder not in self._writing]
            for holder in late:
                self.release(holder)
            return late

    @property
    def held(self) -> int:
        return len(self._holds)

    # ---- the decode side -----------------------------------------------------------------------
    def cached(self, keys: Sequence[bytes]) -> set[bytes]:
        """The keys among ``keys`` whose blocks this engine's prefix cache holds (the sender skips them)."""
        with self._lock:
            return self.pool.cached_keys(keys)

    def adopt(self, holder: str, keys: Sequence[bytes], ttl_s: float = 60.0) -> list[int] | None:
        """Blocks for the prefix ``keys`` under ``holder`` (see ``KVBlockPool.adopt_prefix``): the indices whose
        payloads ``write`` must fill; None when the pool has no room (the request then computes its prompt itself)."""
        with self._lock:
            new = self.pool.adopt_prefix(_key(holder), keys)
            if new is None:
                return None
            self._holds[holder] = time.monotonic() + ttl_s
            self._unwritten[holder] = dict(new)
            return [index for index, _ in new]

    def write(self, holder: str, keys: Sequence[bytes], payloads: Mapping[int, bytes]) -> int:
        """Write ``payloads`` (index → one block's bytes, checked by the caller) into ``holder``'s new blocks and put the
        leading run of blocks that are complete in the prefix cache; returns how many blocks that run has. A block
        with no payload (lost, or failed its check) ends the run: the request computes it and everything after it. The
        engine's lock is not held while the bytes travel to the device: the new blocks are the holder's alone until they
        are published, and a release (or expiry) meanwhile leaves them to this call, which frees them when done."""
        with self._lock:
            new = self._unwritten.pop(holder, {})
            complete = 0
            while complete < len(keys) and (complete not in new or complete in payloads):
                complete += 1
            writes = [(new[index], payloads[index]) for index in sorted(new) if index < complete]
            for _, payload in writes:
                if len(payload) != self.layout.block_bytes:
                    raise ValueError(f"a KV payload has {len(payload)} bytes; a block of this layout has {self.layout.block_bytes}")
            self._writing.add(holder)
        try:
            if writes:
                self._write_blocks(writes)
        finally:
            with self._lock:
                self._writing.discard(holder)
                released = holder not in self._holds
                if released:  # released while written (release left the blocks to this): they go back only now
                    self.pool.free(_key(holder))
        if released:
            return 0
        with self._lock:
            self.pool.publish_adopted(_key(holder), keys, complete)
            return complete

    def _write_blocks(self, writes: list[tuple[int, bytes]]) -> None:
        device = next(iter(self.caches.values())).device
        ids = torch.tensor([block for block, _ in writes], device=device)
        host = torch.frombuffer(bytearray(b"".join(payload for _, payload in writes)), dtype=torch.uint8)
        rows = host.to(device).view(len(writes), -1)  # one copy to the device for all of them
        offset = 0
        for name in self._names:
            cache = _bytes_view(self.caches[name])
            cache.index_copy_(0, ids, rows[:, offset: offset + cache.shape[1]])
            offset += cache.shape[1]
        if device.type == "cuda":  # written before it is published: a step on any stream may read the blocks after that
            torch.cuda.current_stream(device).synchronize()


def _key(holder: str) -> Hashable:
    return ("kv-handoff", holder)


def _bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache's blocks as bytes ``[blocks, bytes per block]`` (any dtype, float8 included, copies as bytes)."""
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
