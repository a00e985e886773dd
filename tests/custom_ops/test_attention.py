"""autodeploy::attention against per-query float64 loops (its additive bias included), SDPA, and HF's Gemma-2 (soft-cap)
and gpt-oss (sinks)."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_attention
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_attention

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

attention = torch.ops.autodeploy.attention


def attention_by_query(q, k, v, scale, sliding_window=None, logit_cap=None, sinks=None, alibi_slopes=None, bias=None):
    """One query at a time: list the keys it may see, then a hand-written softmax over them (plus the sink)."""
    batch, seq, q_heads, _ = q.shape
    kv_heads = k.shape[2]
    out = torch.zeros(batch, seq, q_heads, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kv_head = h * kv_heads // q_heads  # = h // (Hq / Hkv), written the other way round
            for i in range(seq):
                first = 0 if sliding_window is None else max(0, i - sliding_window + 1)
                logits = (k[b, first : i + 1, kv_head] @ q[b, i, h]) * scale
                if alibi_slopes is not None:  # key j of query i: slope · (j - i)
                    logits = logits + alibi_slopes[h] * torch.arange(first - i, 1, dtype=logits.dtype)
                if bias is not None:  # [1 or B, 1 or H, S, S]
                    logits = logits + bias[b % bias.shape[0], h % bias.shape[1], i, first : i + 1]
                if logit_cap is not None:
                    logits = logit_cap * torch.tanh(logits / logit_cap)
                exps = torch.exp(logits)
                denominator = exps.sum() + (math.exp(sinks[h]) if sinks is not None else 0.0)
                out[b, i, h] = (exps[:, None] * v[b, first : i + 1, kv_head]).sum(0) / denominator
    return out


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 2),
    seq=st.integers(1, 7),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.integers(1, 8),
    value_dim=st.integers(1, 8),
    sliding_window=st.one_of(st.none(), st.integers(1, 9)),
    logit_cap=st.one_of(st.none(), st.floats(0.5, 30.0)),
    with_sinks=st.booleans(),
    with_alibi=st.booleans(),
    bias_shape=st.sampled_from([None, (1, 0), (0, 0), (1, 1)]),  # its batch and head dims: 1, or 0 for as many as q's
    seed=st.integers(0, 2**31 - 1),
)
def test_attention_matches_per_query_loops(
    batch, seq, kv_heads, group, head_dim, value_dim, sliding_window, logit_cap, with_sinks, with_alibi, bias_shape, seed
):
    gen = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * group
    q = torch.randn(batch, seq, q_heads, head_dim, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(batch, seq, kv_heads, value_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(q_heads, generator=gen, dtype=torch.float64) if with_sinks else None
    alibi_slopes = torch.rand(q_heads, generator=gen, dtype=torch.float64).tolist() if with_alibi else None
    bias = None
    if bias_shape is not None:
        bias = torch.randn(bias_shape[0] or batch, bias_shape[1] or q_heads, seq, seq, generator=gen, dtype=torch.float64)
    scale = head_dim**-0.5

    out = attention(q, k, v, scale, sliding_window, logit_cap, sinks, alibi_slopes, bias)
    expected = attention_by_query(q, k, v, scale, sliding_window, logit_cap, sinks, alibi_slopes, bias)
    assert out.shape == (batch, seq, q_heads, value_dim)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(seq=st.integers(1, 6), window_beyond=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_a_window_of_at_least_the_sequence_is_no_window(seq, window_beyond, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, seq, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, 0.5, seq + window_beyond), attention(q, k, v, 0.5), rtol=0, atol=0)


def test_a_window_of_one_sees_only_itself():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 5, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 5, 2, 3, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(attention(q, k, v, 1.0, 1), v.repeat_interleave(2, dim=2))


def test_a_single_token_returns_its_value_scaled_down_by_the_sink():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(3, 1, 1, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 1, 1, 5, generator=gen, dtype=torch.float64)
    logit = (q * k).sum(-1, keepdim=True) * 0.3  # [B, 1, Hq, 1]
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0], dtype=torch.float64)

    torch.testing.assert_close(attention(q, k, v, 0.3), v.expand(3, 1, 4, 5))
    weight = torch.exp(logit) / (torch.exp(logit) + torch.exp(sinks)[:, None])
    torch.testing.assert_close(attention(q, k, v, 0.3, None, None, sinks), weight * v)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)])
def test_attention_agrees_with_sdpa_causal_gqa(q_heads, kv_heads):
    gen = torch.Generator().manual_seed(q_heads)
    q = torch.randn(2, 9, q_heads, 16, generator=gen)
    k = torch.randn(2, 9, kv_heads, 16, generator=gen)
    v = torch.randn(2, 9, kv_heads, 16, generator=gen)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.2, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(attention(q, k, v, 0.2), expected)


def _additive_mask(seq: int, sliding_window: int | None) -> torch.Tensor:
    """HF-style float mask: 0 where visible, -inf elsewhere, built from triangular matrices."""
    visible = torch.ones(seq, seq, dtype=torch.bool).tril()
    if sliding_window is not None:
        visible &= torch.ones(seq, seq, dtype=torch.bool).triu(-(sliding_window - 1))
    return torch.zeros(seq, seq).masked_fill(~visible, float("-inf"))[None, None]


def test_attention_agrees_with_hf_gemma2_soft_capping_and_window():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 16, generator=gen) * 4  # large logits, so the cap matters
    k = torch.randn(2, 8, 2, 16, generator=gen) * 4
    v = torch.randn(2, 8, 2, 16, generator=gen)
    module = SimpleNamespace(num_key_value_groups=2, head_dim=16, training=False)
    expected, _ = gemma2_attention(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), _additive_mask(8, 3), scaling=0.25, softcap=5.0
    )
    torch.testing.assert_close(attention(q, k, v, 0.25, 3, 5.0), expected)
    assert not torch.allclose(attention(q, k, v, 0.25, 3), expected, atol=1e-3)  # the cap did something


def test_attention_agrees_with_hf_gpt_oss_sinks_and_window():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 7, 4, 8, generator=gen)
    k = torch.randn(1, 7, 1, 8, generator=gen)
    v = torch.randn(1, 7, 1, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    module = SimpleNamespace(num_key_value_groups=4, sinks=sinks, training=False)
    expected, _ = gpt_oss_attention(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), _additive_mask(7, 4), scaling=0.35
    )
    torch.testing.assert_close(attention(q, k, v, 0.35, 4, None, sinks), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_computes_in_float32_and_returns_the_input_dtype(dtype):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 6, 2, 32, generator=gen).to(dtype) for _ in range(3))
    out = attention(q, k, v, 32**-0.5)
    assert out.dtype == dtype
    expected = attention_by_query(q.double(), k.double(), v.double(), 32**-0.5)
    torch.testing.assert_close(out, expected.to(dtype))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k": torch.zeros(1, 3, 3, 4), "v": torch.zeros(1, 3, 3, 4)}, "Hq=4 must be a multiple of kv heads Hkv=3"),
        ({"k": torch.zeros(1, 2, 2, 4)}, r"expected k \[B, S, Hkv, D\]"),
        ({"v": torch.zeros(2, 3, 2, 4)}, r"expected k \[B, S, Hkv, D\]"),
        ({"sliding_window": 0}, "sliding_window must be ≥ 1"),
        ({"logit_cap": 0.0}, "logit_cap must be > 0"),
        ({"sinks": torch.zeros(2)}, r"sinks must be \[Hq=4\]"),
        ({"bias": torch.zeros(1, 4, 3, 2)}, r"bias must be \[1 or B=1, 1 or H=4, Sq=3, Sk=3\]; got \(1, 4, 3, 2\)"),
        ({"bias": torch.zeros(1, 2, 3, 3)}, r"bias must be \[1 or B=1, 1 or H=4"),
    ],
)
def test_attention_rejects_inconsistent_arguments(kwargs, message):
    arguments = {"q": torch.randn(1, 3, 4, 4), "k": torch.randn(1, 3, 2, 4), "v": torch.randn(1, 3, 2, 4), "scale": 0.5}
    with pytest.raises(ValueError, match=message):
        attention(**(arguments | kwargs))
