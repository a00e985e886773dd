"""``HiddenStateStore``: the model's hidden-state rows of full KV blocks, kept for the hidden-state drafters
(``eagle3``, ``mtp``) past the sequence that computed them, so that a prefix-cache hit can feed its head too.

A request whose prompt is mostly a prefix-cache hit never computes the cached positions, so the head would draft
without them (on a GPU benchmark over 63 repeated code-rewrite prompts, 88 % prefix hits, EAGLE-3 acceptance fell
to 6 % from ~47 %: the drafts copy from the quoted code). The store keeps each full block's rows under the
prefix cache's own key for that block (``KVBlockPool.block_keys``: a hash of the block's tokens and everything before
them, so equal keys mean equal hidden states), least recently used first out, in one tensor preallocated to
``speculative.options.hidden_state_cache_mb``. A sequence writes its rows into blocks of its own as they are
computed (``place``; a block's rows may come from several steps, a draft's rows stay tentative until verified) and
hands each block over once it is full of final rows whose tokens the host knows (``register``). A hit reads back the
longest run of stored blocks ending where its computation starts (``recall``); a block evicted meanwhile only
shortens the run (fewer positions fed, never other output: drafts only propose).

    store = HiddenStateStore(capacity=64, block_size=16, width=192, device=torch.device("cpu"), dtype=torch.float32)
    for position, row, count in store.place(seq_id=1, start=0, count=40):   # runs of rows, one per block
        store.rows[row : row + count] = hidden[position : position + count]   # (the drafter copies them on the device)
    ready = store.ready(1, known_tokens=40)                                  # 2: blocks 0 and 1 are full
    store.register(1, pool.block_keys(1, tokens, ready))
    first_block, rows = store.recall(pool.block_keys(2, tokens, 2), limit=64)   # rows of blocks first_block … 1
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from autodeploy.runtime.device_copies import pinned_to_device

HIDDEN_STATE_CACHE_MB = 512  # the store's default size (options.hidden_state_cache_mb); 0 turns it off


@dataclass
class _Filling:
    """One sequence's rows not handed to the store yet."""

    done: int = 0  # positions before it are in blocks handed over (or never to be): a block boundary
    written: int = 0  # positions done … written - 1 are in ``blocks``, the latest rows computed for them
    final: int = 0  # positions before it hold the model's final rows (not a draft's that may be refused)
    blocks: list[int] = field(default_factory=list)  # the store's blocks holding positions done … (one per block)


class HiddenStateStore:
    """Up to ``capacity`` blocks of ``block_size`` hidden-state rows of ``width``: the registered ones by key in LRU
    order, the others free or being written by a sequence."""

    def __init__(self, capacity: int, block_size: int, width: int, device: torch.device, dtype: torch.dtype):
        self.block_size = block_size
        # Never read before written (a block is read only once registered), so not zeroed: on the CPU untouched pages
        # cost nothing.
        self.rows = torch.empty(capacity * block_size, width, device=device, dtype=dtype)
        self._free = list(range(capacity - 1, -1, -1))
        self._registered: OrderedDict[bytes, int] = OrderedDict()  # key → block; least recently used first
        self._filling: dict[int, _Filling] = {}
        self.recalled = 0  # positions handed back to hits (the report's figure)

    @classmethod
    def of_budget(cls, megabytes: float, block_size: int, width: int, device: torch.device,
                  dtype: torch.dtype) -> HiddenStateStore | None:
        """The store that fits ``megabytes`` (None when not one block does)."""
        block_bytes = block_size * width * torch.empty(0, dtype=dtype).element_size()
        capacity = int(megabytes * 2**20) // block_bytes
        return cls(capacity, block_size, width, device, dtype) if capacity > 0 else None

    @property
    def capacity(self) -> int:
        return len(self.rows) // self.block_size

    @property
    def num_registered(self) -> int:
        return len(self._registered)

    def place(self, seq_id: int, start: int, count: int, final: int | None = None) -> list[tuple[int, int, int]]:
        """Where the rows of ``seq_id``'s positions ``start … start + count - 1``, as computed now, go: runs of
        (first position, its row in ``rows``, positions), one per block, of those kept (none: positions already
        handed over, ones not contiguous with what the sequence wrote from a block boundary on, or no block free).
        Rows after them written before are stale (a refused draft's). ``final``: positions before it are final
        (default ``start + count``); those before ``start`` are in any case (a chunk starts at the sequence's
        computed tokens)."""
        filling = self._filling.setdefault(seq_id, _Filling())
        size = self.block_size
        if start > filling.written:  # positions between never written here: start again at the next block
            self._free_blocks(filling)
            filling.done = filling.written = -(-start // size) * size
        first, end = max(start, filling.done), start + count
        filling.written = first
        filling.final = max(start, start + count if final is None else final)
        needed = -(-end // size) - filling.done // size
        while len(filling.blocks) < needed:
            block = self._take_block()
            if block is None:
                end = filling.done + len(filling.blocks) * size
                break
            filling.blocks.append(block)
        runs, position = [], first
        while position < end:
            offset = position - filling.done
            stop = min(end, position - offset % size + size)  # the end of the block
            runs.append((position, filling.blocks[offset // size] * size + offset % size, stop - position))
            position = stop
        filling.written = max(end, first)
        return runs

    def place_row(self, seq_id: int, position: int) -> int:
        """``place`` of one final row (a decode's, the common case, kept cheap): its row in ``rows``, or -1."""
        filling = self._filling.get(seq_id)
        if filling is not None and filling.done <= position == filling.written:
            offset = position - filling.done
            if offset // self.block_size < len(filling.blocks):
                filling.written = filling.final = position + 1
                return filling.blocks[offset // self.block_size] * self.block_size + offset % self.block_size
        runs = self.place(seq_id, position, 1)
        return runs[0][1] if runs else -1

    def ready(self, seq_id: int, known_tokens: int) -> int:
        """How many of ``seq_id``'s first blocks ``register`` takes now that the host knows ``known_tokens`` of its
        tokens: those full of final rows (0 when that is none it has not taken)."""
        filling = self._filling.get(seq_id)
        if filling is None:
            return 0
        ready = min(filling.written, filling.final, known_tokens) // self.block_size
        return ready if ready > filling.done // self.block_size else 0

    def register(self, seq_id: int, keys: list[bytes]) -> None:
        """Hand over ``seq_id``'s blocks up to ``len(keys)`` (``ready``), each under its key (``keys``: those of the
        sequence's first blocks). A key already held keeps its block (the same prefix computed twice), which becomes
        the most recently used."""
        filling = self._filling[seq_id]
        for index in range(filling.done // self.block_size, len(keys)):
            block, key = filling.blocks.pop(0), keys[index]
            if key in self._registered:
                self._free.append(block)
                self._registered.move_to_end(key)
            else:
                self._registered[key] = block
        filling.done = len(keys) * self.block_size

    def recall(self, keys: list[bytes], limit: int) -> tuple[int, torch.Tensor] | None:
        """The rows of the longest run of stored blocks, at most ``limit``, that ends with the last of ``keys`` (a
        sequence's first blocks): the index of the run's first block and its rows, a copy ``[blocks · size, width]``.
        None when the last block is not stored."""
        run = []
        for key in reversed(keys):
            if key not in self._registered or len(run) == limit:
                break
            run.append(key)
        if not run:
            return None
        run.reverse()
        for key in run:  # the run's earliest blocks the least recently used: an eviction shortens a run, not ends it
            self._registered.move_to_end(key)
        blocks = torch.tensor([self._registered[key] for key in run], dtype=torch.long)
        index = pinned_to_device(blocks, self.rows.device)
        rows = self.rows.view(-1, self.block_size, self.rows.shape[-1]).index_select(0, index).flatten(0, 1)
        self.recalled += len(rows)
        return len(keys) - len(run), rows

    def release(self, seq_id: int) -> None:
        """Forget ``seq_id``'s blocks not handed over (it finished)."""
        filling = self._filling.pop(seq_id, None)
        if filling is not None:
            self._free_blocks(filling)

    def _free_blocks(self, filling: _Filling) -> None:
        self._free.extend(filling.blocks)
        filling.blocks.clear()

    def _take_block(self) -> int | None:
        """A free block, else the least recently used registered one; None when every block is being written."""
        if self._free:
            return self._free.pop()
        if self._registered:
            return self._registered.popitem(last=False)[1]
        return None
