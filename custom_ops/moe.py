"""``torch.ops.autodeploy.moe``: a top-k routed mixture of gated experts (Mixtral, Qwen-MoE, DeepSeek-style scoring)."""

import torch
import torch.nn.functional as F

from .activations import activation_fn
from .compute_dtype import compute_dtype
from .registry import register_backend, register_op

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

    weights, chosen = route(router_logits, top_k, scoring, renormalize)
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


def route(
    router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, chosen)``, both ``[T, top_k]``: each token's experts and their weights, in float32
    (float64 for float64 logits). The reference and every backend route through this one function.

    Example::

        weights, chosen = route(torch.tensor([[0.0, 2.0, 1.0]]), 2, "softmax", True)
        # chosen == [[1, 2]], weights ≈ [[0.731, 0.269]]
    """
    if scoring not in SCORINGS:
        raise ValueError(f"moe: unknown scoring {scoring!r}; allowed: {', '.join(map(repr, SCORINGS))}.")
    logits = router_logits.to(compute_dtype(router_logits.dtype))
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    weights, chosen = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


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
    capturable=False,  # skips experts nobody chose: a host read of each expert's token count
)


def moe_torch(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    activation: str = "silu",
) -> torch.Tensor:
    """``moe`` with two grouped GEMMs over all experts at once, in ``x``'s dtype; same arguments and result
    as the reference.

    The ``T · top_k`` (token, slot) pairs are sorted by expert, so expert ``e`` owns rows
    ``offsets[e-1]:offsets[e]`` of the gathered tokens (an expert nobody chose owns none); each
    ``torch._grouped_mm`` multiplies every group by its own expert's weights. The outputs, scaled by their
    routing weights, are added back to their tokens. No Python loop over experts, no host sync. Router logits are
    scored in float32, like the reference; the GEMMs and the activation run in ``x``'s dtype.
    """
    act = activation_fn(activation)
    weights, chosen = route(router_logits, top_k, scoring, renormalize)
    experts_sorted, order = chosen.flatten().sort(stable=True)
    experts = torch.arange(gate_up_weight.shape[0], device=x.device)
    offsets = torch.searchsorted(experts_sorted, experts, right=True, out_int32=True)  # end row of each group
    token_of_row = order // top_k
    gate, up = torch._grouped_mm(x[token_of_row], gate_up_weight.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    expert_out = torch._grouped_mm(act(gate) * up, down_weight.transpose(-2, -1), offs=offsets)
    # The top_k sum is a reduction: accumulate it in the routing weights' float32, round once.
    weighted = expert_out * weights.flatten()[order, None]
    return weighted.new_zeros(x.shape).index_add_(0, token_of_row, weighted).to(x.dtype)


def _moe_torch_supports(x, router_logits, gate_up_weight, down_weight, top_k, scoring="softmax", renormalize=True,
                        activation="silu", *, device):
    if not hasattr(torch, "_grouped_mm"):
        return f"torch._grouped_mm is missing from torch {torch.__version__}"
    if not x.dtype == gate_up_weight.dtype == down_weight.dtype:
        return f"expert weight dtypes {gate_up_weight.dtype}, {down_weight.dtype} differ from x's {x.dtype}"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm takes float32, bfloat16 or float16, not {x.dtype}"
    # Other dtypes, and GPUs other than sm90/sm100, send CUDA's torch._grouped_mm to a loop over experts
    # with a host sync (offs.cpu()), which also breaks CUDA graph capture.
    if torch.device(device).type == "cuda" and x.dtype != torch.bfloat16:
        return f"torch._grouped_mm's grouped kernel on CUDA takes bfloat16, not {x.dtype}"
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return "torch._grouped_mm's grouped kernel needs a Hopper or Blackwell GPU (sm90/sm100)"
    # Its operands' strides must be multiples of 16 bytes: the hidden and inner sizes, and the weights' layout.
    alignment = 16 // x.element_size()
    if x.shape[-1] % alignment or down_weight.shape[-1] % alignment:
        return f"torch._grouped_mm needs hidden and inner sizes that are multiples of {alignment} in {x.dtype}"
    if any(s != 1 and s % alignment for w in (gate_up_weight, down_weight) for s in w.stride()):
        return "torch._grouped_mm needs expert weights whose strides are multiples of 16 bytes"
    return True


register_backend("moe", "torch", moe_torch, supports=_moe_torch_supports)
