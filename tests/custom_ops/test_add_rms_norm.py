"""autodeploy::add_rms_norm: its reference is the unfused add + rms_norm bit for bit, its torch backend meets
the accuracy contract, and a residual of another shape or dtype is refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import canonical_ops

add_rms_norm, rms_norm = torch.ops.autodeploy.add_rms_norm, torch.ops.autodeploy.rms_norm
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
EXAMPLES = settings(max_examples=20, deadline=None, derandomize=True, database=None)


def randn(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@EXAMPLES
@given(
    leading=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    hidden=st.integers(1, 40),
    weight_offset=st.sampled_from([0.0, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_is_the_unfused_add_and_rms_norm_bit_for_bit(leading, hidden, weight_offset, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, residual = randn(gen, *leading, hidden, dtype=dtype, scale=3.0), randn(gen, *leading, hidden, dtype=dtype)
    weight = randn(gen, hidden, dtype=dtype)
    normed, total = add_rms_norm(x, residual, weight, 1e-6, weight_offset)
    unfused_sum = x + residual  # what the exported graph's aten add computes, in the model's dtype
    assert torch.equal(total, unfused_sum) and total.is_contiguous()
    assert torch.equal(normed, rms_norm(unfused_sum, weight, 1e-6, weight_offset))


def test_reference_agrees_with_hf_llamas_residual_stream_in_bfloat16():
    gen = torch.Generator().manual_seed(0)
    x, residual = randn(gen, 2, 3, 32, dtype=torch.bfloat16, scale=3.0), randn(gen, 2, 3, 32, dtype=torch.bfloat16)
    norm = LlamaRMSNorm(32, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(randn(gen, 32, dtype=torch.bfloat16))
        normed, total = add_rms_norm(x, residual, norm.weight, 1e-5)
        # Llama rounds the normalised sum before its weight multiply; the op rounds once, after it.
        torch.testing.assert_close(normed, norm(residual + x), rtol=2e-2, atol=2e-2)
    assert torch.equal(total, residual + x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, weight_offset", [((1, 40), 0.0), ((2, 5, 64), 1.0)])
def test_torch_backend_meets_the_contract(dtype, shape, weight_offset):
    gen = torch.Generator().manual_seed(1)
    x, residual = randn(gen, *shape, dtype=dtype, scale=3.0), randn(gen, *shape, dtype=dtype)
    weight = randn(gen, shape[-1], dtype=dtype, scale=0.1) + (0.0 if weight_offset else 1.0)
    normed, total = torch.ops.autodeploy.add_rms_norm_torch.default(x, residual, weight, 1e-6, weight_offset)
    expected_normed, expected_total = add_rms_norm(x, residual, weight, 1e-6, weight_offset)
    assert torch.equal(total, expected_total) and total.is_contiguous() and normed.is_contiguous()
    assert (normed.dtype, normed.shape) == (dtype, expected_normed.shape)
    error = ((normed.double() - expected_normed.double()).norm() / expected_normed.double().norm()).item()
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} in {dtype}"


def test_torch_backend_refuses_a_weight_in_another_dtype():
    torch_backend = next(b for b in canonical_ops()["add_rms_norm"].backends if b.name == "torch")
    x = torch.empty(2, 16, dtype=torch.bfloat16, device="meta")
    assert torch_backend.check((x, x, torch.empty(16, device="meta"), 1e-6), torch.device("cpu")) == (
        "weight dtype torch.float32 differs from x's torch.bfloat16"
    )
    assert torch_backend.check((x, x, x[0], 1e-6), torch.device("cpu")) is None


@pytest.mark.parametrize(
    "residual", [torch.randn(8), torch.randn(2, 8, dtype=torch.float64)], ids=["broadcast", "another dtype"]
)
def test_a_residual_unlike_x_is_refused(residual):
    with pytest.raises(ValueError, match="residual must have x's shape and dtype"):
        add_rms_norm(torch.randn(2, 8), residual, torch.ones(8), 1e-6)
