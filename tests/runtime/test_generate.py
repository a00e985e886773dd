"""The first runtime: batching of different-length prompts, sampling parameters, stop conditions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy import SamplingParams, autodeploy
from autodeploy.runtime.sampler import filter_logits, sample_next_tokens
from tests.tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    write_tiny_checkpoint("llama", directory)
    return autodeploy(str(directory), max_batch_size=4)


PROMPTS = [[5, 6, 7], [9], [11, 12, 13, 14, 15, 16, 17], [20, 21], [30, 31, 32, 33, 34]]


def test_batched_generation_equals_one_prompt_at_a_time(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    together = llm.generate(PROMPTS, params)  # 5 prompts > max_batch_size=4: two waves
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in together)


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    with_mates = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [params, SamplingParams(max_tokens=3, temperature=0.7), params])
    assert with_mates[0].token_ids == alone
    assert with_mates[2].token_ids == llm.generate([PROMPTS[2]], params)[0].token_ids


def test_different_seeds_give_different_samples(llm):
    samples = {tuple(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=5.0, seed=s, ignore_eos=True))[0].token_ids) for s in range(4)}
    assert len(samples) > 1


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.8, top_k=1, seed=3, ignore_eos=True))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_stop_token_ids_end_the_request(llm):
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_at = free.token_ids[2]
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at], ignore_eos=True))[0]
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_stop_strings_cut_the_text(llm):
    free = llm.generate("def f(x):", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert len(free.text) >= 3
    stop = free.text[1:3]
    stopped = llm.generate("def f(x):", SamplingParams(max_tokens=10, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]
    assert stop not in stopped.text


def test_eos_stops_unless_ignored(llm):
    free = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    llm.eos_token_ids = {free.token_ids[1]}
    try:
        stopped = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0))[0]
    finally:
        llm.eos_token_ids = {2}
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[1]) + 1]
    assert stopped.finish_reason == "stop"


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.01, 1.0),
)
def test_filtering_keeps_a_most_likely_token_and_only_allowed_tokens(logits, top_k, top_p):
    values = torch.tensor(logits, dtype=torch.float32)
    kept = torch.isfinite(filter_logits(values, top_k, top_p))
    assert (values[kept] == values.max()).any()
    if 0 < top_k < len(logits):
        kth = values.topk(top_k).values[-1]
        assert not kept[values < kth].any()  # top-k: nothing below the k-th largest value survives
    probabilities = values.softmax(-1)
    # Nucleus: the kept set is the smallest prefix (by probability) reaching top_p, so dropping its
    # least likely member must fall below top_p.
    if top_k == 0 and kept.sum() > 1:
        assert probabilities[kept].sum() - probabilities[kept].min() < top_p + 1e-6


def test_sampler_greedy_rows_ignore_generators():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens = sample_next_tokens(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0)], [None, None])
    assert tokens == [1, 0]
