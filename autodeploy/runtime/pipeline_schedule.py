"""One engine step of a pipeline-parallel deployment (``distributed.pipeline_parallel`` > 1), in micro-batches.

Every rank runs the same engine and stages the same chunks; its graph is one pipeline stage
(``transforms/shard_pipeline_parallel.py``): it receives the residual stream from the stage before,
computes its layers, sends to the stage after, and ends with the logits (computed on the last stage,
received from it on the others). :class:`PipelineSchedule` cuts a step's chunks into
``distributed.pipeline_micro_batches`` contiguous micro-batches of about equal token counts (each keeps
the scheduler's order, prompt chunks before decodes), stages each one's inputs, and runs them:

- ``async`` (GPipe): each rank calls its graph for micro-batch 0, 1, … without waiting for its sends
  (``isend``) or for the logits (``irecv``, ``pipeline_ops.async_transfers``), so stage ``s`` computes
  micro-batch ``m + 1`` while stage ``s + 1`` computes ``m``; receiving the residual stream is what
  paces a stage. At most ``pipeline_depth`` micro-batches are in flight (a rank waits for micro-batch
  ``m − depth``'s transfers, its logits included, before starting ``m``); all transfers are waited for at
  the end of the step, and the logits of every micro-batch are then on every rank.
- ``sync``: one micro-batch through the whole pipe at a time (blocking sends; each graph call returns
  with its logits).

The logits rows come out in the chunks' order either way, so sampling is unchanged. A step of one chunk,
or ``pipeline_micro_batches: 1``, is one graph call.

    schedule = PipelineSchedule(micro_batches=2, overlapped=True)
    [len(group) for group in schedule.split(chunks)]   # e.g. [3, 5]: about half of the tokens each
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from autodeploy.custom_ops.pipeline_ops import async_transfers
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.scheduler import ScheduledChunk
from autodeploy.runtime.step_inputs import PendingTokens, SideInputSpec, build_step_inputs

logger = logging.getLogger(__name__)


@dataclass
class PipelineSchedule:
    micro_batches: int = 1
    overlapped: bool = True  # async (GPipe) rather than sync
    depth: int | None = None  # async: micro-batches in flight at most (None: all)

    @classmethod
    def from_settings(cls, settings) -> PipelineSchedule | None:
        """The schedule ``settings.distributed`` asks for; None without pipeline parallelism."""
        distributed = settings.distributed
        stages = int(distributed.pipeline_parallel)
        if stages == 1:
            return None
        schedule = cls(int(distributed.pipeline_micro_batches), distributed.pipeline_schedule == "async",
                       None if distributed.pipeline_depth is None else int(distributed.pipeline_depth))
        if schedule.micro_batches == 1:
            logger.info("pipeline_parallel=%d: one micro-batch a step, the stages take turns (nothing overlapped; "
                        "set distributed.pipeline_micro_batches ≥ %d to overlap them)", stages, stages)
        elif schedule.overlapped:
            logger.info("pipeline_parallel=%d: up to %d micro-batches a step, GPipe: stage s computes micro-batch m+1 while "
                        "stage s+1 computes m (sends and the logits' receives asynchronous, %s in flight, waited at the "
                        "step's end)", stages, schedule.micro_batches, schedule.depth or "all")
        else:
            logger.info("pipeline_parallel=%d: up to %d micro-batches a step, each through all stages before the next "
                        "(sync: nothing overlapped)", stages, schedule.micro_batches)
        return schedule

    def split(self, chunks: Sequence[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """Contiguous groups of the chunks, ``min(micro_batches, len(chunks))`` of them, of about equal token counts."""
        parts = min(self.micro_batches, len(chunks))
        before = [0, *accumulate(chunk.length for chunk in chunks)]  # before[i]: tokens of chunks[:i]
        bounds = [0]
        for k in range(1, parts):
            end = bounds[-1] + 1
            while end < len(chunks) - (parts - k) and before[end] < before[-1] * k / parts:
                end += 1
            bounds.append(end)
        bounds.append(len(chunks))
        return [list(chunks[a:b]) for a, b in zip(bounds, bounds[1:])]

    def stage_step(
        self, graph: Callable, input_names: Sequence[str], chunks: Sequence[ScheduledChunk], pool: KVBlockPool,
        caches: dict[str, torch.Tensor], device: torch.device, logits_for_all_tokens: bool = False,
        pending: PendingTokens | None = None, side_inputs: Sequence[SideInputSpec] = (),
    ) -> tuple[Callable[[], torch.Tensor], list[int]]:
        """Like ``ModelRunner.stage``: the micro-batches' inputs staged now, ``(run, completing)``; ``run()`` runs
        them through the pipeline and returns the step's logits ``[rows, vocab]``."""
        inputs: list[list[torch.Tensor]] = []
        completing: list[int] = []
        offset = 0
        for group in self.split(chunks):
            group_inputs, group_completing = build_step_inputs(
                input_names, group, pool, caches, device, logits_for_all_tokens=logits_for_all_tokens, pending=pending,
                side_inputs=side_inputs)
            inputs.append(group_inputs)
            completing += [offset + index for index in group_completing]
            offset += len(group)
        return (lambda: self.run(graph, inputs)), completing

    def run(self, graph: Callable, inputs: list[list[torch.Tensor]]) -> torch.Tensor:
        """Every micro-batch through this rank's stage; the logits of all of them, in order."""
        if len(inputs) == 1 or not self.overlapped:
            return torch.cat([graph(*micro_batch)[0] for micro_batch in inputs])
        logits = []
        with async_transfers() as transfers:
            for index, micro_batch in enumerate(inputs):
                if self.depth is not None and index >= self.depth:
                    transfers.wait(through=index - self.depth)
                transfers.begin_micro_batch()
                logits.append(graph(*micro_batch)[0])
        return torch.cat(logits)
