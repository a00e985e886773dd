"""The runtime through LLM.generate: batching of different-length prompts, sampling parameters, stop conditions."""

from __future__ import annotations

import pytest

from autodeploy import SamplingParams, autodeploy
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
    llm.engine.eos_token_ids = {free.token_ids[1]}
    try:
        stopped = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0))[0]
    finally:
        llm.engine.eos_token_ids = {2}
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[1]) + 1]
    assert stopped.finish_reason == "stop"
