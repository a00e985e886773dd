"""autodeploy::linear against an element-wise float64 dot product."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

linear = torch.ops.autodeploy.linear


@settings(max_examples=25, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    in_features=st.integers(1, 9),
    out_features=st.integers(1, 9),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_matches_explicit_dot_products(leading, in_features, out_features, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, in_features, generator=gen, dtype=torch.float64)
    weight = torch.randn(out_features, in_features, generator=gen, dtype=torch.float64)
    bias = torch.randn(out_features, generator=gen, dtype=torch.float64) if with_bias else None

    expected = (x.unsqueeze(-2) * weight).sum(-1)  # out[..., n] = Σ_k x[..., k] w[n, k]
    if bias is not None:
        expected = expected + bias
    torch.testing.assert_close(linear(x, weight, bias), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_returns_the_input_dtype(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=gen).to(dtype)
    weight = torch.randn(8, 16, generator=gen).to(dtype)
    bias = torch.randn(8, generator=gen).to(dtype)
    out = linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (4, 8)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out, expected.to(dtype))


def test_linear_rejects_mismatched_weight():
    with pytest.raises(ValueError, match=r"weight must be \[N, K=4\]"):
        linear(torch.randn(2, 4), torch.randn(3, 5), None)
