"""Deploys that cannot work fail before anything is exported or materialised, with the numbers and the fix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, PersimmonConfig

from autodeploy import autodeploy, preflight
from autodeploy.errors import ConfigError, error_summary
from autodeploy.models.factory import attention_implementation
from autodeploy.transforms import match_report as match_report_module
from autodeploy.transforms.match_report import expected_counts
from tests.tiny_models import train_tiny_tokenizer


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    train_tiny_tokenizer(directory)
    return directory


def test_max_seq_len_past_a_learned_position_table_is_refused_at_build(gpt2_dir, monkeypatch):
    def exported(*args, **kwargs):
        raise AssertionError("the model was exported before the refusal")

    monkeypatch.setattr(torch.export, "export", exported)  # refused before export, not after a build
    with pytest.raises(ConfigError, match=r"learned position table \(64 positions.*max_seq_len=64"):
        autodeploy(str(gpt2_dir), device="cpu", max_seq_len=128)


def test_an_absolute_position_model_refuses_requests_past_its_table(gpt2_dir):
    from autodeploy import SamplingParams
    from autodeploy.errors import InvalidRequestError

    llm = autodeploy(str(gpt2_dir), device="cpu")
    with pytest.raises(InvalidRequestError, match="max_seq_len=64"):
        llm.logits([list(range(3, 70))])
    with pytest.raises(InvalidRequestError, match="max_seq_len=64"):
        llm.generate([list(range(3, 60))], SamplingParams(max_tokens=10))


def test_a_model_too_large_for_the_memory_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(preflight, "available_memory", lambda device: (8 * 2**30, "this machine has"))
    with pytest.raises(ConfigError) as raised:
        autodeploy("llama-3-8b", device="cpu", weights="random")
    message = str(raised.value)
    assert "29.9 GiB in float32" in message and "8.0 GiB free" in message
    assert "dtype=bfloat16 (weights 15.0 GiB)" in message and "device=meta with weights=random" in message


def test_triton_attention_on_the_cpu_is_refused_at_build(llama_dir):
    with pytest.raises(ConfigError, match="prefers \\['triton'\\] for node .* Triton kernels need a CUDA device"):
        autodeploy(str(llama_dir), device="cpu", backends={"cached_attention": ["triton"]})


def test_classes_without_sdpa_are_built_with_eager_attention():
    config = BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4)
    assert attention_implementation(config) == "eager"


def test_wrapped_messages_are_joined_and_never_cut_mid_word():
    error = ValueError("BloomForCausalLM does not support an attention implementation through SDPA yet. Please request the support for this\narchitecture.")
    assert error_summary(error).endswith("for this architecture.")
    long = ValueError("word " * 200)
    summary = error_summary(long, limit=50)
    assert summary.endswith(" …") and all(part == "word" for part in summary[:-2].split())


def test_the_match_report_knows_persimmon_and_never_breaks_a_deploy(llama_dir, monkeypatch):
    counts, _ = expected_counts(PersimmonConfig(num_hidden_layers=2))
    assert counts["norm"] == 2 * 4 + 1  # input + post-attention norms, q and k layernorms, the final norm

    def broken(*args):
        raise AttributeError("num_key_value_heads")

    monkeypatch.setattr(match_report_module, "match_report", broken)
    llm = autodeploy(str(llama_dir), device="cpu")
    assert "report unavailable" in llm.pipeline_report()
