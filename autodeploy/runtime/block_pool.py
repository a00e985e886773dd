"""``KVBlockPool``: which KV-cache blocks each sequence owns, with prefix caching.

The device caches are ``num_blocks`` fixed-size blocks per layer; this pool only does the bookkeeping
(block ids, reference counts, block tables), so it is the same on every device and cheap to test.
Fixed-size blocks cannot fragment: any free block serves any sequence.

Prefix caching: once a block is full of computed tokens, it is registered under a hash of *all* the
tokens up to its end (the parent block's hash chained with its own tokens), so a later prompt with the
same prefix reuses it instead of recomputing. Shared blocks are reference counted. A block whose last
owner leaves keeps its contents and hash, parked in an LRU list; it is reused on a hit, or evicted
(oldest first) only when no never-used block is left.

    pool = KVBlockPool(num_blocks=64, block_size=16)
    cached = pool.acquire_prefix("a", prompt)          # tokens whose K/V are already cached (a multiple of 16)
    pool.reserve("a", len(prompt))                     # blocks for everything else, or False if none left
    pool.register_full_blocks("a", prompt, len(prompt))   # after the forward wrote them
    pool.free("a")
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV block pool needs ≥ 1 block of ≥ 1 token; got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._ref_counts = [0] * num_blocks
        self._never_used = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._parked: OrderedDict[int, None] = OrderedDict()  # free but still holding a cached prefix; LRU first
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        self._tables: dict[Hashable, list[int]] = {}
        self._prefix_hash_cache: dict[Hashable, list[bytes]] = {}  # per sequence, hashes of its leading full blocks
        self._published: dict[Hashable, int] = {}  # per sequence, leading blocks already in the prefix cache

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (never used, or parked and evictable)."""
        return len(self._never_used) + len(self._parked)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._tables.get(seq_id, [])

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """How many more blocks ``seq_id`` needs to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(self.block_table(seq_id)))

    # ---- allocation ----------------------------------------------------------------------------
    def acquire_prefix(self, seq_id: Hashable, token_ids: Sequence[int], content_spans: Sequence[tuple[int, int, str]] = (),
                       count: bool = True) -> int:
        """Start ``seq_id``'s table with the cached blocks of its longest cached prefix; returns how many
        tokens that covers. At least one token is always left to compute (its logits are needed), and a
        block being shared is never written again. ``count``: whether the lookup counts in the hit-rate
        ``stats`` (a KV hand-off's hold, ``kv_handoff.py``, is not a request's lookup)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it first")
        self._tables[seq_id] = []
        if not self.enable_prefix_caching:
            return 0
        reusable_blocks = (len(token_ids) - 1) // self.block_size
        if count:
            self.stats.queried_tokens += len(token_ids)
        table = self._tables[seq_id]
        for block_hash in self.block_keys(seq_id, token_ids, reusable_blocks, content_spans):
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            self._take(block)
            table.append(block)
        self._published[seq_id] = len(table)
        cached = len(table) * self.block_size
        if count:
            self.stats.hit_tokens += cached
        return cached

    def reserve(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to hold ``num_tokens``; all or nothing (False when blocks run out)."""
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            table.append(self._pop_free_block())
        return True

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Give back ``seq_id``'s blocks past those ``num_tokens`` tokens need (the rejected tokens of a draft; such
        blocks were never published to the prefix cache, which holds only tokens the host knows)."""
        table = self._tables.get(seq_id)
        if not table:
            return
        keep = -(-num_tokens // self.block_size)
        for block in reversed(table[keep:]):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._never_used.append(block)
        del table[keep:]

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> int:
        """Give ``child_id`` the parent's *full* blocks among its first ``num_tokens`` (shared, not copied);
        returns the tokens covered. The child recomputes the rest, so no block is written by two owners. A
        parent that holds no blocks (preempted) shares none, and the child starts like a new sequence."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already holds blocks; free it first")
        shared = self._tables.get(parent_id, [])[: num_tokens // self.block_size]
        if not shared:
            return 0
        for block in shared:
            self._take(block)
        self._tables[child_id] = list(shared)
        return len(shared) * self.block_size

    def register_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int,
                             content_spans: Sequence[tuple[int, int, str]] = ()) -> None:
        """Publish ``seq_id``'s blocks that are now full of computed tokens to the prefix cache (none
        when it holds no blocks: it was preempted after its step was launched)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id, [])
        full = min(num_computed // self.block_size, len(table))
        published = self._published.get(seq_id, 0)
        if full <= published:
            return
        hashes = self.block_keys(seq_id, token_ids, full, content_spans)
        for block, block_hash in zip(table[published:full], hashes[published:full]):
            if block not in self._hash_of_block and block_hash not in self._block_of_hash:
                # (the same prefix computed twice concurrently keeps the first copy)
                self._block_of_hash[block_hash] = block
                self._hash_of_block[block] = block_hash
        self._published[seq_id] = full

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``'s blocks (unknown ids are ignored, so freeing twice is harmless)."""
        self._prefix_hash_cache.pop(seq_id, None)
        self._published.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._hash_of_block:
                    self._parked[block] = None  # most recently used last
                else:
                    self._never_used.append(block)

    # ---- blocks from another pool (disaggregated serving, kv_handoff.py) -------------------------
    def cached_keys(self, block_keys: Sequence[bytes]) -> set[bytes]:
        """Which of ``block_keys`` (``block_keys``' prefix hashes) this pool's prefix cache holds."""
        return {key for key in block_keys if key in self._block_of_hash}

    def adopt_prefix(self, holder: Hashable, block_keys: Sequence[bytes]) -> list[tuple[int, int]] | None:
        """Give ``holder`` a table for the prefix whose blocks have ``block_keys``: the blocks this prefix cache holds
        already (shared), a new block for each other. Returns ``(index, block)`` of the new blocks, whose contents the
        caller writes and then ``publish_adopted``; None (and nothing taken) when the pool has too few free blocks."""
        if holder in self._tables:
            raise ValueError(f"holder {holder!r} already holds blocks; free it first")
        cached = [self._block_of_hash.get(key) for key in block_keys]
        if sum(block is None for block in cached) > self.num_free_blocks - sum(
                block is not None and self._ref_counts[block] == 0 for block in cached):
            return None
        table, new = [], []
        for block in cached:  # the shared blocks first, so no new block evicts one of them
            if block is not None:
                self._take(block)
        for index, block in enumerate(cached):
            if block is None:
                block = self._pop_free_block()
                new.append((index, block))
            table.append(block)
        self._tables[holder] = table
        return new

    def publish_adopted(self, holder: Hashable, block_keys: Sequence[bytes], num_blocks: int) -> None:
        """Put ``holder``'s first ``num_blocks`` blocks in the prefix cache under ``block_keys`` (their contents are
        written and checked); a later request with that prefix shares them. Its other new blocks stay out of it."""
        if not self.enable_prefix_caching:
            return
        for block, key in zip(self._tables.get(holder, [])[:num_blocks], block_keys[:num_blocks]):
            if block not in self._hash_of_block and key not in self._block_of_hash:
                self._block_of_hash[key] = block
                self._hash_of_block[block] = key

    def reset_prefix_cache(self) -> None:
        """Forget every parked prefix (benchmarks measure each repeat from a cold cache); blocks in use
        keep theirs."""
        for block in self._parked:
            del self._block_of_hash[self._hash_of_block.pop(block)]
            self._never_used.append(block)
        self._parked.clear()

    # ---- keys ----------------------------------------------------------------------------------
    def block_keys(self, seq_id: Hashable, token_ids: Sequence[int], num_blocks: int,
                   content_spans: Sequence[tuple[int, int, str]] = ()) -> list[bytes]:
        """The prefix cache's key of each of ``seq_id``'s first ``num_blocks`` blocks: a hash chained so that it
        names the whole prefix, computed once per block while the sequence holds blocks (what else is kept per
        block of a prefix, ``HiddenStateStore``'s rows, goes by the same keys). BLAKE2 rather than Python's
        ``hash``: a collision would silently serve another prompt's cache. ``content_spans``: positions
        ``[start, end)`` whose K/V depend on more than their token ids (an image's placeholders), with that content's
        key, hashed into every block they touch."""
        hashes = self._prefix_hash_cache.setdefault(seq_id, [])
        size = self.block_size
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else b""
            block_tokens = array("q", token_ids[index * size : (index + 1) * size]).tobytes()
            content = "".join(key for start, end, key in content_spans if start < (index + 1) * size and end > index * size)
            hashes.append(hashlib.blake2b(parent + block_tokens + content.encode(), digest_size=16).digest())
        return hashes[:num_blocks]

    # ---- internals -----------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._parked[block]
        self._ref_counts[block] += 1

    def _pop_free_block(self) -> int:
        if self._never_used:
            block = self._never_used.pop()
        else:
            block, _ = self._parked.popitem(last=False)  # evict the least recently used cached prefix
            del self._block_of_hash[self._hash_of_block.pop(block)]
        self._ref_counts[block] = 1
        return block
