"""Seeded sampling: each (request seed, sample index) draws its own stream, reproducibly, whatever else
shares the batch; sample 0 of a seeded ``n`` > 1 request is the same request with ``n=1``."""

from __future__ import annotations

import torch

from autodeploy import SamplingParams
from autodeploy.runtime.sampler import SamplingRow, sample

PROMPT = [5, 6, 7, 8, 9]


def sampled(seed: int, n: int = 3) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)


def samples(output) -> list[list[int]]:
    return [completion.token_ids for completion in output.outputs]


def test_samples_of_neighbouring_seeds_do_not_overlap(llama_llm):
    for seed in (0, 41):
        this, next_seed = (llama_llm.generate([PROMPT], sampled(s))[0] for s in (seed, seed + 1))
        for index in (1, 2):
            assert samples(this)[index] != samples(next_seed)[index - 1], (seed, index)
        assert len({tuple(s) for s in samples(this)}) == 3


def test_a_seed_gives_the_same_samples_every_time(llama_llm):
    first, again = (llama_llm.generate([PROMPT], sampled(7))[0] for _ in range(2))
    assert samples(first) == samples(again)


def test_sample_zero_is_the_request_with_n_1(llama_llm):
    (several,) = llama_llm.generate([PROMPT], sampled(12))
    (single,) = llama_llm.generate([PROMPT], sampled(12, n=1))
    assert samples(several)[0] == single.token_ids


def test_seeded_samples_ignore_their_batch_mates(llama_llm):
    (alone,) = llama_llm.generate([PROMPT], sampled(3))
    mates = [
        ([9, 8, 7], SamplingParams(max_tokens=5, temperature=0.8)),  # unseeded
        ([1, 2, 3, 4, 5, 6, 7, 8], sampled(4)),
        ([5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
    ]
    prompts = [prompt for prompt, _ in mates[:2]] + [PROMPT] + [mates[2][0]]
    params = [p for _, p in mates[:2]] + [sampled(3)] + [mates[2][1]]
    batched = llama_llm.generate(prompts, params)
    assert samples(batched[2]) == samples(alone)


def test_the_sampler_keys_samples_by_index_not_by_seed_offset():
    """Rows of seed s, sample i against seed s+1, sample i-1, on flat logits (every token equally likely)."""
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(2 * 64, 1000)
    rows = []
    for seed in range(64):
        rows.append(SamplingRow(params, seed, 0, [1], [], sample_index=1))
        rows.append(SamplingRow(params, seed + 1, 0, [1], [], sample_index=0))
    tokens = sample(logits, rows).token_ids
    matches = sum(a == b for a, b in zip(tokens[0::2], tokens[1::2]))
    assert matches <= 2  # independent draws from 1000 tokens agree about 64/1000 times in 64 pairs
