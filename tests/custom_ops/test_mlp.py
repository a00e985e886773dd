"""autodeploy::mlp against per-token float64 sums and HF's PhiMLP."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PhiConfig
from transformers.models.phi.modeling_phi import PhiMLP

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from tests.custom_ops.activation_formulas import ACTIVATION_FORMULAS

mlp = torch.ops.autodeploy.mlp


@settings(max_examples=25, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    hidden=st.integers(1, 8),
    inner=st.integers(1, 10),
    with_up_bias=st.booleans(),
    with_down_bias=st.booleans(),
    activation=st.sampled_from(sorted(ACTIVATION_FORMULAS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_mlp_matches_per_token_sums(leading, hidden, inner, with_up_bias, with_down_bias, activation, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=gen, dtype=torch.float64)
    up = torch.randn(inner, hidden, generator=gen, dtype=torch.float64)
    down = torch.randn(hidden, inner, generator=gen, dtype=torch.float64)
    up_bias = torch.randn(inner, generator=gen, dtype=torch.float64) if with_up_bias else None
    down_bias = torch.randn(hidden, generator=gen, dtype=torch.float64) if with_down_bias else None
    act = ACTIVATION_FORMULAS[activation]

    def per_token(token):
        pre_activation = (up * token).sum(-1) + (up_bias if up_bias is not None else 0)
        return (down * act(pre_activation)).sum(-1) + (down_bias if down_bias is not None else 0)

    expected = torch.stack([per_token(token) for token in x.reshape(-1, hidden)]).reshape(x.shape)
    out = mlp(x, up, up_bias, down, down_bias, activation)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("activation", "hf_activation"), [("gelu_tanh", "gelu_new"), ("gelu", "gelu"), ("relu", "relu")]
)
def test_mlp_agrees_with_hf_phi_mlp(activation, hf_activation):
    torch.manual_seed(0)
    block = PhiMLP(PhiConfig(hidden_size=16, intermediate_size=40, hidden_act=hf_activation)).eval()
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        expected = block(x)
    out = mlp(x, block.fc1.weight, block.fc1.bias, block.fc2.weight, block.fc2.bias, activation)
    torch.testing.assert_close(out, expected)


def test_mlp_returns_the_input_dtype():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen).to(torch.float16)
    up, down = torch.randn(24, 16, generator=gen).half(), torch.randn(16, 24, generator=gen).half()
    out = mlp(x, up, None, down, None, "relu")
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, mlp(x.double(), up.double(), None, down.double(), None, "relu").half())


def test_mlp_rejects_unknown_activation_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown activation 'tanh'; allowed: 'silu', 'gelu_tanh', 'gelu', 'relu'"):
        mlp(torch.randn(2, 4), torch.randn(6, 4), None, torch.randn(4, 6), None, "tanh")


def test_mlp_rejects_a_bias_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"up_bias \(5,\)"):
        mlp(torch.randn(2, 4), torch.randn(6, 4), torch.randn(5), torch.randn(4, 6), None, "relu")
