"""``bidirectional_attention``: the reference against plain softmax attention, its ``sdpa`` backend against the
reference (GQA included, queries and keys as many or not), and the match stage turning an encoder's mask-free SDPA into it."""

from __future__ import annotations

import math

import pytest
import torch

from autodeploy.custom_ops.bidirectional_attention import bidirectional_attention_reference, bidirectional_attention_sdpa


def naive(q, k, v, scale):
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
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


def test_a_vision_towers_attention_is_matched_and_selected(tmp_path):
    from autodeploy import autodeploy
    from autodeploy.pipeline import op_histogram
    from tests.tiny_vision_models import write_tiny_llava

    write_tiny_llava(tmp_path, "siglip")
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=64)
    ops = op_histogram(llm.deployment.graphs["vision"])
    assert ops.get("autodeploy.bidirectional_attention_sdpa") == 2 and "aten.scaled_dot_product_attention" not in ops
    assert llm.verification.vision_relative_error <= 1e-4
