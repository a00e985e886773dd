"""autodeploy::moe against per-token float64 routing and HF's Mixtral and Qwen3-MoE blocks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from tests.custom_ops.activation_formulas import ACTIVATION_FORMULAS

moe = torch.ops.autodeploy.moe


def moe_by_token(x, router_logits, gate_up, down, top_k, scoring, renormalize, activation):
    """Token by token: hand-written scores, experts ranked by a sort, each chosen expert's output summed."""
    act = ACTIVATION_FORMULAS[activation]
    inner = down.shape[-1]
    out = torch.zeros_like(x)
    for t, (token, logits) in enumerate(zip(x, router_logits)):
        if scoring == "softmax":
            scores = torch.exp(logits - logits.max()) / torch.exp(logits - logits.max()).sum()
        else:
            scores = 1 / (1 + torch.exp(-logits))
        chosen = torch.argsort(scores, descending=True)[:top_k].tolist()
        total = sum(scores[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            projected = (gate_up[e] * token).sum(-1)  # [2I]: gate rows, then up rows
            gated = act(projected[:inner]) * projected[inner:]
            out[t] += scores[e] / total * (down[e] * gated).sum(-1)
    return out


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 6),
    hidden=st.integers(1, 6),
    inner=st.integers(1, 5),
    experts=st.integers(1, 5),
    top_k_fraction=st.floats(0.0, 1.0),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    activation=st.sampled_from(sorted(ACTIVATION_FORMULAS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_moe_matches_per_token_routing(
    tokens, hidden, inner, experts, top_k_fraction, scoring, renormalize, activation, seed
):
    gen = torch.Generator().manual_seed(seed)
    top_k = max(1, round(top_k_fraction * experts))
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    router_logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float64) * 2
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=gen, dtype=torch.float64)
    down = torch.randn(experts, hidden, inner, generator=gen, dtype=torch.float64)

    out = moe(x, router_logits, gate_up, down, top_k, scoring, renormalize, activation)
    expected = moe_by_token(x, router_logits, gate_up, down, top_k, scoring, renormalize, activation)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_moe_agrees_with_hf_mixtral():
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.5)
        x = torch.randn(2, 5, 16)
        expected = block(x)
        router_logits = block.gate(x.reshape(-1, 16))[0]
    out = moe(x.reshape(-1, 16), router_logits, block.experts.gate_up_proj, block.experts.down_proj, 2)
    torch.testing.assert_close(out.reshape(2, 5, 16), expected)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_agrees_with_hf_qwen3_moe(norm_topk_prob):
    torch.manual_seed(1)
    config = Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.5)
        x = torch.randn(7, 16)
        expected = block(x[None])[0]
        router_logits = block.gate(x)[0]
    out = moe(x, router_logits, block.experts.gate_up_proj, block.experts.down_proj, 3, "softmax", norm_topk_prob)
    torch.testing.assert_close(out, expected)


def test_moe_returns_the_input_dtype():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
    router_logits = torch.randn(4, 3, generator=gen).to(torch.bfloat16)
    gate_up = torch.randn(3, 12, 8, generator=gen).to(torch.bfloat16)
    down = torch.randn(3, 8, 6, generator=gen).to(torch.bfloat16)
    out = moe(x, router_logits, gate_up, down, 2)
    assert out.dtype == torch.bfloat16
    doubles = (t.double() for t in (x, router_logits, gate_up, down))
    expected = moe_by_token(*doubles, 2, "softmax", True, "silu")
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 0}, "top_k must be between 1 and the number of experts E=3; got 0"),
        ({"top_k": 4}, "top_k must be between 1 and the number of experts E=3; got 4"),
        ({"scoring": "softplus"}, "unknown scoring 'softplus'; allowed: 'softmax', 'sigmoid'"),
        ({"activation": "gelu_new"}, "unknown activation 'gelu_new'; allowed: 'silu', 'gelu_tanh', 'gelu', 'relu'"),
        ({"down_weight": torch.zeros(3, 4, 5)}, r"down_weight \[E, H, I\]"),
        ({"router_logits": torch.zeros(2, 4)}, r"router_logits \[T, E\]"),
    ],
)
def test_moe_rejects_inconsistent_arguments(kwargs, message):
    arguments = {
        "x": torch.zeros(2, 4),
        "router_logits": torch.zeros(2, 3),
        "gate_up_weight": torch.zeros(3, 12, 4),
        "down_weight": torch.zeros(3, 4, 6),
        "top_k": 2,
    }
    with pytest.raises(ValueError, match=message):
        moe(**(arguments | kwargs))
