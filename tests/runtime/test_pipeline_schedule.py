"""How a pipeline-parallel step is cut into micro-batches: contiguous groups, in order, none empty, about
equal in tokens (``runtime/pipeline_schedule.py``). The schedules themselves run in
``tests/distributed/test_pipeline_parallel.py``."""

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from autodeploy.runtime.pipeline_schedule import PipelineSchedule


@dataclass
class _Chunk:
    length: int


@given(st.lists(st.integers(1, 64), min_size=1, max_size=20), st.integers(1, 8))
def test_micro_batches_are_contiguous_nonempty_groups_of_the_chunks(lengths, micro_batches):
    chunks = [_Chunk(n) for n in lengths]
    groups = PipelineSchedule(micro_batches).split(chunks)
    assert len(groups) == min(micro_batches, len(chunks))
    assert all(groups) and [c for group in groups for c in group] == chunks
    assert all(a is b for a, b in zip([c for group in groups for c in group], chunks))


def test_micro_batches_balance_tokens():
    assert [len(g) for g in PipelineSchedule(2).split([_Chunk(1)] * 8)] == [4, 4]
    assert [len(g) for g in PipelineSchedule(2).split([_Chunk(12), *[_Chunk(1)] * 12])] == [1, 12]
    assert [len(g) for g in PipelineSchedule(3).split([_Chunk(30), _Chunk(1), _Chunk(1)])] == [1, 1, 1]
