"""The load_weights stage: every checkpoint layout gives HF's logits; broken checkpoints give CheckpointErrors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy import autodeploy
from autodeploy.errors import CheckpointError
from tests.tiny_models import tiny_hf_model

PROMPT_IDS = [5, 17, 42, 99, 3, 250, 7]


def hf_logits(arch: str) -> torch.Tensor:
    with torch.no_grad():
        return tiny_hf_model(arch)(torch.tensor([PROMPT_IDS])).logits[0]


def deployed_logits(directory: Path, **overrides) -> torch.Tensor:
    return autodeploy(str(directory), device="cpu", **overrides).logits([PROMPT_IDS])[0]


def copy_with_edited_weights(source: Path, destination: Path, edit) -> Path:
    """A copy of a single-file safetensors checkpoint whose state dict went through ``edit``."""
    shutil.copytree(source, destination)
    tensors = load_file(destination / "model.safetensors")
    edit(tensors)
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def test_single_file_safetensors_equals_hf(llama_llm):
    torch.testing.assert_close(llama_llm.logits([PROMPT_IDS])[0], hf_logits("llama"), atol=1e-5, rtol=1e-5)


def test_sharded_safetensors_equal_unsharded(tiny_checkpoint, llama_llm):
    directory = tiny_checkpoint("llama", max_shard_size="100KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    torch.testing.assert_close(deployed_logits(directory), llama_llm.logits([PROMPT_IDS])[0], atol=0, rtol=0)


def test_legacy_pytorch_model_bin(llama_dir, tmp_path):
    # transformers 5 always writes safetensors (safe_serialization=False is ignored), so write the .bin by hand.
    directory = tmp_path / "bin-checkpoint"
    shutil.copytree(llama_dir, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(tiny_hf_model("llama").state_dict(), directory / "pytorch_model.bin")
    torch.testing.assert_close(deployed_logits(directory), hf_logits("llama"), atol=1e-5, rtol=1e-5)


def test_tied_embeddings_load_from_the_embedding_tensor(llama_dir, llama_llm):
    hf_model = tiny_hf_model("llama")
    assert hf_model.config.tie_word_embeddings
    assert "lm_head.weight" not in load_file(llama_dir / "model.safetensors")  # only the embedding is stored
    graph_params = dict(llama_llm.graph.named_parameters())
    (head,) = [p for name, p in graph_params.items() if "lm_head" in name or "embed_tokens" in name]
    torch.testing.assert_close(head, hf_model.model.embed_tokens.weight, atol=0, rtol=0)
    torch.testing.assert_close(llama_llm.logits([PROMPT_IDS])[0], hf_logits("llama"), atol=1e-5, rtol=1e-5)


def test_mixtral_per_expert_checkpoint_equals_hf(tiny_checkpoint):
    directory = tiny_checkpoint("mixtral")
    keys = load_file(directory / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys  # per-expert layout, fused on load
    torch.testing.assert_close(deployed_logits(directory), hf_logits("mixtral"), atol=1e-5, rtol=1e-5)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    missing = "model.layers.1.mlp.down_proj.weight"
    directory = copy_with_edited_weights(llama_dir, tmp_path / "missing", lambda tensors: tensors.pop(missing))
    with pytest.raises(CheckpointError, match="lacks 1 tensor") as error:
        deployed_logits(directory)
    assert missing in str(error.value)


def test_wrong_shape_names_the_tensor_and_both_shapes(llama_dir, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"

    def shrink(tensors):
        tensors[name] = torch.zeros(32, 64)

    directory = copy_with_edited_weights(llama_dir, tmp_path / "wrong-shape", shrink)
    with pytest.raises(CheckpointError, match=name) as error:
        deployed_logits(directory)
    assert "(32, 64)" in str(error.value) and "(64, 64)" in str(error.value)


def test_missing_mixtral_expert_tensor_is_named(tiny_checkpoint, tmp_path):
    missing = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    directory = copy_with_edited_weights(tiny_checkpoint("mixtral"), tmp_path / "missing-expert", lambda t: t.pop(missing))
    with pytest.raises(CheckpointError, match=missing):
        deployed_logits(directory)


@pytest.fixture(scope="module")
def config_only_dir(llama_dir, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("config-only") / "llama"
    shutil.copytree(llama_dir, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    return directory


def test_folder_without_weights_suggests_random_weights(config_only_dir):
    with pytest.raises(CheckpointError, match="weights='random'"):
        deployed_logits(config_only_dir)


def test_random_weights_need_no_checkpoint_and_are_deterministic_per_seed(config_only_dir):
    first = deployed_logits(config_only_dir, weights="random", seed=0)
    again = deployed_logits(config_only_dir, weights="random", seed=0)
    other = deployed_logits(config_only_dir, weights="random", seed=1)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    assert not torch.allclose(first, other)
    assert not torch.allclose(first, hf_logits("llama"))  # not secretly the checkpoint's weights
