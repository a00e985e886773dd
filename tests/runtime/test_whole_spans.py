"""Prompt spans whose tokens attend to one another both ways (Gemma 3's images, ``Request.whole_spans``): the
scheduler never ends a prefill chunk inside one, and each of their tokens attends up to the span's end."""

from __future__ import annotations

from dataclasses import dataclass, field

from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.scheduler import ScheduledChunk, Scheduler
from autodeploy.runtime.step_inputs import chunk_attend_until


@dataclass
class FakeRequest:
    prompt_token_ids: list[int]
    whole_spans: tuple[tuple[int, int], ...] = ()
    content_spans: tuple = ()
    side_inputs: dict = field(default_factory=dict)


@dataclass
class FakeSequence:
    seq_id: int
    token_ids: list[int]
    request: FakeRequest
    num_computed: int = 0
    priority: int = 0
    arrival: tuple = (0.0, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens - self.num_computed


def prefill_chunks(sequence: FakeSequence, budget: int, steps: int = 6) -> list[tuple[int, int]]:
    scheduler = Scheduler(KVBlockPool(64, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_tokens=budget)
    scheduler.add(sequence)
    chunks = []
    for _ in range(steps):
        plan = scheduler.schedule()
        for chunk in plan.chunks:
            chunks.append((chunk.start, chunk.length))
            chunk.sequence.num_computed += chunk.length
        if sequence.num_to_compute == 0:
            break
    return chunks


def test_a_chunk_that_would_end_inside_a_span_ends_before_it_and_the_next_takes_it_whole():
    prompt = list(range(40))
    sequence = FakeSequence(0, prompt, FakeRequest(prompt, ((10, 26),)))
    assert prefill_chunks(sequence, budget=16) == [(0, 10), (10, 16), (26, 14)]


def test_without_spans_chunks_fill_the_budget():
    prompt = list(range(40))
    assert prefill_chunks(FakeSequence(0, prompt, FakeRequest(prompt)), budget=16) == [(0, 16), (16, 16), (32, 8)]


def test_a_sequence_whose_cached_prefix_ends_inside_a_span_computes_the_rest_of_it_in_one_chunk():
    prompt = list(range(40))
    sequence = FakeSequence(0, prompt, FakeRequest(prompt, ((10, 26),)), num_computed=12)
    scheduler = Scheduler(KVBlockPool(64, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_tokens=16)
    scheduler.running.append(sequence)
    scheduler.pool.reserve(0, 12)
    [chunk] = scheduler.schedule().chunks
    assert (chunk.start, chunk.length) == (12, 16)  # through the span's end at 26
    sequence.num_computed, budget_short = 12, Scheduler(KVBlockPool(64, 4, False), 4, 10)
    budget_short.running.append(sequence)
    assert budget_short.schedule().chunks == []  # 14 tokens left in the span, 10 a step: waits rather than cut it


def test_span_tokens_attend_up_to_the_spans_end_and_the_rest_causally():
    prompt = list(range(30))
    sequence = FakeSequence(0, prompt + [99], FakeRequest(prompt, ((4, 8), (8, 12))))
    assert chunk_attend_until(ScheduledChunk(sequence, 2, 8)) == [-1, -1, 7, 7, 7, 7, 11, 11]
    assert chunk_attend_until(ScheduledChunk(sequence, 10, 4)) == [11, 11, -1, -1]
    assert chunk_attend_until(ScheduledChunk(sequence, 30, 1)) == [-1]  # a decode
