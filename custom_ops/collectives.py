"""The ops of a tensor-parallel deployment (``transforms/shard_tensor_parallel.py``), over the ranks of this
process's pipeline stage (``parallel_state``: the default process group when there is one stage; gloo on
CPUs, NCCL on GPUs); with no process group, or one rank, each computes what one rank holds.

- ``all_reduce(x)``: the sum over ranks. After each row-parallel block (attention's output projection, an
  MLP's down projection: each rank holds a slice of the inputs' columns, so each computes a partial
  product), and after the vocabulary-parallel embedding (each rank looks up only its rows);
- ``all_gather(x)``: the ranks' ``x`` side by side along the last dim, in rank order: the LM head's logits,
  each rank computing its slice of the vocabulary;
- ``embedding_rows(weight, input_ids, first)``: ``weight[input_ids − first]`` where ``input_ids`` falls in this
  rank's rows ``first … first + rows``, zeros elsewhere.
"""

import torch
import torch.distributed as dist

from . import parallel_state
from .registry import register_op


def world_size() -> int:
    """The ranks of this process's stage, 1 when there is no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    layout = parallel_state.layout()
    return layout.stage_size if layout.world_size > 1 else dist.get_world_size()


def all_reduce_reference(x: torch.Tensor) -> torch.Tensor:
    """``Σ_ranks x``, a new tensor of ``x``'s shape and dtype on every rank (sums in ``x``'s dtype, in the
    backend's order, the same bits on every rank)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if world_size() > 1:
        dist.all_reduce(out, group=parallel_state.stage_group())
    return out


def all_reduce_fake(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


all_reduce = register_op("all_reduce", all_reduce_reference, all_reduce_fake, example_inputs=(torch.ones(2, 4),))


def all_gather_reference(x: torch.Tensor) -> torch.Tensor:
    """``cat([x of rank 0, x of rank 1, …], dim=-1)`` on every rank."""
    ranks = world_size()
    if ranks == 1:
        return x.clone(memory_format=torch.contiguous_format)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(ranks)]
    dist.all_gather(parts, x.contiguous(), group=parallel_state.stage_group())
    return torch.cat(parts, dim=-1)


def all_gather_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world_size()))


all_gather = register_op("all_gather", all_gather_reference, all_gather_fake, example_inputs=(torch.ones(2, 4),))


def embedding_rows_reference(weight: torch.Tensor, input_ids: torch.Tensor, first: int) -> torch.Tensor:
    """``[..., H]`` in ``weight``'s dtype: row ``input_ids − first`` of ``weight [rows, H]`` for the ids in
    ``first … first + rows − 1``, zeros for the others."""
    local = input_ids - first
    mine = (local >= 0) & (local < weight.shape[0])
    rows = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return rows * mine.unsqueeze(-1).to(weight.dtype)


def embedding_rows_fake(weight, input_ids, first):
    return weight.new_empty((*input_ids.shape, weight.shape[1]))


embedding_rows = register_op("embedding_rows", embedding_rows_reference, embedding_rows_fake,
                             example_inputs=(torch.ones(4, 3), torch.tensor([[0, 5, 2]]), 1))
