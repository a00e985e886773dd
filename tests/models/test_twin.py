"""The reduced twin keeps one of every kind of decoder layer and shrinks the rest."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen3MoeConfig

from autodeploy.models import twin
from autodeploy.models.twin import decoder_layers, layer_kinds, twin_config
from tests.tiny_models import TINY_COMMON


def _meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _reduced(config, monkeypatch):
    monkeypatch.setattr(twin, "FULL_SIZE_LIMIT", 0)
    return twin_config(config, _meta(config))


def test_layers_that_differ_only_by_index_are_one_kind():
    config = LlamaConfig(**TINY_COMMON)
    kinds = layer_kinds(decoder_layers(_meta(config), 2))
    assert kinds[0] == kinds[1]


def test_the_twin_keeps_every_layer_kind_and_cuts_per_layer_lists(monkeypatch):
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = Gemma2Config(**{**TINY_COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=64, layer_types=types)
    result = _reduced(config, monkeypatch)
    assert result.config.num_hidden_layers == 3 and result.config.layer_types == types[:3]
    assert result.config.sliding_window == twin.TWIN_WINDOW
    assert "3 of 4 layers" in result.summary


def test_a_pipeline_parallel_twin_keeps_whole_layers_for_every_stage(monkeypatch):
    # One layer would cover a uniform model, but each of 2 (then 4) stages needs a layer of its own.
    monkeypatch.setattr(twin, "FULL_SIZE_LIMIT", 0)
    config = LlamaConfig(**{**TINY_COMMON, "num_hidden_layers": 8})
    assert twin_config(config, _meta(config)).config.num_hidden_layers == 1
    assert twin_config(config, _meta(config), layers_multiple_of=2).config.num_hidden_layers == 2
    assert twin_config(config, _meta(config), layers_multiple_of=4).config.num_hidden_layers == 4


def test_a_sparse_step_keeps_a_dense_and_a_sparse_layer(monkeypatch):
    config = Qwen3MoeConfig(**{**TINY_COMMON, "num_hidden_layers": 6}, num_experts=16, num_experts_per_tok=2,
                            moe_intermediate_size=32, decoder_sparse_step=2, head_dim=16)
    result = _reduced(config, monkeypatch)
    assert result.config.num_hidden_layers == 2
    assert result.config.num_experts == 4 and "4 of 16 experts" in result.summary


def test_the_vocabulary_shrinks_and_special_ids_fold_into_it():
    config = AutoConfig.from_pretrained("configs/models/llama-3-8b")
    result = twin_config(config, _meta(config))
    assert result.reduced and result.config.vocab_size == twin.TWIN_VOCAB
    assert result.config.num_hidden_layers == 1
    assert result.config.bos_token_id < twin.TWIN_VOCAB and result.config.eos_token_id < twin.TWIN_VOCAB
    assert result.config.hidden_size == config.hidden_size and result.config.num_key_value_heads == config.num_key_value_heads


def test_a_small_model_is_its_own_twin():
    config = LlamaConfig(**TINY_COMMON)
    result = twin_config(config, _meta(config))
    assert not result.reduced and result.config is config
