"""ALiBi attention (Bloom's baddbmm form, MPT's bias-then-masked_fill form) becomes canonical attention
carrying Hugging Face's own slopes; a bias that is not linear in the key position is left alone."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from autodeploy import autodeploy
from autodeploy.patterns.attention import alibi_slopes
from tests.sweep_models import tiny_model


def _deployed_slopes(model_type: str, tmp_path) -> tuple[list, torch.nn.Module]:
    model = tiny_model(model_type)
    model.save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", verify={"enabled": False})
    nodes = [n for n in llm.graph.graph.nodes if "cached_attention" in str(n.target)]
    return [n.args[-1] for n in nodes], model


def test_bloom_attention_carries_its_slopes(tmp_path):
    slopes, model = _deployed_slopes("bloom", tmp_path)
    heads = model.config.n_head
    expected = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1].tolist()  # slope · position 1
    assert len(slopes) == model.config.n_layer
    for layer in slopes:
        assert layer == pytest.approx(expected, rel=1e-6)


def test_mpt_attention_carries_its_slopes(tmp_path):
    slopes, model = _deployed_slopes("mpt", tmp_path)
    bias = build_mpt_alibi_tensor(model.config.n_heads, 2, model.config.attn_config.alibi_bias_max)
    expected = (bias[:, 0, 1] - bias[:, 0, 0]).tolist()
    for layer in slopes:
        assert layer == pytest.approx(expected, rel=1e-6)


def test_a_bias_that_is_not_linear_in_the_key_position_is_not_alibi():
    from torch.fx.experimental.proxy_tensor import make_fx

    from autodeploy.patterns.graph_walk import NoMatch

    def quadratic_bias(positions):
        return (positions[:, None, :].float() ** 2).expand(2, 1, positions.shape[1])

    gm = make_fx(quadratic_bias, tracing_mode="fake")(torch.arange(16)[None])
    bias = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    with pytest.raises(NoMatch, match="not linear"):
        alibi_slopes(gm, bias, heads=2)
