"""Speculative decoding on the tiny random Llama: whatever a drafter proposes — the model's own continuation,
random tokens, a mix — the output is the output without speculation, token for token (greedy and seeded
sampling, penalties, logprobs, stop strings, max_tokens, grammars, a KV pool small enough to preempt), the
rejected tokens' blocks go back to the pool, and what cannot be served is refused with a typed error."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError, InvalidRequestError
from autodeploy.runtime.speculation_costs import (DraftingTimes, ObservedSteps, StepCosts, best_num_tokens, expected_tokens,
                                                  measure_step_costs)
from autodeploy.runtime.speculative import SpeculationStats, accepted_prefix, lookup, register_drafter
from tests.runtime.test_engine import hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model

# The scripted drafter's proposals: a function (sequences, limits) -> drafts that each test sets.
SCRIPT = {"propose": lambda sequences, limits: [[] for _ in sequences]}


@register_drafter("test_scripted")
def _scripted(deployment, settings):
    return lambda sequences, limits: SCRIPT["propose"](sequences, limits)


def random_drafts(seed: int, vocab: int = 512):
    rng = random.Random(seed)
    return lambda sequences, limits: [[rng.randrange(vocab) for _ in range(rng.randint(0, k))] for k in limits]


def oracle_drafts(expected: dict[tuple, list[int]], error_rate: float = 0.0, seed: int = 0):
    """The continuation each prompt is known to get, a token wrong now and then."""
    rng = random.Random(seed)

    def propose(sequences, limits):
        drafts = []
        for sequence, limit in zip(sequences, limits):
            prompt = tuple(sequence.request.prompt_token_ids)
            done = len(sequence.output_token_ids)
            draft = list(expected.get(prompt, [])[done : done + limit])
            drafts.append([t if rng.random() >= error_rate else (t + 1) % 512 for t in draft])
        return drafts

    return propose


def staggered_outputs(engine, prompts, params, waves: int) -> list:
    """Each prompt's completion when the requests arrive in ``waves`` a step apart (prompt chunks and verification
    chunks then share steps), in prompt order."""
    requests = []
    for wave in range(waves):
        requests += [engine.add_request(p, s) for p, s in zip(prompts[wave::waves], params[wave::waves])]
        engine.step()
    while engine.has_unfinished():
        engine.step()
    by_prompt = {tuple(r.prompt_token_ids): r.output(None).outputs[0] for r in requests}
    return [by_prompt[tuple(p)] for p in prompts]


@pytest.fixture(scope="module")
def spec_llm(llama_dir):
    """The tiny Llama with the scripted drafter, 4 tokens a step, and a pool of 40 blocks (640 tokens)."""
    return autodeploy(str(llama_dir), device="cpu", verify={"enabled": False}, kv_cache={"num_blocks": 40},
                      speculative={"method": "test_scripted", "num_tokens": 4, "auto": False})


@pytest.fixture(autouse=True)
def _no_script():
    yield
    SCRIPT["propose"] = lambda sequences, limits: [[] for _ in sequences]


def _lookup_by_definition(tokens, limit, smallest, largest):
    for n in range(min(largest, len(tokens) - 1), smallest - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):  # the latest earlier occurrence of the last n tokens
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + limit]
    return []


def test_vectorised_lookup_equals_its_definition():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        smallest = rng.randint(1, 4)
        largest, limit = rng.randint(smallest, 5), rng.randint(1, 5)
        assert lookup(tokens, limit, smallest, largest) == _lookup_by_definition(tokens, limit, smallest, largest)


def test_lookup_and_accepted_prefix():
    assert lookup([1, 2, 3, 9, 1, 2], 3, 1, 2) == [3, 9, 1]
    assert lookup([1, 2, 3, 9, 1, 2], 1, 1, 2) == [3]
    assert lookup([5, 1, 7, 1], 4, 1, 3) == [7, 1]  # the latest earlier occurrence of [1]
    assert lookup([1, 2, 3], 4, 1, 3) == []
    assert lookup([4], 4, 1, 3) == []
    assert accepted_prefix([5, 6, 7], [5, 6, 8, 9]) == 2
    assert accepted_prefix([5, 6], [4, 6, 1]) == 0
    assert accepted_prefix([5, 6], [5, 6, 1]) == 2
    stats = SpeculationStats()
    stats.record(4, 2)
    stats.record(2, 0)
    assert (stats.drafted, stats.accepted, stats.accepted_at, stats.drafted_at) == (6, 2, [1, 1], [2, 2, 1, 1])
    assert stats.acceptance_length == 2.0 and stats.acceptance_rate == pytest.approx(1 / 3)
    # Per token: 2 accepted of the 4 the model decided on (2, then a refusal; a refusal); the draft's last 3 unjudged.
    assert stats.rejected == 2 and stats.per_token_acceptance == pytest.approx(2 / 4)
    stats.record(3, 3)  # a whole draft: every token judged and accepted
    assert stats.per_token_acceptance == pytest.approx(5 / 7)


def test_the_threshold_as_run_weighs_the_observed_steps():
    """Without observations it is the set-up's; a decoding step that ran in half its forward's time and a drafting
    step's host work of half a second make even a whole accepted draft lose (never)."""
    from autodeploy.runtime.speculation_costs import StepCosts
    from autodeploy.runtime.speculative import Speculator

    speculator = Speculator(lambda sequences, limits: [], 4, None, 10, costs=StepCosts((1,), (1.0,), (2.0,), 4))
    assert speculator.threshold_as_run(1) == speculator.costs.threshold(1) and 0.5 < speculator.threshold_as_run(1) < 0.6
    speculator.observed.observe(1, False, 0.5, 0.0)
    speculator.observed.observe(1, True, 2.5, 2.0)
    assert speculator.threshold_as_run(1) is None
    assert Speculator(lambda sequences, limits: [], 4, None, 10).threshold_as_run(1) is None  # auto off


def test_a_sequences_expected_acceptance_counts_only_the_tokens_the_model_judged(llama_dir):
    """Drafts of 5 that keep 3 (3 accepted, the fourth refused: 0.75 a judged token): the estimate is 0.75, where
    accepted ÷ drafted (0.6: the unjudged fifth counted as refused) would keep ``auto`` from drafting where it pays."""
    speculator = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False}, kv_cache={"num_blocks": 8},
                            speculative={"method": "ngram", "num_tokens": 5}).engine.speculator
    for _ in range(200):
        speculator.record(5, 3)
    sequence = fresh_sequence()
    for _ in range(200):
        sequence.judged(5, 3)
    assert speculator.acceptance(sequence) == pytest.approx(0.75)
    assert speculator.acceptance(fresh_sequence()) == pytest.approx(0.75)  # the overall
    assert speculator.stats.acceptance_rate == pytest.approx(0.6)


def fresh_sequence():
    from types import SimpleNamespace

    from autodeploy.runtime.request import Sequence

    return Sequence(SimpleNamespace(), [1, 2], index=0)


def test_a_sequences_expected_acceptance_follows_its_recent_drafts_and_is_forgotten_after_probe_steps(llama_dir):
    """Acceptance comes in runs (a copied passage, then new text): a sample's estimate follows its last few drafts,
    and once it has not drafted for PROBE decode steps it is expected to do as the drafter does overall — else a
    sample whose early drafts failed would never draft again, however well it would do later."""
    from autodeploy.runtime.speculative import PROBE

    speculator = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False}, kv_cache={"num_blocks": 8},
                            speculative={"method": "ngram", "num_tokens": 4}).engine.speculator
    for _ in range(100):
        speculator.record(4, 2)  # overall: 2 kept, the third refused: 2/3 a judged token
    sequence = fresh_sequence()
    for _ in range(20):
        sequence.judged(4, 0)  # a bad start …
    assert speculator.acceptance(sequence) < 0.2
    for _ in range(4):
        sequence.judged(4, 4)  # … then four whole drafts kept
    assert speculator.acceptance(sequence) > 0.75  # cumulative counts would say 16 of 36 judged: 0.44
    for _ in range(20):
        sequence.judged(4, 0)
    sequence.decodes_since_draft = PROBE - 1
    assert speculator.acceptance(sequence) < 0.2
    sequence.decodes_since_draft = PROBE
    assert speculator.acceptance(sequence) == pytest.approx(2 / 3)


@pytest.mark.parametrize("drafter", ["random", "oracle with errors"])
def test_greedy_output_is_the_output_without_speculation_under_preemption(spec_llm, llama_llm, drafter):
    prompts = random_prompts(24, seed=5, lengths=(1, 120))
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=True) for _ in prompts]
    expected = [o.token_ids for o in llama_llm.generate(prompts, params)]
    continuation = {tuple(p): e for p, e in zip(prompts, expected)}
    SCRIPT["propose"] = random_drafts(7) if drafter == "random" else oracle_drafts(continuation, error_rate=0.2)
    before = _stats(spec_llm)
    engine = spec_llm.engine
    assert [o.token_ids for o in staggered_outputs(engine, prompts, params, waves=4)] == expected
    hf = tiny_hf_model("llama")
    for prompt, tokens in list(zip(prompts, expected))[:3]:
        assert hf_greedy(hf, prompt, len(tokens)) == tokens
    after = _stats(spec_llm)
    assert after.accepted > before.accepted and after.drafted - after.accepted > before.drafted - before.accepted
    assert engine.pool.num_used_blocks == 0, "every block goes back once the requests finish"


def test_seeded_sampling_penalties_logprobs_and_stop_strings_match(spec_llm, llama_llm):
    prompts = ["def f(x):", "import os", "class A:", "x = [1, 2"]
    params = [
        SamplingParams(max_tokens=30, temperature=0.9, seed=11, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, top_k=20, seed=12, repetition_penalty=1.3,
                       presence_penalty=0.5),
        SamplingParams(max_tokens=30, temperature=0, stop=["e"], frequency_penalty=0.4),
        SamplingParams(max_tokens=25, temperature=1.0, seed=13, n=2),
    ]
    expected = llama_llm.generate(prompts, params)
    SCRIPT["propose"] = oracle_drafts({tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in expected}, 0.3, seed=2)
    got = spec_llm.generate(prompts, params)
    for want, have in zip(expected, got):
        for a, b in zip(want.outputs, have.outputs):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            if a.logprobs is not None:
                assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
                assert [list(t) for t in b.top_logprobs] == [list(t) for t in a.top_logprobs]


def test_grammar_masks_apply_to_drafted_positions(spec_llm, llama_llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
    params = SamplingParams(max_tokens=60, temperature=0, json_schema=schema)
    (expected,) = llama_llm.generate(["def f(x):"], params)
    tokenizer = spec_llm.tokenizer
    quote, brace = tokenizer.convert_tokens_to_ids('"'), tokenizer.convert_tokens_to_ids("{")
    # Proposals the grammar refuses (cut before verification) and ones it allows but the model does not pick.
    SCRIPT["propose"] = lambda sequences, limits: [[brace, quote, quote][:k] for k in limits]
    (got,) = spec_llm.generate(["def f(x):"], params)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].text.startswith('{"a": ')  # (the random model runs out of tokens inside the integer)


def test_sampled_tokens_follow_the_models_distribution(spec_llm, llama_llm):
    """400 seeds at temperature 0.15, the second output token drafted as the likeliest after the first: each seed
    draws what it draws without speculation, and how often the drafted token (and the next likeliest) comes
    matches the model's probabilities within four standard deviations (a seeded run: the figures are fixed)."""
    prompt = [5, 17, 33, 5, 17]
    params = [SamplingParams(max_tokens=3, temperature=0.15, seed=seed, ignore_eos=True) for seed in range(400)]
    without = [o.outputs[0].token_ids for o in llama_llm.generate([prompt] * 400, params)]
    distribution = {}  # first output token → the model's distribution of the second
    for first in {tokens[0] for tokens in without}:
        distribution[first] = torch.softmax(llama_llm.engine.prompt_logits(prompt + [first])[-1].float() / 0.15, -1)

    def likeliest(sequence, rank=0):
        return int(distribution[sequence.output_token_ids[0]].topk(rank + 1).indices[rank])

    SCRIPT["propose"] = lambda sequences, limits: [[likeliest(s)][:k] if len(s.output_token_ids) == 1 else []
                                                    for s, k in zip(sequences, limits)]
    before = _stats(spec_llm)
    sampled = [o.outputs[0].token_ids for o in spec_llm.generate([prompt] * 400, params)]
    assert sampled == without
    after = _stats(spec_llm)
    assert after.drafted - before.drafted == 400
    for rank in (0, 1):
        ranked = [int(distribution[t[0]].topk(rank + 1).indices[rank]) for t in sampled]
        observed = sum(t[1] == token for t, token in zip(sampled, ranked))
        probabilities = [float(distribution[t[0]][token]) for t, token in zip(sampled, ranked)]
        expected, spread = sum(probabilities), math.sqrt(sum(p * (1 - p) for p in probabilities))
        assert abs(observed - expected) <= 4 * spread + 1, (rank, observed, expected)
        if rank == 0:
            assert after.accepted - before.accepted == observed


def test_ngram_drafts_from_the_prompt_and_changes_nothing(llama_dir, llama_llm):
    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "ngram", "num_tokens": 3, "auto": False})
    prompts = [[7, 8, 9, 10, 11, 12] * 6, random_prompts(1, seed=3, lengths=(40, 40))[0]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in llama_llm.generate(prompts, params)]
    stats = llm.engine.speculator.stats
    assert stats.drafted > 0 and stats.steps > 0


def test_a_draft_model_with_the_models_weights_is_always_right(llama_dir):
    llm = autodeploy(str(llama_dir), device="cpu", speculative={"method": "draft", "model": str(llama_dir), "num_tokens": 3,
                                                                 "auto": False})
    prompts = random_prompts(3, seed=9, lengths=(5, 60))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    hf = tiny_hf_model("llama")
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 20) for p in prompts]
    stats = llm.engine.speculator.stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted
    assert llm.deployment.draft is not None and llm.deployment.draft.report.verification is not None


def test_a_saved_deployment_with_a_draft_model_builds_its_draft_again_at_reload(llama_dir, tmp_path):
    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "draft", "model": str(llama_dir), "num_tokens": 2, "auto": False,
                                  "options": {"verify": {"enabled": False}}})
    directory = llm.save(tmp_path / "saved")
    reloaded = autodeploy(str(directory))
    assert reloaded.deployment.draft is not None and reloaded.settings.speculative.method == "draft"
    prompts, params = [[9, 8, 7, 6, 5]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert reloaded.generate(prompts, params)[0].token_ids == llm.generate(prompts, params)[0].token_ids
    assert reloaded.engine.speculator.stats.accepted == reloaded.engine.speculator.stats.drafted > 0


def test_bad_settings_and_requests_are_refused_with_the_fix(llama_dir, tiny_checkpoint, tmp_path, spec_llm):
    with pytest.raises(InvalidRequestError, match="beam search .* does not combine with speculative"):
        spec_llm.generate(["def f"], SamplingParams(max_tokens=4, beam_width=2, temperature=0))
    for speculative, message in [
        ({"method": "ngram", "num_tokens": 0}, "num_tokens must be in 1"),
        ({"method": "ngram", "num_tokens": 99}, "num_tokens must be in 1"),
        ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min"),
        ({"method": "eagle9"}, "registered drafters are .*ngram"),
        ({"method": "draft"}, "speculative.model is not set"),
    ]:
        with pytest.raises(ConfigError, match=message):
            autodeploy(str(llama_dir), device="cpu", speculative=speculative)
    with pytest.raises(ConfigError, match="runs on one rank"):
        autodeploy(str(llama_dir), device="cpu", tensor_parallel=2, speculative={"method": "ngram"})
    other = tmp_path / "other-tokenizer"
    shutil.copytree(llama_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    (a, ia), (b, ib) = list(vocab.items())[300:302]
    vocab[a], vocab[b] = ib, ia
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="another tokenizer"):
        autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                   speculative={"method": "draft", "model": str(other), "options": {"verify": {"enabled": False}}})


def test_a_drafter_that_breaks_its_contract_fails_its_requests_clearly(spec_llm):
    SCRIPT["propose"] = lambda sequences, limits: [[10**6] for _ in sequences]
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        spec_llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0))
    SCRIPT["propose"] = lambda sequences, limits: []
    with pytest.raises(RuntimeError, match="returned 0 drafts for 1"):
        spec_llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0))
    SCRIPT["propose"] = lambda sequences, limits: [[] for _ in sequences]
    assert spec_llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
    assert spec_llm.engine.pool.num_used_blocks == 0


def test_a_saved_deployment_serves_with_speculation_turned_on_at_reload(llama_llm, tmp_path):
    directory = llama_llm.save(tmp_path / "saved")
    llm = autodeploy(str(directory), speculative={"method": "ngram", "num_tokens": 2, "auto": False})
    prompts = [[3, 4, 5, 6] * 8]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert llm.generate(prompts, params)[0].token_ids == llama_llm.generate(prompts, params)[0].token_ids
    assert llm.engine.speculator.stats.drafted > 0


def _stats(llm) -> SpeculationStats:
    stats = llm.engine.speculator.stats
    return SpeculationStats(stats.steps, stats.drafted, stats.accepted)



def test_metrics_and_token_times_count_every_accepted_token(spec_llm, llama_llm):
    from autodeploy.serve.request_metrics import engine_state

    prompts = random_prompts(2, seed=4, lengths=(10, 30))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = llama_llm.generate(prompts, params)
    SCRIPT["propose"] = oracle_drafts({tuple(o.prompt_token_ids): o.token_ids for o in expected})
    before = _stats(spec_llm)
    outputs = spec_llm.generate(prompts, params)
    assert all(len(o.metrics.token_times) == 12 for o in outputs)  # one time per token, several per step
    values = {value.name: value.value for value in engine_state(spec_llm.engine)}
    stats = spec_llm.engine.speculator.stats
    assert values["autodeploy_spec_decode_num_accepted_tokens"] == stats.accepted > 0
    assert stats.accepted - before.accepted == stats.drafted - before.drafted > 0  # the oracle is always right
    assert values["autodeploy_spec_decode_acceptance_length"] == stats.acceptance_length > 1
    assert values["autodeploy_spec_decode_acceptance_rate_at_0"] == stats.accepted_at[0] / stats.drafted_at[0]
    report = spec_llm.pipeline_report()
    assert "speculative decoding: 'test_scripted', up to 4 tokens a step" in report and "accepted by position: 1: " in report


@pytest.fixture(scope="module")
def gpu_spec_llm(llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return autodeploy(str(llama_dir), device="cuda", dtype="float32", kv_cache={"num_blocks": 64},
                      speculative={"method": "test_scripted", "num_tokens": 4, "auto": False})


def test_on_the_gpu_verification_through_captured_graphs_changes_no_token(gpu_spec_llm, gpu_llama_llm):
    prompts = random_prompts(12, seed=8, lengths=(1, 90))
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)]
    for param in params:
        expected = gpu_llama_llm.generate(prompts, param)
        SCRIPT["propose"] = oracle_drafts({tuple(o.prompt_token_ids): o.token_ids for o in expected}, 0.25, seed=1)
        assert [o.token_ids for o in gpu_spec_llm.generate(prompts, param)] == [o.token_ids for o in expected]
    SCRIPT["propose"] = random_drafts(3)
    expected = gpu_llama_llm.generate(prompts, params[0])
    assert [o.token_ids for o in gpu_spec_llm.generate(prompts, params[0])] == [o.token_ids for o in expected]
    assert gpu_spec_llm.engine.pool.num_used_blocks == 0


def test_the_cost_model_drafts_only_what_pays():
    costs = StepCosts(batch_sizes=(1, 8), decode=(1.0, 1.2), verify=(1.5, 4.8), num_tokens=4)
    assert costs.seconds(1, 0) == 1.0 and costs.seconds(1, 4) == 1.5 and costs.seconds(1, 2) == 1.25
    assert costs.seconds(4, 0) == pytest.approx(1.0 + 0.2 * 3 / 7) and costs.seconds(16, 4) == pytest.approx(9.6)
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5 and expected_tokens(0.5, 2) == 1.75
    assert best_num_tokens(costs, [0.9], 4) == 4  # 4.1 tokens for 1.5× the time
    assert best_num_tokens(costs, [0.05], 4) == 0  # 1.05 tokens for 1.1× the time at best
    assert best_num_tokens(costs, [0.9] * 8, 4) == 1  # at 8 a whole draft costs 4×; one token (1.9 for 1.75×) pays
    assert best_num_tokens(costs, [0.5] * 8, 4) == 0
    assert best_num_tokens(costs, [], 4) == 0
    assert costs.threshold(1) == pytest.approx(0.369, abs=1e-3)  # 1 + a + … + a⁴ = 1.05 × 1.5
    assert costs.threshold(8) == pytest.approx(0.913, abs=1e-3)  # = 1.05 × 4
    assert StepCosts((1,), (1.0,), (6.0,), 4).threshold(1) is None  # five tokens cannot pay for six steps
    assert best_num_tokens(costs, [0.9], 4, drafting=0.5) == 1  # a slow drafter: 1.9 tokens for 2.125× (4 cost 3.5×)
    assert best_num_tokens(costs, [0.9], 4, drafting=2.0) == 0
    times = DraftingTimes(weight=0.5)
    assert times.per_position(8) == 0.0
    times.observe(8, 4, 4.0)  # 1 s a position at batch 8
    times.observe(7, 2, 4.0)  # 2 s a position: the average moves half way
    times.observe(1, 0, 9.0)  # nothing drafted: nothing learnt
    assert times.per_position(8) == 1.5 and times.per_position(5) == 1.5 and times.per_position(64) == 1.5
    # Steps as they ran: a drafting step's host work on top of its forward, a decoding step's wall time.
    assert best_num_tokens(costs, [0.9], 4, overhead=3.0) == 0  # 4.1 tokens for 4.5× the time
    assert best_num_tokens(costs, [0.9], 4, overhead=0.5) == 4  # 4.1 for 2×
    assert best_num_tokens(costs, [0.9], 4, overhead=0.5, decoding=0.4) == 0  # decoding overlapped: 2.5 tokens a second
    observed = ObservedSteps(weight=0.5)
    assert observed.decoding_seconds(4) is None and observed.overhead_seconds(4) == 0.0
    observed.observe(4, drafted=True, seconds=3.0, predicted=2.0)
    observed.observe(3, drafted=True, seconds=4.0, predicted=1.0)
    observed.observe(4, drafted=True, seconds=1.0, predicted=2.0)  # faster than predicted: no overhead
    observed.observe(4, drafted=False, seconds=0.5, predicted=0.0)
    assert observed.overhead_seconds(4) == 1.0 and observed.decoding_seconds(2) == 0.5


def test_auto_speculation_turns_itself_off_where_the_step_costs_say_it_loses(llama_dir, llama_llm, monkeypatch):
    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "test_scripted", "num_tokens": 4})
    speculator = llm.engine.speculator
    measured = speculator.costs  # timed at set-up on this machine: its figures are not asserted
    assert measured.batch_sizes[0] == 1 and len(measured.decode) == len(measured.verify) == len(measured.batch_sizes)
    assert all(seconds > 0 for seconds in measured.decode + measured.verify) and llm.engine.pool.num_used_blocks == 0
    prompts = random_prompts(4, seed=6, lengths=(5, 40))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llama_llm.generate(prompts, params)]
    SCRIPT["propose"] = oracle_drafts({tuple(p): e for p, e in zip(prompts, expected)})
    monkeypatch.setattr(speculator, "step_took", lambda seconds: None)  # the costs alone decide here (see below)
    speculator.costs = StepCosts((1, 64), (1.0, 1.0), (100.0, 100.0), 4)  # verification never pays
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert speculator.stats.drafted == 0 and not speculator.drafting
    speculator.costs = StepCosts((1, 64), (1.0, 64.0), (3.2, 204.8), 4)  # drafts pay at 0.8 a token, not at 0.5
    assert best_num_tokens(speculator.costs, [0.5], 4) == 0 and best_num_tokens(speculator.costs, [0.8], 4) > 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert speculator.stats.drafted > 0  # tried (the hopeful start), and an always-right drafter keeps drafting
    first = speculator.stats.drafted
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert speculator.stats.drafted > first and speculator.stats.accepted == speculator.stats.drafted


def generate_where_host_work_makes_drafting_lose(llama_dir, llama_llm, monkeypatch, max_tokens: int):
    """Generate ``max_tokens`` greedily with an always-right drafter where the set-up's forwards say drafting pays but
    the steps as they ran say a drafting step takes 6 s against a decoding step's 1 s; the tokens are checked against
    the engine without speculation. Returns the speculator."""
    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "test_scripted", "num_tokens": 4})
    speculator = llm.engine.speculator
    prompt = random_prompts(1, seed=8, lengths=(20, 20))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llama_llm.generate(prompt, params)]
    SCRIPT["propose"] = oracle_drafts({tuple(prompt[0]): expected[0]})
    speculator.costs = StepCosts((1, 64), (1.0, 64.0), (1.5, 96.0), 4)  # whole drafts pay from an acceptance of 0.37
    took = speculator.step_took
    monkeypatch.setattr(speculator, "step_took", lambda seconds: took(6.0 if speculator.drafting else 1.0))
    assert [o.token_ids for o in llm.generate(prompt, params)] == expected
    return speculator


def test_auto_weighs_the_steps_as_they_ran_and_stops_drafting_where_host_work_makes_it_lose(llama_dir, llama_llm,
                                                                                           monkeypatch):
    """By the forwards timed at set-up drafting pays; the engine's steps say a drafting step takes 6 s against a
    decoding step's 1 s (their host work): after one observed drafting step, auto drafts no more."""
    speculator = generate_where_host_work_makes_drafting_lose(llama_dir, llama_llm, monkeypatch, max_tokens=24)
    assert speculator.stats.steps == 2  # the first drafting step is not timed (the step before it held the prompt)
    assert speculator.observed.overhead_seconds(1) == pytest.approx(4.5, abs=0.1)  # 6 s − 1.5 s, less drafting
    assert speculator.observed.decoding_seconds(1) == 1.0 and not speculator.drafting
    assert "batch ≤1 as run: decoding step 1000.00 ms, a drafting step's host work 4" in speculator.describe()


def test_auto_revisits_drafting_after_a_slow_first_call_rather_than_never_drafting_again(llama_dir, llama_llm,
                                                                                         monkeypatch):
    """A drafter's first call was slow (a kernel compiled, say): by that estimate drafting never pays, and a state that
    never drafts never measures drafting again. After REVISIT steps without drafts auto drafts two steps anyway, takes
    their costs as its estimates, and drafts on."""
    from autodeploy.runtime.speculative import REVISIT

    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "test_scripted", "num_tokens": 4})
    speculator = llm.engine.speculator
    prompt = random_prompts(1, seed=9, lengths=(10, 10))
    params = SamplingParams(max_tokens=REVISIT + 24, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llama_llm.generate(prompt, params)]
    SCRIPT["propose"] = oracle_drafts({tuple(prompt[0]): expected[0]})
    monkeypatch.setattr(speculator, "step_took", lambda seconds: None)  # the costs and drafting times alone decide
    speculator.costs = StepCosts((1, 64), (1.0, 64.0), (1.5, 96.0), 4)  # whole drafts pay from an acceptance of 0.37
    speculator.drafting_times.observe(1, 1, 1000.0)  # one slow first call: 1000 s a drafted position
    assert best_num_tokens(speculator.costs, [0.8], 4, speculator.drafting_times.per_position(1)) == 0
    assert [o.token_ids for o in llm.generate(prompt, params)] == expected
    assert speculator.stats.drafted > 0 and speculator.drafting_times.per_position(1) < 1.0
    assert speculator.stats.steps > 2  # drafting went on after the revisit's two steps


def test_auto_drafts_again_for_a_sequence_whose_early_drafts_failed(llama_dir, llama_llm, monkeypatch):
    """A drafter wrong for a sequence's first 24 tokens, right after (a passage it can copy begins): auto stops
    drafting the sequence early on, probes it every PROBE steps, and drafts on once the probes are kept — well within
    the 64 steps after which auto's revisits would come."""
    llm = autodeploy(str(llama_dir), device="cpu", verify={"enabled": False},
                     speculative={"method": "test_scripted", "num_tokens": 4})
    speculator = llm.engine.speculator
    prompt = random_prompts(1, seed=4, lengths=(10, 10))
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llama_llm.generate(prompt, params)]
    oracle = oracle_drafts({tuple(prompt[0]): expected[0]})

    def propose(sequences, limits):
        right = oracle(sequences, limits)
        return [draft if len(s.output_token_ids) >= 24 else [(t + 1) % 512 for t in draft] for s, draft in zip(sequences, right)]

    SCRIPT["propose"] = propose
    monkeypatch.setattr(speculator, "step_took", lambda seconds: None)  # the costs alone decide
    speculator.costs = StepCosts((1, 64), (1.0, 64.0), (3.0, 192.0), 4)  # drafts pay from an acceptance of ~0.58
    assert [o.token_ids for o in llm.generate(prompt, params)] == expected
    # The probes at outputs 1, 10, 19 fail, the one at 28 is kept and drafting goes on (each estimate growing from its
    # last drafts); cumulative counts (3 refusals early) would keep it at a draft every PROBE steps.
    assert speculator.stats.accepted >= 12 and speculator.stats.rejected <= 4


def test_revisits_that_find_drafting_still_losing_wait_twice_as_long_each_time(llama_dir, llama_llm, monkeypatch):
    """Host work makes every drafting step lose (6 s against 1 s, as in the test above): drafting stops after its first
    two steps, is revisited for two steps after REVISIT idle steps, then after twice that — 6 drafting steps in 300
    tokens, not one revisit every REVISIT steps (64 here, for a short test)."""
    import autodeploy.runtime.speculative as speculative

    REVISIT = 64
    monkeypatch.setattr(speculative, "REVISIT", REVISIT)
    speculator = generate_where_host_work_makes_drafting_lose(llama_dir, llama_llm, monkeypatch, max_tokens=300)
    assert REVISIT + 2 * REVISIT + 6 * 5 < 300 < REVISIT * (1 + 2 + 4)  # the third revisit would come after 448 steps
    assert speculator.stats.steps == 6 and not speculator.drafting


def test_step_costs_are_timed_on_the_engines_own_runner_and_give_its_blocks_back(spec_llm):
    engine = spec_llm.engine
    costs = measure_step_costs(engine.runner, [1, 3], num_tokens=2, context=20, repeats=1)
    assert costs.batch_sizes == (1, 3) and costs.num_tokens == 2 and min(costs.decode + costs.verify) > 0
    assert engine.pool.num_used_blocks == 0


def test_verification_steps_run_on_static_padded_rows_like_captured_graphs(llama_dir, llama_llm, monkeypatch):
    """On the CPU the verification graphs run eagerly on the static inputs a GPU replays: drafts shorter than K,
    decodes without a draft and padded batch rows share them, and the tokens are those without speculation."""
    import dataclasses

    from autodeploy.runtime.engine import Engine
    from autodeploy.runtime.verify_graphs import VerifyGraphs

    llm = autodeploy(str(llama_dir), device="cpu", max_batch_size=8, verify={"enabled": False},
                     speculative={"method": "test_scripted", "num_tokens": 3, "auto": False})
    signature = dataclasses.replace(llm.deployment.signature, decode_graph_batch_sizes=(1, 4, 8), prefill_graph_token_sizes=())
    engine = Engine(dataclasses.replace(llm.deployment, signature=signature, eos_token_ids=()))
    llm._engine = engine
    assert engine.runner.verify_graphs is not None and engine.runner.verify_graphs.sizes == [1, 4, 8]
    replayed = []
    replay = VerifyGraphs.replay
    monkeypatch.setattr(VerifyGraphs, "replay", lambda self, size, keep: replayed.append((size, len(keep))) or replay(self, size, keep))
    prompts = random_prompts(7, seed=12, lengths=(1, 40))
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(7)]
    expected = [o.token_ids for o in llama_llm.generate(prompts, params)]
    SCRIPT["propose"] = oracle_drafts({tuple(p): e for p, e in zip(prompts, expected)}, error_rate=0.3, seed=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert {size for size, _ in replayed} >= {8} and any(kept < size * 4 for size, kept in replayed)
    SCRIPT["propose"] = random_drafts(5)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert engine.pool.num_used_blocks == 0
    # The check a GPU runs after capture: a real verification step (here eager against eager), blocks given back.
    with torch.inference_mode():
        engine.runner._check_verify_graphs(engine.runner.verify_graphs)
    assert engine.pool.num_used_blocks == 0


def test_auto_hands_the_drafter_non_drafting_steps_wherever_a_draft_could_pay():
    """A step of decodes alone that drafts nothing is observed at a batch size where a draft can pay (a head that
    missed it would draft the next time from a gap, fail, and teach auto that drafting loses), and skipped where not
    even HOPELESS acceptance would pay."""
    from types import SimpleNamespace

    from autodeploy.runtime.scheduler import ScheduledChunk
    from autodeploy.runtime.speculation_costs import StepCosts
    from autodeploy.runtime.speculative import Speculator

    seen = []

    class Drafter:
        def __call__(self, sequences, limits):
            return [[] for _ in sequences]

        def observe(self, chunks, rows, hidden):
            seen.append(len(chunks))

    # batch 1: whole drafts pay from ~0.37 a token; batch 64: a draft of 4 tokens costs what 6 decoding steps do
    costs = StepCosts((1, 64), (1.0, 1.0), (1.5, 6.0), 4)
    speculator = Speculator(Drafter(), 4, None, 10, costs=costs)
    decodes = [ScheduledChunk(SimpleNamespace(seq_id=i), 5, 1) for i in range(64)]
    speculator.drafting = False
    speculator.observe(decodes[:1], [0], torch.zeros(1, 4))
    speculator.observe(decodes, list(range(64)), torch.zeros(64, 4))
    assert seen == [1]
    speculator.drafting = True  # a drafting step is always observed
    speculator.observe(decodes, list(range(64)), torch.zeros(64, 4))
    assert seen == [1, 64]
