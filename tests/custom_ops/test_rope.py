"""autodeploy::rope against a complex-number rotation and HF's Llama, GPT-NeoX (partial) and GLM (interleaved) code."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as glm_apply_rotary_pos_emb
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary_pos_emb

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

rope = torch.ops.autodeploy.rope


def rotate_as_complex(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Multiply each rotated pair, read as a complex number, by e^{iθ}; ``angles[B, S, R/2]``."""
    rotary_dim = 2 * angles.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:  # pair i is (2i, 2i+1)
        pairs = torch.view_as_complex(x_rot.reshape(*x_rot.shape[:-1], rotary_dim // 2, 2).contiguous())
    else:  # pair i is (i, i + R/2)
        pairs = torch.complex(x_rot[..., : rotary_dim // 2], x_rot[..., rotary_dim // 2 :])
    rotated = pairs * torch.polar(torch.ones_like(angles), angles).unsqueeze(2)  # same angle for every head
    if interleaved:
        out = torch.view_as_real(rotated).flatten(-2)
    else:
        out = torch.cat((rotated.real, rotated.imag), dim=-1)
    return torch.cat((out, x_pass), dim=-1)


def cos_sin(angles: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin in the layout ``rope`` expects: duplicated halves, or repeat-interleaved."""
    if interleaved:
        full = angles.repeat_interleave(2, dim=-1)
    else:
        full = torch.cat((angles, angles), dim=-1)
    return full.cos(), full.sin()


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 6),
    heads=st.integers(1, 4),
    half_rotary=st.integers(1, 4),
    pass_dims=st.integers(0, 4),
    interleaved=st.booleans(),
    shared_over_batch=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rope_matches_complex_rotation(
    batch, seq, heads, half_rotary, pass_dims, interleaved, shared_over_batch, seed
):
    gen = torch.Generator().manual_seed(seed)
    head_dim = 2 * half_rotary + pass_dims
    x = torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=torch.float64)
    angles = torch.rand(1 if shared_over_batch else batch, seq, half_rotary, generator=gen, dtype=torch.float64) * 20
    cos, sin = cos_sin(angles, interleaved)

    expected = rotate_as_complex(x, angles.expand(batch, -1, -1), interleaved)
    torch.testing.assert_close(rope(x, cos, sin, interleaved), expected, rtol=1e-12, atol=1e-12)


def _hf_cos_sin(batch: int, seq: int, head_dim: int):
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=64)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(seq).repeat(batch, 1) + torch.arange(batch)[:, None] * 5
    return rotary(torch.zeros(1, dtype=torch.float32), positions)


def test_rope_agrees_with_hf_llama():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=gen)  # [B, S, H, D]
    cos, sin = _hf_cos_sin(2, 5, 16)
    # HF works in [B, H, S, D]
    hf_q, _ = llama_apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
    torch.testing.assert_close(rope(q, cos, sin), hf_q.transpose(1, 2))


def test_rope_agrees_with_hf_gpt_neox_partial_rotary():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 3, 16, generator=gen)
    angles = torch.rand(2, 5, 3, generator=gen) * 10  # R = 6 of D = 16
    cos, sin = cos_sin(angles, interleaved=False)
    hf_q, _ = neox_apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(rope(q, cos, sin), hf_q)
    torch.testing.assert_close(rope(q, cos, sin)[..., 6:], q[..., 6:], rtol=0, atol=0)


def test_rope_agrees_with_hf_glm_interleaved_partial_rotary():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 2, 16, generator=gen)
    cos, sin = cos_sin(torch.rand(1, 4, 4, generator=gen) * 10, interleaved=False)  # HF's layout, R = 8
    hf_q, _ = glm_apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)
    # GLM converts HF's duplicated halves to the repeat-interleaved layout internally; the op takes it directly.
    cos_interleaved = cos[..., :4].repeat_interleave(2, dim=-1)
    sin_interleaved = sin[..., :4].repeat_interleave(2, dim=-1)
    torch.testing.assert_close(rope(q, cos_interleaved, sin_interleaved, True), hf_q)


def test_rope_returns_the_input_dtype():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 3, 2, 8, generator=gen).to(torch.bfloat16)
    cos, sin = cos_sin(torch.rand(1, 3, 4, generator=gen), interleaved=False)
    out = rope(q, cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rotate_as_complex(q.double(), torch.acos(cos[..., :4].double()), False).bfloat16())


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "message"),
    [(8, 3, "must be even"), (8, 10, "at most head dim D=8")],
)
def test_rope_rejects_odd_or_too_wide_rotary_dims(head_dim, rotary_dim, message):
    x = torch.randn(1, 2, 1, head_dim)
    with pytest.raises(ValueError, match=message):
        rope(x, torch.ones(1, 2, rotary_dim), torch.zeros(1, 2, rotary_dim))


def test_rope_rejects_cos_for_other_positions():
    with pytest.raises(ValueError, match=r"must equal x's \(1, 2\) or be 1"):
        rope(torch.randn(1, 2, 1, 4), torch.ones(1, 3, 4), torch.zeros(1, 3, 4))
