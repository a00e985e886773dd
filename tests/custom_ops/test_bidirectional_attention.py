"""``bidirectional_attention``: the reference against plain softmax attention, its ``sdpa`` backend against the
reference (GQA included, queries and keys as many or not, with and without an additive bias), and the match stage
turning an encoder's mask-free SDPA into it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy.custom_ops.bidirectional_attention import bidirectional_attention_reference, bidirectional_attention_sdpa


def naive(q, k, v, scale, bias=None):
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
    logits = logits if bias is None else logits + bias.double()
    return torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), v.double())


@pytest.mark.parametrize("q_heads, kv_heads, keys", [(4, 4, 7), (4, 2, 7), (6, 1, 7), (4, 4, 11), (4, 2, 3)])
def test_the_reference_and_the_sdpa_backend_attend_to_every_key(q_heads, kv_heads, keys):
    """Keys as many as the queries (an encoder's self-attention) or not (a decoder's cross-attention)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, q_heads, 8, generator=generator)
    k = torch.randn(2, keys, kv_heads, 8, generator=generator)
    v = torch.randn(2, keys, kv_heads, 5, generator=generator)
    scale = 1 / math.sqrt(8)
    expected = naive(q, k, v, scale)
    torch.testing.assert_close(bidirectional_attention_reference(q, k, v, scale).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bidirectional_attention_sdpa(q, k, v, scale).double(), expected, atol=1e-5, rtol=1e-5)
    # The last key moves every query's output: nothing is masked.
    k2 = k.clone()
    k2[:, -1] += 1
    assert not torch.allclose(bidirectional_attention_reference(q, k2, v, scale)[:, 0], bidirectional_attention_reference(q, k, v, scale)[:, 0])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    heads=st.sampled_from([(4, 4), (4, 2), (3, 1)]),
    queries=st.integers(1, 9),
    keys=st.integers(1, 9),
    bias_batch=st.sampled_from([1, 2]),
    bias_heads=st.sampled_from([1, None]),  # None: one row a query head
)
def test_a_bias_is_added_to_every_logit_by_the_reference_and_the_sdpa_backend(seed, heads, queries, keys, bias_batch, bias_heads):
    """T5's encoder: ``[1 or B, 1 or H, Sq, Sk]`` added to the logits before the softmax (here with T5's scale 1.0)."""
    generator = torch.Generator().manual_seed(seed)
    q_heads, kv_heads = heads
    q = torch.randn(2, queries, q_heads, 8, generator=generator)
    k = torch.randn(2, keys, kv_heads, 8, generator=generator)
    v = torch.randn(2, keys, kv_heads, 5, generator=generator)
    bias = torch.randn(bias_batch, bias_heads or q_heads, queries, keys, generator=generator) * 3
    expected = naive(q, k, v, 1.0, bias)
    torch.testing.assert_close(bidirectional_attention_reference(q, k, v, 1.0, bias).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bidirectional_attention_sdpa(q, k, v, 1.0, bias).double(), expected, atol=1e-5, rtol=1e-5)


def test_a_bias_of_another_shape_is_refused_and_sdpa_takes_the_queries_dtype_only():
    from autodeploy.custom_ops import canonical_ops

    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 5, 4, 8)
    with pytest.raises(ValueError, match=r"bias must be \[1 or B=1, 1 or H=4, Sq=3, Sk=5\]; got \(1, 4, 3, 3\)"):
        bidirectional_attention_reference(q, k, k, 1.0, torch.zeros(1, 4, 3, 3))
    sdpa = next(b for b in canonical_ops()["bidirectional_attention"].backends if b.name == "sdpa")
    meta = [t.to("meta") for t in (q, k, k)]
    assert sdpa.check([*meta, 1.0, torch.zeros(1, 4, 3, 5, device="meta")], torch.device("cpu")) is None
    assert sdpa.check([*meta, 1.0, torch.zeros(1, 4, 3, 5, dtype=torch.float64, device="meta")],
                      torch.device("cpu")) == "the bias is torch.float64, q torch.float32"


def test_a_vision_towers_attention_is_matched_and_selected(tmp_path):
    from autodeploy import autodeploy
    from autodeploy.pipeline import op_histogram
    from tests.tiny_vision_models import write_tiny_llava

    write_tiny_llava(tmp_path, "siglip")
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=64)
    ops = op_histogram(llm.deployment.graphs["vision"])
    assert ops.get("autodeploy.bidirectional_attention_sdpa") == 2 and "aten.scaled_dot_product_attention" not in ops
    assert llm.verification.vision_relative_error <= 1e-4
