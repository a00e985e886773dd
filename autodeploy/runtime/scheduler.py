"""``Scheduler``: which sequences run in the next forward, and how many of their tokens.

In-flight (continuous) batching: every step is planned afresh, so a new request joins at the next step
and a finished one leaves at once. A step carries at most ``max_num_tokens`` new tokens and
``max_num_seqs`` sequences. Planning order:

1. Running sequences, most important first (lower ``priority`` value, then earlier arrival): a
   decoding sequence needs one token; a sequence whose prompt is part-way through gets its next chunk.
   When the KV pool cannot hold the tokens, the least important running sequence is *preempted*: its
   blocks are freed and it goes back to the waiting queue, to be recomputed from its tokens later
   (prefix caching usually makes that cheap). A sequence never preempts a more important one.
2. Waiting sequences, most important first, while the budgets and free blocks last; a waiting
   sequence may preempt running ones of strictly lower priority to get a seat or blocks. Prompts
   longer than the token budget are prefilled in chunks over several steps (chunked prefill). A chunk never
   ends inside one of its request's ``whole_spans`` (tokens that attend to one another both ways: each must
   see the others' keys in the forward that computes it); it ends before the span instead, or waits a step.

Sequences that wait on something other than compute (a beam waiting for its group, running or
preempted) report no tokens to compute and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from autodeploy.runtime.block_pool import KVBlockPool


class Schedulable(Protocol):
    seq_id: int
    token_ids: list[int]  # known on the host
    num_computed: int
    priority: int
    arrival: float  # (arrival time, tie-break counter) order

    @property
    def num_tokens(self) -> int:  # token_ids, plus one still on the device while a step is in flight
        ...

    @property
    def num_to_compute(self) -> int: ...


@dataclass
class ScheduledChunk:
    sequence: Schedulable
    start: int  # first token position computed this step
    length: int  # tokens computed this step (a verification chunk: 1 + len(draft))
    # Speculative decoding (runtime/speculative.py): drafted tokens after the sequence's newest, verified by this
    # step (a logits row for each of the chunk's tokens), and the grammar's mask for each of those rows.
    draft: list[int] = field(default_factory=list)
    draft_bitmasks: list | None = None
    # A tree draft: draft[i] follows draft[draft_parents[i]] (-1: the sequence's newest token); None: a chain.
    draft_parents: list[int] | None = None
    # Drafted on the device and not read yet: the draft's tokens are draft_source[draft_rows] (draft holds as many
    # placeholders until the step's samples come back; Speculator.resolve). None: draft holds them.
    draft_rows: list[int] | None = None
    draft_source: Any = None  # a flat int64 tensor on the device

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the sequence's last token (its logits are then needed)."""
        return self.start + self.length == self.sequence.num_tokens + len(self.draft)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # prompt chunks first, then single-token decodes
    preempted: list[Schedulable] = field(default_factory=list)
    encoder_tokens: int = 0  # input tokens of encoder passes the step runs first (an encoder–decoder's new requests)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks) + self.encoder_tokens


def _importance(sequence: Schedulable) -> tuple:
    return (sequence.priority, sequence.arrival)


def _encoder_tokens(sequence: Schedulable) -> int:
    """The input tokens of an encoder–decoder request's encoder pass while it has not run (0 for the others)."""
    request = getattr(sequence, "request", None)
    encoder_input = getattr(request, "encoder_input_ids", None)
    return len(encoder_input) if encoder_input is not None and request.cross_table is None else 0


class Scheduler:
    def __init__(self, pool: KVBlockPool, max_num_seqs: int, max_num_tokens: int, chunked_prefill: bool = True):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: list[Schedulable] = []
        self.running: list[Schedulable] = []
        self.num_preemptions = 0
        # Called with a sequence just preempted (its blocks freed): what else the engine holds for it may go back too
        # (an encoder–decoder's cross-KV blocks, runtime/encoder_pass.py).
        self.preempted: Callable[[Schedulable], None] | None = None

    def add(self, sequence: Schedulable) -> None:
        self.waiting.append(sequence)

    def remove(self, sequence: Schedulable) -> None:
        """Drop a finished or cancelled sequence and free its blocks now."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.pool.free(sequence.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_tokens
        self.running.sort(key=_importance)
        scheduled: list[Schedulable] = []
        index = 0
        while index < len(self.running) and budget > 0:
            sequence = self.running[index]
            want = sequence.num_to_compute
            if want == 0:
                index += 1
                continue
            length = self._chunk_length(sequence, want, budget)
            if not 0 < length <= budget:
                index += 1
                continue
            if not self._reserve_preempting(sequence, length, plan):
                break  # the sequence itself was preempted: everything after it is less important
            plan.chunks.append(ScheduledChunk(sequence, sequence.num_computed, length))
            scheduled.append(sequence)
            budget -= length
            index += 1

        self.waiting.sort(key=_importance)
        index = 0
        while index < len(self.waiting):
            sequence = self.waiting[index]
            if sequence.num_to_compute == 0:  # a preempted beam waiting for its group: nothing to run until its step
                index += 1
                continue
            if len(self.running) >= self.max_num_seqs and not self._preempt_for(sequence, plan):
                break
            encoding = _encoder_tokens(sequence)  # its encoder pass, when it has not run: part of its prefill
            budget = self.max_num_tokens - plan.num_tokens - encoding
            if budget <= 0:
                break
            if sequence.num_computed == 0 and not self.pool.block_table(sequence.seq_id):
                sequence.num_computed = self.pool.acquire_prefix(sequence.seq_id, sequence.token_ids, sequence.request.content_spans)
            want = sequence.num_to_compute
            length = self._chunk_length(sequence, want, budget)
            admitted = 0 < length <= budget
            while admitted and not self.pool.reserve(sequence.seq_id, sequence.num_computed + length):
                admitted = self._preempt_for(sequence, plan)
            if not admitted:
                # A waiting sequence holds no blocks while it waits for some.
                self.pool.free(sequence.seq_id)
                sequence.num_computed = 0
                break
            self.waiting.pop(index)
            self.running.append(sequence)
            plan.chunks.append(ScheduledChunk(sequence, sequence.num_computed, length))
            plan.encoder_tokens += encoding

        plan.chunks.sort(key=lambda chunk: chunk.length == 1)  # stable: decodes last, as cached_attention wants
        return plan

    def _chunk_length(self, sequence: Schedulable, want: int, budget: int) -> int:
        """How many of ``want`` tokens a sequence computes within ``budget``: all of them, or (chunked prefill) as many
        as fit, cut back to before a whole span the cut would fall inside (0: none fit this step)."""
        if not self.chunked_prefill or want <= budget:
            return want
        start = sequence.num_computed
        end = start + budget
        request = getattr(sequence, "request", None)
        for first, last in getattr(request, "whole_spans", ()):
            if first < end < last:
                return max(first - start, 0)
        return budget

    def _reserve_preempting(self, sequence: Schedulable, length: int, plan: StepPlan) -> bool:
        """Blocks for ``length`` more tokens of a running sequence, preempting the least important
        running sequences (possibly this one) until they fit."""
        while not self.pool.reserve(sequence.seq_id, sequence.num_computed + length):
            victim = max(self.running, key=_importance)
            self._preempt(victim, plan)
            if victim is sequence:
                return False
        return True

    def _preempt_for(self, sequence: Schedulable, plan: StepPlan) -> bool:
        """Make room for a waiting sequence by preempting a running one of strictly lower priority."""
        if not self.running:
            return False
        victim = max(self.running, key=_importance)
        if victim.priority <= sequence.priority:
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, sequence: Schedulable, plan: StepPlan) -> None:
        self.running.remove(sequence)
        plan.chunks = [c for c in plan.chunks if c.sequence is not sequence]
        self.pool.free(sequence.seq_id)
        sequence.num_computed = 0
        if self.preempted is not None:
            self.preempted(sequence)
        self.waiting.append(sequence)
        plan.preempted.append(sequence)
        self.num_preemptions += 1
