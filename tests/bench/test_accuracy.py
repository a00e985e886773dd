"""The accuracy workload: agreement with HF eager, perplexity, and the errors users can hit."""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy import autodeploy
from autodeploy.bench.accuracy import (
    PROMPT_TEXTS,
    compare_with_hf,
    fixed_prompts,
    load_reference_model,
    perplexity,
    perplexity_of_file,
)
from autodeploy.errors import ConfigError
from tests.tiny_models import VOCAB_SIZE, tiny_hf_model

# Python source: the tiny tokenizer was trained on code, so it encodes this compactly but not trivially.
TEXT = "".join(
    f"def square_{i}(x):\n    return x * x + {i}\n\nfor value in range({i}):\n    print(square_{i}(value))\n" for i in range(12)
)


@pytest.fixture(scope="module")
def reference(llama_llm):
    return load_reference_model(llama_llm)


def hf_sliding_window_perplexity(model, token_ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """The Hugging Face perplexity recipe (docs: "Perplexity of fixed-length models"), written out
    independently: labels of already-scored tokens set to -100, the loss weighted by scored tokens."""
    ids = torch.tensor([token_ids])
    nll_sum, scored, previous_end = 0.0, 0, 0
    for begin in range(0, len(token_ids), stride):
        end = min(begin + window, len(token_ids))
        target_length = end - previous_end
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-target_length] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=labels, use_cache=False).loss
        valid = int((labels[:, 1:] != -100).sum())  # the model shifts labels left by one
        nll_sum += loss.item() * valid
        scored += valid
        previous_end = end
        if end == len(token_ids):
            break
    return math.exp(nll_sum / scored), scored


def test_deployed_tiny_llama_agrees_with_hf(llama_llm, reference):
    prompts = fixed_prompts(llama_llm.vocab_size, llama_llm.tokenizer, count=4, length=32)
    report = compare_with_hf(llama_llm, reference, prompts)
    assert (report.num_prompts, report.num_tokens) == (4, 4 * 32)
    assert report.top1_agreement == 1.0
    assert report.max_abs_logit_error < 1e-4
    assert 0 <= report.mean_abs_logit_error <= report.max_abs_logit_error
    assert set(report.to_dict()) == {"num_prompts", "num_tokens", "top1_agreement", "max_abs_logit_error", "mean_abs_logit_error"}


def test_a_different_model_fails_the_comparison(llama_llm):
    # Not another tiny Llama: with tied embeddings a random tiny model's argmax is nearly always the input
    # token, so two of them agree ~98%. Qwen2's untied head makes its argmax unrelated to the Llama's.
    prompts = fixed_prompts(llama_llm.vocab_size, llama_llm.tokenizer, count=4, length=32)
    report = compare_with_hf(llama_llm, tiny_hf_model("qwen2", seed=1), prompts)
    assert report.top1_agreement < 0.5
    assert report.max_abs_logit_error > 0.1


def test_reference_model_is_eager_in_the_deployed_dtype(llama_llm, reference):
    assert reference.config._attn_implementation == "eager"
    assert next(reference.parameters()).dtype == getattr(torch, llama_llm.settings.dtype)
    assert not reference.training


def test_fixed_prompts_are_deterministic_and_in_vocabulary(llama_llm):
    tokenizer = llama_llm.tokenizer
    for tok in (tokenizer, None):
        prompts = fixed_prompts(VOCAB_SIZE, tok, count=16, length=64)
        assert prompts == fixed_prompts(VOCAB_SIZE, tok, count=16, length=64)
        assert len(prompts) == 16 and all(len(p) == 64 for p in prompts)
        assert all(0 <= t < VOCAB_SIZE for p in prompts for t in p)
        assert len({tuple(p) for p in prompts}) == 16
    assert fixed_prompts(VOCAB_SIZE, None, seed=1) != fixed_prompts(VOCAB_SIZE, None, seed=0)
    # Text prompts start as the tokenizer encodes the text, then repeat it.
    assert fixed_prompts(VOCAB_SIZE, tokenizer, count=1, length=4)[0] == tokenizer(PROMPT_TEXTS[0]).input_ids[:4]


def test_fixed_prompts_reject_impossible_requests(llama_llm):
    with pytest.raises(ConfigError, match="at most"):
        fixed_prompts(VOCAB_SIZE, llama_llm.tokenizer, count=len(PROMPT_TEXTS) + 1)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        fixed_prompts(8, llama_llm.tokenizer, count=1)
    with pytest.raises(ConfigError, match="count >= 1"):
        fixed_prompts(VOCAB_SIZE, None, count=0)


@pytest.mark.parametrize(("window", "stride"), [(64, 32), (48, 17), (512, 384)])  # TEXT is 661 tokens
def test_perplexity_matches_the_hf_recipe(llama_llm, window, stride):
    token_ids = llama_llm.tokenizer(TEXT).input_ids
    expected, expected_scored = hf_sliding_window_perplexity(tiny_hf_model("llama"), token_ids, window, stride)
    report = perplexity(llama_llm, TEXT, window=window, stride=stride)
    assert report.num_tokens == expected_scored == len(token_ids) - 1
    assert report.perplexity == pytest.approx(expected, rel=1e-4)
    assert report.perplexity == pytest.approx(math.exp(report.mean_nll), rel=1e-12)


@settings(max_examples=15, deadline=None)
@given(length=st.integers(2, 80), window=st.integers(2, 40), data=st.data())
def test_every_token_after_the_first_is_scored_once(llama_llm, length, window, data):
    stride = data.draw(st.integers(1, window - 1))
    token_ids = llama_llm.tokenizer(TEXT).input_ids[:length]
    text = llama_llm.tokenizer.decode(token_ids)
    report = perplexity(llama_llm, text, window=window, stride=stride)
    assert report.num_tokens == len(llama_llm.tokenizer(text).input_ids) - 1


def test_perplexity_of_file_reads_the_text(llama_llm, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    assert perplexity_of_file(llama_llm, path, window=64) == perplexity(llama_llm, TEXT, window=64)


def test_empty_or_missing_text_is_a_config_error(llama_llm, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="the text file .* is empty"):
        perplexity_of_file(llama_llm, empty)
    with pytest.raises(ConfigError, match="does not exist"):
        perplexity_of_file(llama_llm, tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="the text file is empty"):
        perplexity(llama_llm, "")
    with pytest.raises(ConfigError, match="the text file is empty"):
        perplexity(llama_llm, "x")  # one token: nothing to predict


def test_bad_window_or_stride_is_a_config_error(llama_llm):
    with pytest.raises(ConfigError, match="less than the window"):
        perplexity(llama_llm, TEXT, window=32, stride=32)
    with pytest.raises(ConfigError, match="max_seq_len"):
        perplexity(llama_llm, TEXT, window=llama_llm.settings.max_seq_len + 1)


def test_perplexity_needs_a_tokenizer(llama_llm):
    without_tokenizer = copy.copy(llama_llm)
    without_tokenizer.tokenizer = None
    with pytest.raises(ConfigError, match="tokenizer"):
        perplexity(without_tokenizer, TEXT)


def test_random_weights_have_no_reference(llama_dir):
    llm = autodeploy(str(llama_dir), device="cpu", weights="random")
    with pytest.raises(ConfigError, match="random weights"):
        load_reference_model(llm)


def test_a_folder_without_weights_has_no_reference(llama_llm, tmp_path):
    directory = tmp_path / "config-only"
    shutil.copytree(llama_llm.model_directory, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    moved = copy.copy(llama_llm)
    moved.model_directory = str(directory)
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load_reference_model(moved)
