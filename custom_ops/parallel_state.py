"""Where this process sits in a deployment over several ranks, and the process groups its collectives use.

The world is ``pipeline_parallel`` stages of ``stage_size = max(tensor_parallel, expert_parallel)`` ranks
each; rank ``r`` is rank ``r % stage_size`` of stage ``r // stage_size``. Inside a stage, the dense layers
are sliced over its ranks when ``tensor_parallel`` equals the stage size, and the MoE experts are placed
over them when ``expert_parallel`` does (each of the two is 1 or the stage size). Stages pass activations
to the next stage's rank of the same place (``pipeline_peer``).

:func:`configure` is called on every rank, in the same order, once the default process group is up
(``autodeploy/distributed.py``); before it, and in a single process, every rank is 0 of 1. The collectives
read this state and the default group when they run, so both belong to the process: it serves one
deployment over several ranks at a time (``autodeploy/distributed.py`` refuses a second one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

# How a linear layer lies over a stage's tensor-parallel ranks: the values of ``distributed.rules``, which the
# settings check when they load and transforms/shard_tensor_parallel.py applies.
RULE_KINDS = ("colwise", "rowwise", "replicate")


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    rank: int = 0  # in the default group

    @classmethod
    def requested(cls, distributed) -> Layout:
        """The layout that ``settings.distributed`` asks for, seen from rank 0."""
        return cls(int(distributed.tensor_parallel), int(distributed.expert_parallel), int(distributed.pipeline_parallel))

    @property
    def stage_size(self) -> int:
        return max(self.tensor_parallel, self.expert_parallel)

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pipeline_parallel

    @property
    def stage(self) -> int:
        return self.rank // self.stage_size

    @property
    def stage_rank(self) -> int:
        return self.rank % self.stage_size

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.stage_size, (stage + 1) * self.stage_size))

    def pipeline_peer(self, stage: int) -> int:
        """The default-group rank of this process's place in ``stage``."""
        return stage * self.stage_size + self.stage_rank


_layout = Layout()
_stage_group = None  # None: the default group (one stage), or no group at all


def configure(tensor_parallel: int, expert_parallel: int, pipeline_parallel: int) -> Layout:
    """Record this rank's layout and create the stage groups (every rank calls it with the same values)."""
    global _layout, _stage_group
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    _layout = Layout(tensor_parallel, expert_parallel, pipeline_parallel, rank)
    _stage_group = None
    if pipeline_parallel > 1:
        for stage in range(pipeline_parallel):  # new_group is collective: every rank creates every group
            group = dist.new_group(_layout.stage_ranks(stage))
            if stage == _layout.stage:
                _stage_group = group
    return _layout


def layout() -> Layout:
    return _layout


def stage_group():
    """The process group of this rank's stage (``None``: the default group)."""
    return _stage_group


def reset() -> None:
    """Back to one process (the process group was left)."""
    global _layout, _stage_group
    _layout, _stage_group = Layout(), None
