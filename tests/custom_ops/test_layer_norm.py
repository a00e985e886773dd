"""autodeploy::layer_norm against float64 mean/variance math."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

layer_norm = torch.ops.autodeploy.layer_norm


@settings(max_examples=25, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    hidden=st.integers(1, 16),
    with_weight=st.booleans(),
    with_bias=st.booleans(),
    eps=st.sampled_from([1e-5, 1e-2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_layer_norm_matches_float64_math(leading, hidden, with_weight, with_bias, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=gen, dtype=torch.float64) * 2 + 1
    weight = torch.randn(hidden, generator=gen, dtype=torch.float64) if with_weight else None
    bias = torch.randn(hidden, generator=gen, dtype=torch.float64) if with_bias else None

    mean = x.sum(-1, keepdim=True) / hidden
    variance = ((x - mean) ** 2).sum(-1, keepdim=True) / hidden  # biased, as LayerNorm uses
    expected = (x - mean) / torch.sqrt(variance + eps)
    if weight is not None:
        expected = expected * weight
    if bias is not None:
        expected = expected + bias
    torch.testing.assert_close(layer_norm(x, weight, bias, eps), expected, rtol=1e-10, atol=1e-10)


def test_layer_norm_equals_float32_layer_norm_rounded_to_the_input_dtype():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=gen) * 10 + 5).to(torch.float16)
    weight = torch.randn(64, generator=gen).to(torch.float16)
    bias = torch.randn(64, generator=gen).to(torch.float16)
    out = layer_norm(x, weight, bias, 1e-5)
    assert out.dtype == torch.float16
    expected = torch.nn.functional.layer_norm(x.float(), (64,), weight.float(), bias.float(), 1e-5)
    torch.testing.assert_close(out, expected.to(torch.float16), rtol=0, atol=0)


def test_layer_norm_rejects_a_bias_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"bias must be \[H=8\]"):
        layer_norm(torch.randn(2, 8), None, torch.randn(7), 1e-5)
