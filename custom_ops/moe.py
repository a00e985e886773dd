"""``torch.ops.autodeploy.moe``: a top-k routed mixture of gated experts (Mixtral, Qwen-MoE, DeepSeek-style scoring)."""

import torch
import torch.nn.functional as F

from .activations import activation_fn
from .compute_dtype import compute_dtype
from .registry import register_op

SCORINGS = ("softmax", "sigmoid")


def moe_reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    activation: str = "silu",
) -> torch.Tensor:
    """Route each token of ``x[T, H]`` to its ``top_k`` experts and sum their outputs, weighted.

    - scores: ``softmax`` (or ``sigmoid``) of ``router_logits[T, E]`` in float32 (float64 for float64 logits).
    - each token takes the ``top_k`` experts with the highest scores; their weights are the scores,
      divided by their sum when ``renormalize``.
    - expert ``e``: ``g, u = (x @ gate_up_weight[e].T).chunk(2, -1)`` (gate rows first, then up rows, of
      ``gate_up_weight[E, 2I, H]``); ``expert_e(x) = (act(g) * u) @ down_weight[e].T`` with ``down_weight[E, H, I]``.
    - ``out[t] = Σ_{e in top_k(t)} weight[t, e] · expert_e(x[t])``, ``[T, H]`` in ``x``'s dtype.

    ``activation`` is one of "silu", "gelu_tanh", "gelu" (erf), "relu".
    """
    act = activation_fn(activation)
    if scoring not in SCORINGS:
        raise ValueError(f"moe: unknown scoring {scoring!r}; allowed: {', '.join(map(repr, SCORINGS))}.")
    tokens, hidden = x.shape
    experts, double_inner, _ = gate_up_weight.shape
    if (
        router_logits.shape != (tokens, experts)
        or gate_up_weight.shape != (experts, double_inner, hidden)
        or double_inner % 2 != 0
        or down_weight.shape != (experts, hidden, double_inner // 2)
    ):
        raise ValueError(
            f"moe: expected x [T, H], router_logits [T, E], gate_up_weight [E, 2I, H], down_weight [E, H, I]; "
            f"got x {tuple(x.shape)}, router_logits {tuple(router_logits.shape)}, "
            f"gate_up_weight {tuple(gate_up_weight.shape)}, down_weight {tuple(down_weight.shape)}."
        )
    if not 1 <= top_k <= experts:
        raise ValueError(f"moe: top_k must be between 1 and the number of experts E={experts}; got {top_k}.")

    logits = router_logits.to(compute_dtype(router_logits.dtype))
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    weights, chosen = torch.topk(scores, top_k, dim=-1)  # [T, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)

    dtype = compute_dtype(x.dtype)
    x_up = x.to(dtype)
    out = torch.zeros(tokens, hidden, dtype=dtype, device=x.device)
    for expert in range(experts):
        token_index, slot = torch.where(chosen == expert)
        if token_index.numel() == 0:
            continue
        gate, up = F.linear(x_up[token_index], gate_up_weight[expert].to(dtype)).chunk(2, dim=-1)
        expert_out = F.linear(act(gate) * up, down_weight[expert].to(dtype))
        out.index_add_(0, token_index, expert_out * weights[token_index, slot, None].to(dtype))
    return out.to(x.dtype)


def moe_fake(
    x, router_logits, gate_up_weight, down_weight, top_k, scoring="softmax", renormalize=True, activation="silu"
):
    return x.new_empty(x.shape)


moe = register_op(
    "moe",
    moe_reference,
    moe_fake,
    example_inputs=(
        torch.ones(3, 4, dtype=torch.bfloat16),
        torch.zeros(3, 5),
        torch.ones(5, 12, 4),
        torch.ones(5, 4, 6),
        2,
    ),
)
