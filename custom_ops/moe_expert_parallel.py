"""``torch.ops.autodeploy.moe_expert_parallel``: ``moe`` with its experts placed over the ranks of this process's
stage (``transforms/shard_expert_parallel.py``; ``parallel_state.stage_group()``), each token sent to the ranks
of its experts with all-to-all.

Every rank holds the same ``x`` and ``router_logits`` (the layers before are replicated, or all-reduced) and
``E / N`` experts: slot ``s`` of the placement ``expert_order`` holds expert ``expert_order[s]``, and rank ``r``
holds slots ``r·E/N … (r+1)·E/N`` (its ``gate_up_weight`` / ``down_weight``, stacked in that order). A call:

1. rank ``r`` takes its share of the tokens, rows ``T·r//N … T·(r+1)//N`` (uneven when ``N`` does not divide
   ``T``, empty when ``T < N``), and routes them as ``moe`` does (``moe.route``);
2. it sends each (token, chosen expert) pair, the token's row and the expert's local index, to the expert's
   rank: ``all_to_all_single`` of the pair counts first, then of the rows and indices (a rank may get none);
3. each rank runs its experts on the rows it received, in float32 (``compute_dtype``), and sends the results
   back the same way;
4. each rank adds its tokens' results weighted by their routing weights (float32, rounded once) and
   ``all_gather`` puts the ranks' shares together: every rank returns the same ``[T, H]``, bit for bit.

The routing weights never travel: the rank that routed a token applies them. With no process group, or one
rank, it computes ``moe`` over the experts in ``expert_order``'s order. Not capturable in a CUDA graph (the
counts are read on the host to size the exchange).

Quantized experts (``quantize.experts``): ``moe_expert_parallel_int8_wo`` / ``_int4_wo`` in ``quantized_moe.py``.

    out = moe_expert_parallel(x, router_logits, gate_up[order], down[order], order, top_k=2)  # == moe(x, …, gate_up, down, 2)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import parallel_state
from .activations import activation_fn
from .collectives import world_size
from .compute_dtype import compute_dtype
from .moe import route
from .registry import register_op


def _stage_rank() -> int:
    layout = parallel_state.layout()
    return layout.stage_rank if layout.world_size > 1 else dist.get_rank()


def _exchange(tensor: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
    """Rows ``send[0]`` to rank 0, the next ``send[1]`` to rank 1, …; returns the ``receive[r]`` rows from each rank r."""
    out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=parallel_state.stage_group())
    return out


def _run_experts(rows: torch.Tensor, local_expert: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                 activation: str, dtype: torch.dtype) -> torch.Tensor:
    """Row ``i``'s output of local expert ``local_expert[i]``, ``[R, H]`` in ``dtype``, as ``moe``'s reference computes it."""
    act = activation_fn(activation)
    out = rows.new_zeros((rows.shape[0], down_weight.shape[1]), dtype=dtype)
    for expert in range(gate_up_weight.shape[0]):
        index = torch.where(local_expert == expert)[0]
        if index.numel() == 0:
            continue
        gate, up = F.linear(rows[index].to(dtype), gate_up_weight[expert].to(dtype)).chunk(2, dim=-1)
        out[index] = F.linear(act(gate) * up, down_weight[expert].to(dtype))
    return out


def moe_expert_parallel_reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    expert_order: list[int],
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    activation: str = "silu",
) -> torch.Tensor:
    """``moe(x, router_logits, …, top_k, scoring, renormalize, activation)`` over experts placed on the stage's
    ranks (see the module docstring): ``x[T, H]``, ``router_logits[T, E]`` alike on every rank; this rank's
    ``gate_up_weight[E/N, 2I, H]`` and ``down_weight[E/N, H, I]`` are experts ``expert_order[r·E/N : (r+1)·E/N]``.
    Returns ``[T, H]`` in ``x``'s dtype, the same on every rank."""
    ranks = world_size()
    rank = _stage_rank() if ranks > 1 else 0
    tokens, hidden = x.shape
    experts, local = router_logits.shape[-1], gate_up_weight.shape[0]
    if local * ranks != experts or sorted(expert_order) != list(range(experts)):
        raise ValueError(f"moe_expert_parallel: {ranks} ranks of {local} experts each must hold the {experts} experts of "
                         f"router_logits, and expert_order must be a permutation of them; got {list(expert_order)}")
    first, last = tokens * rank // ranks, tokens * (rank + 1) // ranks
    weights, chosen = route(router_logits[first:last], top_k, scoring, renormalize)  # [t, top_k]
    slot_of = torch.empty(experts, dtype=torch.long, device=x.device)
    slot_of[torch.tensor(expert_order, device=x.device)] = torch.arange(experts, device=x.device)
    slots = slot_of[chosen].flatten()  # (token, k) pairs, row-major: pair p is token p // top_k
    owner = slots // local
    pairs = torch.argsort(owner, stable=True)  # grouped by the rank that holds the expert
    token_of_pair = pairs // top_k
    dtype = compute_dtype(x.dtype)
    rows, local_expert = x[first:last][token_of_pair], slots[pairs] % local
    if ranks == 1:
        results = _run_experts(rows, local_expert, gate_up_weight, down_weight, activation, dtype)
    else:
        send = torch.bincount(owner, minlength=ranks)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=parallel_state.stage_group())
        send, receive = send.tolist(), receive.tolist()
        received = _exchange(rows, send, receive)
        computed = _run_experts(received, _exchange(local_expert, send, receive), gate_up_weight, down_weight, activation,
                                dtype)
        results = _exchange(computed, receive, send)  # back to the ranks that routed them, in ``pairs`` order
    weighted = results * weights.flatten()[pairs, None].to(dtype)
    mine = weighted.new_zeros((last - first, hidden)).index_add_(0, token_of_pair, weighted).to(x.dtype)
    if ranks == 1:
        return mine
    share = -(-tokens // ranks)  # all_gather takes equal shapes: each share padded to the largest
    padded = torch.cat([mine, mine.new_zeros((share - mine.shape[0], hidden))])
    gathered = [torch.empty_like(padded) for _ in range(ranks)]
    dist.all_gather(gathered, padded, group=parallel_state.stage_group())
    return torch.cat([part[: tokens * (r + 1) // ranks - tokens * r // ranks] for r, part in enumerate(gathered)])


def moe_expert_parallel_fake(x, router_logits, gate_up_weight, down_weight, expert_order, top_k, scoring="softmax",
                             renormalize=True, activation="silu"):
    return x.new_empty(x.shape)


moe_expert_parallel = register_op(
    "moe_expert_parallel",
    moe_expert_parallel_reference,
    moe_expert_parallel_fake,
    example_inputs=(torch.ones(3, 4), torch.zeros(3, 5), torch.ones(5, 12, 4), torch.ones(5, 4, 6), [4, 3, 2, 1, 0], 2),
    capturable=False,  # the pair counts are read on the host to size the exchange
)
