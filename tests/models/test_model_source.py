"""What a user may name as the model: local folder, config.json, shipped config, hub id — and clean errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertConfig, UMT5Config, ViTConfig

from autodeploy import autodeploy, deployment_settings
from autodeploy.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from autodeploy.models.source import resolve_model_source, shipped_model_configs
from tests.tiny_models import tiny_hf_model

PROMPT_IDS = [5, 17, 42, 99, 3, 250]


def test_local_folder(llama_dir):
    source = resolve_model_source(str(llama_dir))
    assert (source.directory, source.config_file) == (llama_dir, llama_dir / "config.json")
    settings, factory = deployment_settings(str(llama_dir))
    assert factory.hf_config.model_type == "llama" and settings.model == str(llama_dir)


def test_path_to_config_json_loads_the_weights_beside_it(llama_dir):
    llm = autodeploy(str(llama_dir / "config.json"), device="cpu")
    with torch.no_grad():
        expected = tiny_hf_model("llama")(torch.tensor([PROMPT_IDS])).logits[0]
    torch.testing.assert_close(llm.logits([PROMPT_IDS])[0], expected, atol=1e-5, rtol=1e-5)


def test_shipped_config_names_resolve_without_weights():
    assert {"llama-3-8b", "mixtral-8x7b", "qwen2.5-7b"} <= set(shipped_model_configs())
    settings, factory = deployment_settings("mixtral-8x7b", weights="random", device="cpu")
    assert factory.source.directory.name == "mixtral-8x7b"
    assert factory.hf_config.model_type == "mixtral"
    assert settings.max_seq_len == factory.hf_config.max_position_embeddings


def test_shipped_8b_config_deploys_on_meta_with_random_weights():
    # The one 8B export of the suite (~8 s): the whole pipeline runs without touching weight memory.
    llm = autodeploy("llama-3-8b", weights="random", device="meta")
    assert [r.name for r in llm.records][-12:] == [
        "load_weights", "expose_hidden_states", "fold_smoothing", "fuse_gemms", "fuse_gate_up", "fuse_add_rms_norm", "fuse_fp8_quantization",
        "insert_cached_attention", "fuse_rope_into_cached_attention", "refold_transposes", "select_kernels", "compile_model",
    ]
    assert "meta" in llm.records[-12].notes
    assert all(p.is_meta for p in llm.graph.parameters())
    assert sum(p.numel() for p in llm.graph.parameters()) > 7e9
    assert llm.settings.max_seq_len == 8192
    with pytest.raises(InvalidRequestError, match="meta"):
        llm.generate([[1, 2, 3]])


def test_hub_id_not_in_the_offline_cache(hf_offline):
    with pytest.raises(ModelNotFoundError, match="someorg/not-a-cached-model") as error:
        deployment_settings("someorg/not-a-cached-model")
    assert "outgoing traffic has been disabled" in str(error.value)  # offline: no network attempt


@pytest.mark.parametrize("name", ["/definitely/not/a/folder", "not a model name!", "../nope/missing"])
def test_invalid_path_or_name(hf_offline, name):
    with pytest.raises(ModelNotFoundError, match="not a local path"):
        deployment_settings(name)


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        deployment_settings(str(tmp_path))


def test_file_that_is_not_a_config_json(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match="not a config.json"):
        deployment_settings(str(path))


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "flubberformer", "hidden_size": 8}))
    with pytest.raises(UnsupportedModelError, match="flubberformer"):
        deployment_settings(str(tmp_path))


def test_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="config.json"):
        deployment_settings(str(tmp_path))


@pytest.mark.parametrize(
    "config",
    [
        UMT5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=100),
        ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
                   architectures=["BertForQuestionAnswering"]),
    ],
    ids=["umt5-encoder-decoder", "vit-vision", "bert-question-answering"],
)
def test_architecture_that_is_not_a_causal_lm(tmp_path, config):
    """Refused by name: UMT5 as an encoder-decoder family not served yet (BART's and T5's are: tests/test_encoder_decoder.py),
    a BERT task head autodeploy does not serve (BERT itself is served as an embedder: tests/test_embeddings.py)."""
    config.save_pretrained(tmp_path)
    expected = {"umt5": "encoder-decoder model; .* not umt5: UMT5's relative position bias",
                "bert": "BertForQuestionAnswering is a task head autodeploy does not serve"}.get(config.model_type, "not a causal language model")
    with pytest.raises(UnsupportedModelError, match=expected):
        autodeploy(str(tmp_path), weights="random", device="cpu")
