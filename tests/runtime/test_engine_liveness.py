"""Requests always finish: ``n`` samples whose first token ends them, and beam search, mixed samples and
aborts in a pool too small for them all (preemption between a beam's logits and its group's step)."""

from __future__ import annotations

import random
import threading

import pytest

from autodeploy import SamplingParams, autodeploy
from tests.runtime.test_engine import random_prompts


def generate_within(llm, prompts, params, timeout: float = 60.0):
    """``llm.generate`` in a thread: its outputs, or a failure once ``timeout`` passes (a hang)."""
    result: dict = {}

    def run() -> None:
        try:
            result["outputs"] = llm.generate(prompts, params)
        except BaseException as error:  # reported below, in the test's thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"generate did not finish within {timeout:.0f} s (engine: {len(llm.engine.requests)} requests left)"
    if "error" in result:
        raise result["error"]
    return result["outputs"]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_n_samples_whose_first_token_is_eos_finish(llama_llm, n, sampled):
    eos = min(llama_llm.engine.eos_token_ids)
    temperature = dict(temperature=0.7, seed=3) if sampled else dict(temperature=0)
    params = SamplingParams(n=n, logit_bias={eos: 100}, max_tokens=5, **temperature)
    [output] = generate_within(llama_llm, [[5, 6, 7]], params)
    assert output.finished and len(output.outputs) == n
    assert [c.finish_reason for c in output.outputs] == ["stop"] * n
    assert [c.index for c in output.outputs] == list(range(n))
    assert not llama_llm.engine.has_unfinished() and llama_llm.engine.pool.num_used_blocks == 0


def test_n_samples_where_only_the_first_stops_at_once(llama_llm):
    """Sample 0 ends on its first token while the others go on to max_tokens."""
    eos = min(llama_llm.engine.eos_token_ids)
    params = SamplingParams(n=3, max_tokens=4, temperature=0, ignore_eos=False, stop_token_ids=[eos])
    unbiased = generate_within(llama_llm, [[9, 10, 11]], SamplingParams(n=3, max_tokens=4, temperature=0))[0]
    assert all(c.finish_reason == "length" or c.token_ids[-1] == eos for c in unbiased.outputs)
    [output] = generate_within(llama_llm, [[9, 10, 11]], params)
    assert output.finished and len(output.outputs) == 3


@pytest.mark.parametrize("seed", [7, 8])
def test_beams_samples_and_aborts_in_a_small_pool_all_finish(llama_dir, seed):
    """~200 requests (beam search among them) through a 40-block pool with 8 seats, some aborted as they run:
    every request ends (finished or aborted), none with an error, and the pool is empty afterwards."""
    llm = autodeploy(str(llama_dir), device="cpu", max_batch_size=8, kv_cache={"num_blocks": 40, "block_size": 16},
                     scheduler={"max_num_tokens": 128})
    engine = llm.engine
    rng = random.Random(seed)
    assert engine.pool.num_blocks == 40
    prompts = random_prompts(200, seed=seed, lengths=(20, 120))
    requests = []
    for i, prompt in enumerate(prompts):
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(8, 40), beam_width=rng.choice([2, 3]), temperature=0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=rng.randint(8, 40), n=rng.choice([1, 2, 3]), temperature=0.8, seed=i)
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=bool(i % 3))
        requests.append(engine.add_request(prompt, params))
    steps = 0
    done = threading.Event()
    failures = []

    def drive() -> None:
        nonlocal steps
        try:
            while engine.has_unfinished() and steps < 5000:
                engine.step()
                steps += 1
                if steps % 5 == 0:  # abort a running or waiting request now and then
                    live = list(engine.requests)
                    if live:
                        engine.abort(rng.choice(live))
        except Exception as error:  # reported in the test's thread
            failures.append(error)
        done.set()

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    thread.join(600)
    assert done.is_set() and not failures, f"after {steps} steps, {len(engine.requests)} requests left; errors: {failures}"
    assert not engine.has_unfinished(), f"{len(engine.requests)} requests never finished in {steps} steps"
    assert engine.scheduler.num_preemptions > 0  # the pool was under pressure
    assert all(r.finished for r in requests)
    assert engine.pool.num_used_blocks == 0 and not engine.scheduler.running and not engine.scheduler.waiting
