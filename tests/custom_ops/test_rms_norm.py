"""autodeploy::rms_norm against float64 math and HF's Llama and Gemma RMSNorm modules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

rms_norm = torch.ops.autodeploy.rms_norm


@settings(max_examples=25, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    hidden=st.integers(1, 16),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    weight_offset=st.sampled_from([0.0, 1.0, -0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rms_norm_matches_float64_math(leading, hidden, eps, weight_offset, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=gen, dtype=torch.float64) * 3
    weight = torch.randn(hidden, generator=gen, dtype=torch.float64)

    mean_square = (x * x).sum(-1, keepdim=True) / hidden
    expected = x / torch.sqrt(mean_square + eps) * (weight + weight_offset)
    torch.testing.assert_close(rms_norm(x, weight, eps, weight_offset), expected, rtol=1e-12, atol=1e-12)


def test_rms_norm_computes_in_float32_and_returns_the_input_dtype():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=gen) * 10).to(torch.bfloat16)
    weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, (y * weight.float()).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_agrees_with_hf_llama_and_gemma(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, generator=gen).to(dtype)
    weight = torch.randn(32, generator=gen)

    llama = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    gemma = GemmaRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.copy_(weight)
        gemma.weight.copy_(weight)
        # Llama rounds to the input dtype before the weight multiply; we round once, after it.
        tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(rms_norm(x, llama.weight, 1e-5), llama(x), **tolerance)
        torch.testing.assert_close(rms_norm(x, gemma.weight, 1e-6, 1.0), gemma(x), **tolerance)


def test_rms_norm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"weight must be \[H=8\]"):
        rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6)
