"""The HF baselines time one generate() per batch, step by step, and decode what HF greedy decodes."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from autodeploy.bench.hf_baselines import BatchTiming, hf_generate_timing, load_hf_model
from autodeploy.errors import ConfigError, ModelNotFoundError
from tests.tiny_models import tiny_config

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
OUTPUT_LEN = 5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_hf_model(tiny_checkpoint("llama"), torch.float32, CPU)


def greedy_reference(model, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Argmax over a full uncached forward per step; EOS masked, as min_new_tokens masks it."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(output_len):
            logits = model(ids).logits[:, -1]
            logits[:, model.generation_config.eos_token_id] = float("-inf")
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=-1)
    return ids[:, len(prompts[0]) :].tolist()


def test_eager_batch_decodes_hf_greedy_and_times_each_step(model):
    timing = hf_generate_timing(model, PROMPTS, OUTPUT_LEN, mode="hf-eager")

    assert (timing.batch, timing.input_len, timing.output_len) == (3, 4, OUTPUT_LEN)
    assert len(timing.token_times) == OUTPUT_LEN
    assert timing.start <= timing.token_times[0]
    assert all(a < b for a, b in itertools.pairwise(timing.token_times))
    assert timing.output_token_ids == greedy_reference(model, PROMPTS, OUTPUT_LEN)


def test_fake_clock_gives_exact_structure(model):
    ticks = itertools.count()
    timing = hf_generate_timing(model, PROMPTS[:1], 4, mode="hf-eager", clock=lambda: float(next(ticks)))

    # One reading before generate, then one per decoding step: none for the prompt, none after.
    assert timing == BatchTiming(
        start=0.0,
        token_times=[1.0, 2.0, 3.0, 4.0],
        input_len=4,
        output_len=4,
        batch=1,
        output_token_ids=timing.output_token_ids,
    )
    assert next(ticks) == 5


def test_unequal_prompt_lengths_are_refused(model):
    with pytest.raises(ValueError, match="one length"):
        hf_generate_timing(model, [[5, 6, 7], [8, 9]], 2, mode="hf-eager")


def test_unknown_mode_is_refused(model):
    with pytest.raises(ConfigError, match="hf-eager"):
        hf_generate_timing(model, PROMPTS, 2, mode="hf-fast")


def test_config_only_folder_loads_random_weights(tmp_path, tiny_checkpoint):
    tiny_config("llama").save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]

    random_model = load_hf_model(tmp_path, torch.float32, CPU)
    checkpoint_model = load_hf_model(tiny_checkpoint("llama"), torch.float32, CPU)

    assert type(random_model) is type(checkpoint_model) and not random_model.training
    assert random_model.config._attn_implementation == "sdpa"
    weights = dict(checkpoint_model.named_parameters())
    assert {name: p.shape for name, p in random_model.named_parameters()} == {name: p.shape for name, p in weights.items()}
    assert not torch.equal(random_model.model.layers[0].mlp.up_proj.weight, weights["model.layers.0.mlp.up_proj.weight"])
    assert random_model.lm_head.weight is random_model.model.embed_tokens.weight  # tie_word_embeddings kept
    assert torch.equal(random_model.model.rotary_emb.inv_freq, checkpoint_model.model.rotary_emb.inv_freq)
    assert len(hf_generate_timing(random_model, PROMPTS, 3, mode="hf-eager").token_times) == 3


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_hf_model(tmp_path, torch.float32, CPU)


def test_compile_matches_eager_and_warms_up_untimed(tiny_checkpoint):
    # A model of its own: the compile marker it gains must not leak into the other tests.
    model = load_hf_model(tiny_checkpoint("llama"), torch.float32, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    eager = hf_generate_timing(model, PROMPTS, OUTPUT_LEN, mode="hf-eager")

    started = time.perf_counter()
    compiled = hf_generate_timing(model, PROMPTS, OUTPUT_LEN, mode="hf-compile")
    first_call_s = time.perf_counter() - started

    assert compiled.output_token_ids == eager.output_token_ids
    assert len(compiled.token_times) == OUTPUT_LEN
    # The warm-up (compilation: seconds) ran before the clock started; the timed generate is milliseconds.
    assert compiled.token_times[-1] - compiled.start < first_call_s / 10
    assert model._compiled_call is not None
