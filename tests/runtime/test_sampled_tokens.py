"""``plan_sampling``'s rows: each sample's step counter (the seeded draw's key) is its generated tokens, and only rows
with a penalty carry a copy of the output (a copy a row and step would make the host's work grow with the length)."""

from __future__ import annotations

from autodeploy.runtime.request import Request
from autodeploy.runtime.sampled_tokens import plan_sampling
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.scheduler import ScheduledChunk


def _decoding(params: SamplingParams, generated: list[int]) -> ScheduledChunk:
    request = Request("r", None, [5, 6, 7], params, set(), seed=1, priority=0, arrival_time=0.0)
    sequence = request.sequences[0]
    sequence.token_ids.extend(generated)
    sequence.num_computed = len(sequence.token_ids) - 1
    return ScheduledChunk(sequence, start=sequence.num_computed, length=1)


def test_rows_count_the_generated_tokens_and_copy_the_output_only_for_penalties():
    plain = plan_sampling([_decoding(SamplingParams(max_tokens=9), [8, 9, 10])], vocab_size=32)
    assert plain.rows[0].step == 3 and plain.rows[0].output_token_ids == []
    penalized = plan_sampling([_decoding(SamplingParams(max_tokens=9, presence_penalty=0.5), [8, 9, 10])], vocab_size=32)
    assert penalized.rows[0].step == 3 and penalized.rows[0].output_token_ids == [8, 9, 10]
    assert not penalized.overlappable and plain.overlappable
