"""The overlapped runtime (``scheduler.overlap``): a decode step is planned and launched while the step
before it is in flight, its newest tokens fed from the device. What any request gets must not change:
each case here runs with the overlap on and off over the same engine and compares every output."""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from tests.runtime.test_engine import hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model

GREEDY = dict(temperature=0, ignore_eos=True)


def run(engine, arrivals: list[tuple[int, list[int], SamplingParams]], overlap: bool, abort_at: dict[int, int] | None = None):
    """Step ``engine`` from empty; request ``i`` of ``arrivals`` ``(step, prompt, params)`` joins before
    that step; ``abort_at`` maps a request index to the step before which it is aborted. Returns the
    requests and how many steps left a step in flight."""
    default, engine.overlap = engine.overlap, overlap
    requests, ran_ahead, number = {}, 0, 0
    abort_at = abort_at or {}
    try:
        while number <= max(step for step, _, _ in arrivals) or engine.has_unfinished():
            for index, (step, prompt, params) in enumerate(arrivals):
                if step == number:
                    requests[index] = engine.add_request(prompt, params)
            for index, step in abort_at.items():
                if step == number:
                    engine.abort(requests[index].request_id)
            engine.step()
            ran_ahead += engine._in_flight is not None
            number += 1
        engine.step()  # a step left in flight for rows that had stopped is drained
    finally:
        engine.overlap = default
    assert engine._in_flight is None and engine.pool.num_used_blocks == 0
    return [requests[i] for i in range(len(arrivals))], ran_ahead


def outputs(requests, tokenizer) -> list:
    return [
        [(c.token_ids, c.finish_reason, c.text, c.logprobs) for c in r.output(tokenizer).outputs] for r in requests
    ]


def assert_same(ours: list, theirs: list) -> None:
    """Equal tokens, finish reasons and texts; log-probabilities equal up to float32 rounding."""
    for mine, reference in zip(ours, theirs, strict=True):
        for (tokens, reason, text, logprobs), (tokens_ref, reason_ref, text_ref, logprobs_ref) in zip(mine, reference, strict=True):
            assert (tokens, reason, text) == (tokens_ref, reason_ref, text_ref)
            assert logprobs == pytest.approx(logprobs_ref, abs=1e-5) if logprobs_ref is not None else logprobs is None


def test_greedy_decoding_runs_ahead_and_matches_lockstep(llama_llm):
    prompts = random_prompts(5, seed=21, lengths=(3, 40))
    arrivals = [(0, prompts[0], SamplingParams(max_tokens=9, **GREEDY)), (0, prompts[1], SamplingParams(max_tokens=3, **GREEDY)),
                (2, prompts[2], SamplingParams(max_tokens=7, **GREEDY)), (5, prompts[3], SamplingParams(max_tokens=1, **GREEDY)),
                (6, prompts[4], SamplingParams(max_tokens=12, **GREEDY))]
    lockstep, never = run(llama_llm.engine, arrivals, overlap=False)
    overlapped, ran_ahead = run(llama_llm.engine, arrivals, overlap=True)
    assert never == 0 and ran_ahead > 5
    assert outputs(overlapped, llama_llm.tokenizer) == outputs(lockstep, llama_llm.tokenizer)


def test_seeded_sampling_logprobs_and_stops_match_lockstep(llama_llm):
    """Draws depend on (seed, step), not on when the host learns a token; a sequence that stops on a
    token in flight has a wasted row in the step launched after it, and nothing of it is kept."""
    prompts = random_prompts(4, seed=22, lengths=(4, 30))
    probe = run(llama_llm.engine, [(0, prompts[0], SamplingParams(max_tokens=6, **GREEDY))], overlap=False)[0][0]
    greedy = probe.sequences[0].output_token_ids
    stop_token = greedy[-1]  # the tiny random model repeats itself: it may be the first token too
    stop_at = greedy.index(stop_token)
    arrivals = [
        (0, prompts[0], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_token])),
        (0, prompts[1], SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True)),
        (1, prompts[2], SamplingParams(max_tokens=8, temperature=1.2, min_p=0.05, seed=4, logprobs=2, ignore_eos=True)),
        (3, prompts[3], SamplingParams(max_tokens=5, **GREEDY, logprobs=1)),
    ]
    lockstep, _ = run(llama_llm.engine, arrivals, overlap=False)
    overlapped, ran_ahead = run(llama_llm.engine, arrivals, overlap=True)
    assert ran_ahead > 3
    assert lockstep[0].output(llama_llm.tokenizer).outputs[0].finish_reason == "stop"
    assert len(lockstep[0].sequences[0].output_token_ids) == stop_at + 1
    assert_same(outputs(overlapped, llama_llm.tokenizer), outputs(lockstep, llama_llm.tokenizer))


def test_steps_that_need_their_tokens_on_the_host_do_not_run_ahead(llama_llm):
    """Penalties read every output token, beam search and ``n`` forks rearrange sequences: the step
    after theirs waits for them, and their outputs equal lockstep's."""
    prompts = random_prompts(3, seed=23, lengths=(5, 20))
    arrivals = [
        (0, prompts[0], SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
        (0, prompts[1], SamplingParams(max_tokens=5, beam_width=2, temperature=0, ignore_eos=True)),
        (1, prompts[2], SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=9, ignore_eos=True)),
    ]
    lockstep, _ = run(llama_llm.engine, arrivals, overlap=False)
    overlapped, _ = run(llama_llm.engine, arrivals, overlap=True)
    assert outputs(overlapped, llama_llm.tokenizer) == outputs(lockstep, llama_llm.tokenizer)


def test_aborting_a_request_whose_token_is_in_flight_frees_its_blocks(llama_llm):
    engine = llama_llm.engine
    prompts = random_prompts(2, seed=24, lengths=(20, 30))
    arrivals = [(0, prompts[0], SamplingParams(max_tokens=10, **GREEDY)), (0, prompts[1], SamplingParams(max_tokens=10, **GREEDY))]
    alone, _ = run(engine, arrivals[1:], overlap=False)
    requests, ran_ahead = run(engine, arrivals, overlap=True, abort_at={0: 4})
    assert ran_ahead > 3
    aborted = requests[0].output(llama_llm.tokenizer).outputs[0]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 10
    assert requests[1].output(llama_llm.tokenizer).outputs[0].token_ids == alone[0].output(llama_llm.tokenizer).outputs[0].token_ids


def test_preemption_with_tokens_in_flight_loses_nothing(tiny_checkpoint):
    """A sequence preempted while its newest token is on the device is recomputed with that token."""
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", kv_cache={"num_blocks": 10})
    prompts = random_prompts(6, seed=25, lengths=(30, 45))
    arrivals = [(i // 2, p, SamplingParams(max_tokens=14, **GREEDY)) for i, p in enumerate(prompts)]
    lockstep, _ = run(llm.engine, arrivals, overlap=False)
    preemptions = llm.engine.scheduler.num_preemptions
    overlapped, ran_ahead = run(llm.engine, arrivals, overlap=True)
    assert preemptions > 0 and llm.engine.scheduler.num_preemptions > preemptions and ran_ahead > 0
    assert outputs(overlapped, llm.tokenizer) == outputs(lockstep, llm.tokenizer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_steps_run_ahead_through_the_decode_graphs_and_match_lockstep_and_hf(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cuda", dtype="float32", max_batch_size=8)
    assert llm.engine.runner.decode_graphs is not None
    prompts = random_prompts(6, seed=26, lengths=(3, 60))
    arrivals = [(i, p, SamplingParams(max_tokens=10, **GREEDY)) for i, p in enumerate(prompts[:4])] + [
        (1, prompts[4], SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=5, logprobs=2, ignore_eos=True)),
        (7, prompts[5], SamplingParams(max_tokens=6, temperature=0.7, top_k=8, seed=6, ignore_eos=True)),
    ]
    lockstep, _ = run(llm.engine, arrivals, overlap=False)
    overlapped, ran_ahead = run(llm.engine, arrivals, overlap=True)
    assert ran_ahead > 5
    assert_same(outputs(overlapped, llm.tokenizer), outputs(lockstep, llm.tokenizer))
    hf = tiny_hf_model("llama")
    assert [r.sequences[0].output_token_ids for r in overlapped[:4]] == [hf_greedy(hf, p, 10) for p in prompts[:4]]
