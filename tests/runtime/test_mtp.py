"""The ``mtp`` drafter on the tiny random Llama given an MTP layer: the layer reads the final hidden state Hugging
Face computes (a prefix-cache hit's cached positions from the store), output is the output without speculation,
and a checkpoint without a layer it can run is refused at build, naming why."""

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


def test_a_prefix_cache_hit_feeds_the_layer_the_stored_rows_of_the_cached_positions(mtp_llm, llama_llm):
    hf = tiny_hf_model("llama")

    def final_norm(sequence):
        return hf.model(torch.tensor([sequence])).last_hidden_state[0]

    prompt = random_prompts(1, seed=8, lengths=(40, 40))[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    mtp_llm.generate([prompt[:20]], params)  # computes positions 0 … 15 (one block), which the store keeps
    store = mtp_llm.engine.speculator.drafter.store
    recalled = store.recalled
    output = check_what_the_head_is_fed(mtp_llm, final_norm, prompt=prompt)  # fed from position 0 all the same
    assert store.recalled - recalled == 16
    assert output == llama_llm.generate([prompt], params)[0].token_ids


def test_a_checkpoint_without_a_layer_the_drafter_runs_is_refused_at_build(llama_dir, mtp_dir, tmp_path):
    with pytest.raises(ConfigError, match="has no multi-token-prediction layers"):
        autodeploy(str(llama_dir), device="cpu", speculative={"method": "mtp"})
    from safetensors.torch import load_file, save_file

    for name, extra, message in [
        ("latent", "self_attn.kv_a_proj_with_mqa.weight", "is not the layer its config describes"),  # on a Llama config
        ("quantized", "self_attn.q_proj.weight_scale_inv", "is stored quantized"),
    ]:
        folder = tmp_path / name
        shutil.copytree(mtp_dir, folder)
        state = load_file(str(folder / "model-mtp.safetensors"))
        state[f"model.layers.2.{extra}"] = torch.zeros(4, 4)
        save_file(state, str(folder / "model-mtp.safetensors"))
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"].update({key: "model-mtp.safetensors" for key in state})
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ConfigError, match=message):
            autodeploy(str(folder), device="cpu", verify={"enabled": False}, speculative={"method": "mtp", "auto": False})
    partial = tmp_path / "partial"
    shutil.copytree(mtp_dir, partial)
    state = load_file(str(partial / "model-mtp.safetensors"))
    del state["model.layers.2.eh_proj.weight"]
    save_file(state, str(partial / "model-mtp.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['eh_proj.weight'\]"):
        autodeploy(str(partial), device="cpu", verify={"enabled": False}, speculative={"method": "mtp", "auto": False})


def tiny_deepseek_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                            max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0, rope_interleave=True)


def test_deepseek_v3s_own_mtp_layer_drafts_and_output_is_unchanged(tmp_path):
    """DeepSeek-V3's MTP layer (latent attention, experts in the release's per-expert format): built, checked, drafting
    on the tiny random DeepSeek-V3, whose output with it is its output without it."""
    from transformers import AutoModelForCausalLM

    from autodeploy.runtime.mtp import DeepSeekMTPHead, load_mtp_head
    from tests.tiny_models import train_tiny_tokenizer

    config = tiny_deepseek_v3_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path / "deepseek-v3-mtp"
    model.save_pretrained(folder)
    train_tiny_tokenizer(folder)
    raw = json.loads((folder / "config.json").read_text())
    head = DeepSeekMTPHead(LayerShape.of(raw), raw["num_hidden_layers"])
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            parameter.normal_(0, 0.2) if parameter.dim() > 1 else parameter.fill_(1.0)
    save_mtp_layer(head, folder)
    loaded = load_mtp_head(folder, head.embed_tokens.weight, torch.device("cpu"), torch.float32)
    assert isinstance(loaded, DeepSeekMTPHead)
    assert torch.equal(loaded.mlp.experts.gate_up_proj, head.mlp.experts.gate_up_proj.bfloat16().float())
    plain = autodeploy(str(folder), device="cpu", verify={"enabled": False})
    spec = autodeploy(str(folder), device="cpu", verify={"enabled": False},
                      speculative={"method": "mtp", "num_tokens": 3, "tree_width": 2, "auto": False})
    assert "cached steps equal one forward" in spec.engine.speculator.describe()
    prompts = random_prompts(3, seed=2, lengths=(5, 40))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.engine.speculator.stats.drafted > 0


def test_the_deepseek_layer_computes_what_hugging_faces_decoder_layer_computes():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from autodeploy.runtime.mtp import DeepSeekMTPHead

    config = tiny_deepseek_v3_config()
    config._attn_implementation = "eager"
    raw = config.to_dict()
    torch.manual_seed(3)
    head = DeepSeekMTPHead(LayerShape.of(raw), 2).eval()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.2) if parameter.dim() > 1 else parameter.fill_(1.0)
    layer = DeepseekV3DecoderLayer(config, 2).eval()
    layer.load_state_dict({name: t for name, t in head.state_dict().items()
                           if name.startswith(("input_layernorm.", "self_attn.", "post_attention_layernorm.", "mlp."))})
    hidden, tokens = torch.randn(1, 9, 64), torch.randint(0, 512, (1, 9))
    positions = torch.arange(9)[None]
    with torch.no_grad():
        ours = head.step(hidden, tokens, positions, torch.ones(1, 9, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                         head.new_cache(1, 16, 1), from_model=True)
        _, x = head.layer_input(hidden, head.embed_tokens(tokens), True)
        causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
        theirs = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=head.rotary(x, positions))
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
