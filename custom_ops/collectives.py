"""``torch.ops.autodeploy.all_reduce``: the sum of a tensor over the ranks of a sharded deployment.

The ``shard`` stage (``transforms/shard_tensor_parallel.py``) puts one after each row-parallel projection
(attention's output projection, an MLP's down projection): each rank holds a slice of the inputs' columns,
so each computes a partial product and the sum over ranks is the unsharded result. The reference runs
``torch.distributed.all_reduce`` on the default process group (gloo on CPUs, NCCL on GPUs); with no
process group, or one rank, it returns a copy of its input.
"""

import torch
import torch.distributed as dist

from .registry import register_op


def world_size() -> int:
    """The ranks of the default process group, 1 when there is none."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_reference(x: torch.Tensor) -> torch.Tensor:
    """``Σ_ranks x``, a new tensor of ``x``'s shape and dtype on every rank (sums in ``x``'s dtype, in the
    backend's order, the same bits on every rank)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if world_size() > 1:
        dist.all_reduce(out)
    return out


def all_reduce_fake(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


all_reduce = register_op("all_reduce", all_reduce_reference, all_reduce_fake, example_inputs=(torch.ones(2, 4),))
