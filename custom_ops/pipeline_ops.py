"""The ops of a pipeline-parallel deployment (``transforms/shard_pipeline_parallel.py``): activations and
logits moving between the stages, point to point, over the default process group (gloo on CPUs, NCCL on
GPUs). Ranks are the default group's (``parallel_state.layout().pipeline_peer(stage)``).

- ``pipeline_send(x, dst)``: send ``x`` to rank ``dst``. It returns nothing, so it is registered as a
  side effect (``torch.fx.node.has_side_effect``): dead-code elimination keeps it.
- ``pipeline_recv(like, width, dtype, src, deferrable)``: a new ``[*like.shape, width]`` tensor of
  ``dtype`` received from rank ``src``; ``like`` gives only the leading (token) dims and the device, its
  values are not read. ``deferrable``: the receive may complete after the op returns, inside
  :func:`async_transfers` (only for a tensor nothing in the graph reads: a stage's logits).

By default both block: a graph call returns with its transfers done. Inside :func:`async_transfers` (the
runtime's GPipe schedule, ``runtime/pipeline_schedule.py``) sends are ``isend`` and deferrable receives
``irecv``: each graph call (a micro-batch) leaves its transfers in flight and the schedule waits for them.

A rank that sends to itself (one process, no group: every rank is 0) keeps the tensor in a queue that its
next receive from itself takes, so a stage's graph runs in one process too::

    import torch, autodeploy.custom_ops
    ops = torch.ops.autodeploy
    ops.pipeline_send(torch.ones(1, 3, 8), 0)
    ops.pipeline_recv(torch.zeros(1, 3, dtype=torch.long), 8, torch.float32, 0, False)  # the ones back
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect

from .registry import register_op

_loopback: deque[torch.Tensor] = deque()  # what this rank sent to itself, oldest first


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class AsyncTransfers:
    """The transfers left in flight by the graph calls inside :func:`async_transfers`, one list a micro-batch."""

    def __init__(self) -> None:
        self.micro_batches: list[list[tuple[dist.Work, torch.Tensor]]] = []
        self._waited = 0  # micro-batches whose transfers are done

    def begin_micro_batch(self) -> None:
        self.micro_batches.append([])

    def add(self, work, tensor: torch.Tensor) -> None:
        # The tensor stays referenced until its transfer is done: its memory must not be reused before.
        if not self.micro_batches:
            self.begin_micro_batch()
        self.micro_batches[-1].append((work, tensor))

    def wait(self, through: int | None = None) -> None:
        """Wait for the transfers of micro-batches ``0 … through`` (all when ``None``)."""
        last = len(self.micro_batches) - 1 if through is None else min(through, len(self.micro_batches) - 1)
        while self._waited <= last:
            for work, _ in self.micro_batches[self._waited]:
                work.wait()
            self.micro_batches[self._waited] = []
            self._waited += 1


_async: AsyncTransfers | None = None


@contextlib.contextmanager
def async_transfers() -> Iterator[AsyncTransfers]:
    """Within: sends and deferrable receives are asynchronous; all are waited for on leaving (an error
    inside leaves them to the process group's timeout)."""
    global _async
    if _async is not None:
        raise RuntimeError("async_transfers() does not nest")
    _async = transfers = AsyncTransfers()
    try:
        yield transfers
        transfers.wait()
    finally:
        _async = None


def pipeline_send_reference(x: torch.Tensor, dst: int) -> None:
    """Send ``x`` to rank ``dst`` (blocking; ``isend`` inside :func:`async_transfers`)."""
    x = x.contiguous()
    if dst == _rank():
        _loopback.append(x.clone())
    elif _async is not None:
        _async.add(dist.isend(x, dst), x)
    else:
        dist.send(x, dst)


def pipeline_send_fake(x, dst):
    return None


def pipeline_recv_reference(like: torch.Tensor, width: int, dtype: torch.dtype, src: int, deferrable: bool) -> torch.Tensor:
    """A new ``[*like.shape, width]`` tensor of ``dtype`` on ``like``'s device, received from rank ``src``."""
    shape = (*like.shape, width)
    if src == _rank():
        if not _loopback:
            raise RuntimeError(f"pipeline_recv from rank {src} (this rank) but nothing was sent to it")
        sent = _loopback.popleft()
        if tuple(sent.shape) != shape or sent.dtype != dtype:
            raise RuntimeError(f"pipeline_recv expected {shape} {dtype}, this rank sent itself {tuple(sent.shape)} {sent.dtype}")
        return sent.to(like.device)
    out = torch.empty(shape, dtype=dtype, device=like.device)
    if deferrable and _async is not None:
        _async.add(dist.irecv(out, src), out)
    else:
        dist.recv(out, src)
    return out


def pipeline_recv_fake(like, width, dtype, src, deferrable):
    return like.new_empty((*like.shape, width), dtype=dtype)


# Registered in this order: the registry runs each reference on its example, and the send's feeds the receive's.
pipeline_send = register_op("pipeline_send", pipeline_send_reference, pipeline_send_fake,
                            example_inputs=(torch.ones(1, 2, 4), 0))
pipeline_recv = register_op("pipeline_recv", pipeline_recv_reference, pipeline_recv_fake,
                            example_inputs=(torch.zeros(1, 2, dtype=torch.long), 4, torch.float32, 0, False))
has_side_effect(torch.ops.autodeploy.pipeline_send.default)
