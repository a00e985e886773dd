"""The ``mtp`` drafter on the tiny random Llama given an MTP layer: the layer reads the final hidden state Hugging
Face computes, output is the output without speculation, and a checkpoint without a layer it can run is refused
at build, naming why."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from autodeploy.runtime.hidden_state_heads import LayerShape
from autodeploy.runtime.mtp import MTPHead, save_mtp_layer
from tests.runtime.test_eagle3 import check_what_the_head_is_fed
from tests.runtime.test_engine import random_prompts
from tests.tiny_models import tiny_hf_model


@pytest.fixture(scope="module")
def mtp_dir(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-mtp")
    shutil.copytree(llama_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    torch.manual_seed(0)
    head = MTPHead(LayerShape.of(config))
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            parameter.normal_(0, 0.2) if parameter.dim() > 1 else parameter.fill_(1.0)
    save_mtp_layer(head, folder)
    return folder


@pytest.fixture(scope="module")
def mtp_llm(mtp_dir):
    return autodeploy(str(mtp_dir), device="cpu", verify={"enabled": False},
                      speculative={"method": "mtp", "num_tokens": 3, "auto": False})


def test_the_layer_reads_the_final_hidden_state_and_output_is_unchanged(mtp_llm, llama_llm):
    hf = tiny_hf_model("llama")
    check_what_the_head_is_fed(mtp_llm, lambda sequence: hf.model(torch.tensor([sequence])).last_hidden_state[0], seed=6)
    prompts = random_prompts(3, seed=7, lengths=(5, 50))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in mtp_llm.generate(prompts, params)] == \
        [o.token_ids for o in llama_llm.generate(prompts, params)]
    assert mtp_llm.engine.speculator.stats.drafted > 0


def test_a_checkpoint_without_a_layer_the_drafter_runs_is_refused_at_build(llama_dir, mtp_dir, tmp_path):
    with pytest.raises(ConfigError, match="has no multi-token-prediction layers"):
        autodeploy(str(llama_dir), device="cpu", speculative={"method": "mtp"})
    latent = tmp_path / "latent"
    shutil.copytree(mtp_dir, latent)
    from safetensors.torch import load_file, save_file

    state = load_file(str(latent / "model-mtp.safetensors"))
    state["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(4, 4)
    state["model.layers.2.mlp.gate.weight"] = torch.zeros(4, 4)
    save_file(state, str(latent / "model-mtp.safetensors"))
    index = json.loads((latent / "model.safetensors.index.json").read_text())
    index["weight_map"].update({key: "model-mtp.safetensors" for key in state})
    (latent / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="uses a mixture of experts and multi-head latent attention, which the mtp drafter"):
        autodeploy(str(latent), device="cpu", verify={"enabled": False}, speculative={"method": "mtp", "auto": False})
    partial = tmp_path / "partial"
    shutil.copytree(mtp_dir, partial)
    state = load_file(str(partial / "model-mtp.safetensors"))
    del state["model.layers.2.eh_proj.weight"]
    save_file(state, str(partial / "model-mtp.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['eh_proj.weight'\]"):
        autodeploy(str(partial), device="cpu", verify={"enabled": False}, speculative={"method": "mtp", "auto": False})
