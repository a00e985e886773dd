"""autodeploy::gated_mlp against per-token float64 sums and HF's LlamaMLP."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from tests.custom_ops.activation_formulas import ACTIVATION_FORMULAS

gated_mlp = torch.ops.autodeploy.gated_mlp


@settings(max_examples=25, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    hidden=st.integers(1, 8),
    inner=st.integers(1, 10),
    activation=st.sampled_from(sorted(ACTIVATION_FORMULAS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_gated_mlp_matches_per_token_sums(leading, hidden, inner, activation, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=gen, dtype=torch.float64)
    gate = torch.randn(inner, hidden, generator=gen, dtype=torch.float64)
    up = torch.randn(inner, hidden, generator=gen, dtype=torch.float64)
    down = torch.randn(hidden, inner, generator=gen, dtype=torch.float64)
    act = ACTIVATION_FORMULAS[activation]

    tokens = x.reshape(-1, hidden)
    expected = torch.stack(
        [(down * (act((gate * token).sum(-1)) * (up * token).sum(-1))).sum(-1) for token in tokens]
    ).reshape(x.shape)
    torch.testing.assert_close(gated_mlp(x, gate, up, down, activation), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("activation", "hf_activation"),
    [("silu", "silu"), ("gelu_tanh", "gelu_pytorch_tanh"), ("gelu", "gelu"), ("relu", "relu")],
)
def test_gated_mlp_agrees_with_hf_llama_mlp(activation, hf_activation):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=4, hidden_act=hf_activation)
    block = LlamaMLP(config).eval()
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        expected = block(x)
    out = gated_mlp(x, block.gate_proj.weight, block.up_proj.weight, block.down_proj.weight, activation)
    torch.testing.assert_close(out, expected)


def test_gated_mlp_returns_the_input_dtype():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen).to(torch.bfloat16)
    gate, up = (torch.randn(24, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    down = torch.randn(16, 24, generator=gen).to(torch.bfloat16)
    out = gated_mlp(x, gate, up, down, "silu")
    assert out.dtype == torch.bfloat16
    expected = gated_mlp(x.double(), gate.double(), up.double(), down.double(), "silu")
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=2e-2, atol=2e-2)


def test_gated_mlp_rejects_unknown_activation_naming_the_allowed_ones():
    x, weight = torch.randn(2, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match="unknown activation 'swish'; allowed: 'silu', 'gelu_tanh', 'gelu', 'relu'"):
        gated_mlp(x, weight, weight, weight, "swish")


def test_gated_mlp_rejects_mismatched_weights():
    with pytest.raises(ValueError, match=r"expected gate/up \[I, H=4\] and down \[H, I\]"):
        gated_mlp(torch.randn(2, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 5), "silu")
