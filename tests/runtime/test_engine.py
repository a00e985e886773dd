"""The serving engine on tiny models: in-flight batching against HF generate, prefix caching,
preemption, chunked prefill, n samples, beam search, priorities, cancellation, bad requests."""

from __future__ import annotations

import random

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import InvalidRequestError
from tests.tiny_models import tiny_hf_model

GREEDY = dict(temperature=0, ignore_eos=True)


def hf_greedy(model, prompt: list[int], max_tokens: int, **kwargs) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs
    )
    return out[0, len(prompt) :].tolist()


def run_staggered(engine, arrivals: list[list[tuple]]) -> list:
    """Add each wave of (prompt, params[, priority]) requests, then step twice; finish everything."""
    requests = []
    for wave in arrivals:
        requests += [engine.add_request(*item) for item in wave]
        for _ in range(2):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return requests


def random_prompts(count: int, seed: int, lengths=(1, 300)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(*lengths))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral"])
def test_64_staggered_requests_match_hf_generate(tiny_checkpoint, arch):
    """Prompts of 1–300 tokens (Mistral's window is 16), mixed params, arriving in waves of 8."""
    llm = autodeploy(str(tiny_checkpoint(arch)), device="cpu", max_batch_size=24, scheduler={"max_num_tokens": 256})
    hf = tiny_hf_model(arch)
    prompts = random_prompts(64, seed=1)
    params = []
    for i in range(64):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=1 + i % 7, **GREEDY))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=5, repetition_penalty=1.5, **GREEDY))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, min_p=0.05, seed=i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=4, temperature=0.7, top_k=20, presence_penalty=0.5, seed=i, ignore_eos=True))
    engine = llm.engine
    waves = [[(prompts[j], params[j]) for j in range(w, w + 8)] for w in range(0, 64, 8)]
    requests = run_staggered(engine, waves)
    outputs = [r.output(llm.tokenizer) for r in requests]
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outputs)):
        assert out.finished and len(out.token_ids) == p.max_tokens, i
        if p.temperature == 0:
            expected = hf_greedy(hf, prompt, p.max_tokens, repetition_penalty=p.repetition_penalty)
            assert out.token_ids == expected, f"request {i} ({len(prompt)} prompt tokens)"
    # Sampled requests draw the same tokens when run alone: seeds are per request, not per batch.
    for i in (2, 3, 30, 63):
        assert llm.generate([prompts[i]], params[i])[0].token_ids == outputs[i].token_ids
    assert engine.pool.num_used_blocks == 0 and not engine.scheduler.running and not engine.scheduler.waiting


def test_prefix_cache_hits_and_gives_identical_outputs(tiny_checkpoint):
    directory = str(tiny_checkpoint("llama"))
    shared = random_prompts(1, seed=2, lengths=(100, 100))[0]
    prompts = [shared + tail for tail in random_prompts(6, seed=3, lengths=(1, 30))]
    params = SamplingParams(max_tokens=6, **GREEDY)
    cached = autodeploy(directory, device="cpu")
    first = cached.generate(prompts[:1], params)
    rest = cached.generate(prompts[1:], params)
    stats = cached.engine.pool.stats
    assert stats.hit_tokens >= 5 * 96 and 0 < stats.hit_rate < 1
    plain = autodeploy(directory, device="cpu", kv_cache={"prefix_caching": False})
    expected = plain.generate(prompts, params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in expected]
    assert plain.engine.pool.stats.hit_tokens == 0


def test_pool_exhaustion_preempts_and_every_request_completes(tiny_checkpoint):
    """12 blocks of 16 tokens cannot hold 8 sequences of ~60 tokens at once: sequences are preempted
    and recomputed, and the results equal HF's."""
    llm = autodeploy(str(tiny_checkpoint("qwen2")), device="cpu", kv_cache={"num_blocks": 12})
    hf = tiny_hf_model("qwen2")
    prompts = random_prompts(8, seed=4, lengths=(30, 50))
    params = SamplingParams(max_tokens=12, **GREEDY)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 12) for p in prompts]
    assert llm.engine.pool.num_used_blocks == 0


def test_chunked_prefill_of_long_prompts_matches(tiny_checkpoint, llama_llm):
    chunked = autodeploy(str(tiny_checkpoint("llama")), device="cpu", scheduler={"max_num_tokens": 32})
    prompts = random_prompts(4, seed=5, lengths=(100, 300))
    params = SamplingParams(max_tokens=5, **GREEDY)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == [o.token_ids for o in llama_llm.generate(prompts, params)]


def test_higher_priority_requests_finish_first_under_pressure(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", max_batch_size=2)
    engine = llm.engine
    prompts = random_prompts(6, seed=6, lengths=(5, 10))
    low = [engine.add_request(p, SamplingParams(max_tokens=8, **GREEDY), priority=5) for p in prompts[:4]]
    engine.step()
    urgent = engine.add_request(prompts[4], SamplingParams(max_tokens=8, **GREEDY), priority=-1)
    while not urgent.finished:
        engine.step()
    assert sum(r.finished for r in low) <= 2  # it overtook the low-priority requests still waiting
    while engine.has_unfinished():
        engine.step()
    assert all(r.finished for r in low)


def test_n_samples_share_the_prompt_and_differ(llama_llm):
    prompt = random_prompts(1, seed=7, lengths=(40, 40))[0]
    out = llama_llm.generate([prompt], SamplingParams(n=4, max_tokens=6, temperature=1.5, seed=11, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    single = llama_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.5, seed=11, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == single.token_ids  # sample 0 is the request's seed
    assert llama_llm.engine.pool.num_used_blocks == 0


def test_logprobs_are_the_models_log_softmax(llama_llm, llama_dir):
    hf = tiny_hf_model("llama")
    prompt = [5, 6, 7, 8]
    out = llama_llm.generate([prompt], SamplingParams(max_tokens=4, logprobs=3, **GREEDY))[0].outputs[0]
    full = torch.tensor([prompt + out.token_ids])
    expected = torch.log_softmax(hf(full).logits[0, len(prompt) - 1 : -1].float(), -1)
    for step, token in enumerate(out.token_ids):
        assert out.logprobs[step] == pytest.approx(expected[step, token].item(), abs=1e-4)
        top = expected[step].topk(3)
        assert list(out.top_logprobs[step]) == top.indices.tolist()


def test_logit_bias_equals_hf_sequence_bias(llama_llm):
    """Greedy decoding under ``logit_bias`` equals HF ``generate`` with the same single-token ``sequence_bias``,
    each bias taken alone and all together, in one batch."""
    hf = tiny_hf_model("llama")
    prompt = [5, 6, 7, 8]
    plain = hf_greedy(hf, prompt, 6)
    biases = [{plain[0]: -100.0}, {plain[1]: -3.0, 11: 2.5}, {42: 100.0}]
    outputs = llama_llm.generate([prompt] * len(biases), [SamplingParams(max_tokens=6, logit_bias=b, **GREEDY) for b in biases])
    for bias, output in zip(biases, outputs):
        expected = hf_greedy(hf, prompt, 6, sequence_bias={(token,): value for token, value in bias.items()})
        assert output.token_ids == expected, bias
    assert outputs[0].token_ids[0] != plain[0] and outputs[2].token_ids == [42] * 6
    with pytest.raises(InvalidRequestError, match="logit_bias has token ids outside the vocabulary"):
        llama_llm.generate([prompt], SamplingParams(logit_bias={10**6: 1.0}))


@pytest.fixture(scope="module")
def beam_llm(tiny_checkpoint):
    """The tiny Llama with KV blocks of 4 tokens, one deploy for both beam widths (each test leaves its pool empty)."""
    return autodeploy(str(tiny_checkpoint("llama")), device="cpu", kv_cache={"block_size": 4})


@pytest.mark.parametrize("width, n", [(2, 1), (4, 2)])
def test_beam_search_equals_hf(beam_llm, width, n):
    llm = beam_llm
    hf = tiny_hf_model("llama")
    for prompt in random_prompts(3, seed=8, lengths=(3, 20)):
        out = llm.generate([prompt], SamplingParams(beam_width=width, n=n, max_tokens=6, temperature=0, ignore_eos=True))[0]
        expected = hf.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=6,
            eos_token_id=None, pad_token_id=0, early_stopping=False, length_penalty=1.0,
        )
        assert [c.token_ids for c in out.outputs] == [row[len(prompt) :].tolist() for row in expected]
    assert llm.engine.pool.num_used_blocks == 0


def test_stream_yields_token_by_token_and_matches_generate(llama_llm):
    params = SamplingParams(max_tokens=10, **GREEDY)
    chunks = list(llama_llm.stream("def add(a, b):", params))
    assert len(chunks) == 10 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert all(len(c.outputs[0].new_token_ids) == 1 for c in chunks)
    final = llama_llm.generate(["def add(a, b):"], params)[0]
    assert [t for c in chunks for t in c.outputs[0].new_token_ids] == final.token_ids
    assert "".join(c.outputs[0].new_text for c in chunks) == final.text
    metrics = chunks[-1].metrics
    assert 0 <= metrics.queue_time <= metrics.time_to_first_token <= metrics.e2e_latency
    assert len(metrics.token_times) == 10 and metrics.token_times == sorted(metrics.token_times)


def test_closing_a_stream_cancels_it_and_frees_its_blocks(llama_llm):
    stream = llama_llm.stream([5] * 40, SamplingParams(max_tokens=50, **GREEDY))
    next(stream)
    assert llama_llm.engine.pool.num_used_blocks > 0
    stream.close()
    assert llama_llm.engine.pool.num_used_blocks == 0 and not llama_llm.engine.has_unfinished()


def test_abort_frees_blocks_immediately(llama_llm):
    engine = llama_llm.engine
    request = engine.add_request([7] * 50, SamplingParams(max_tokens=20, **GREEDY))
    other = engine.add_request([8] * 10, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    engine.abort(request.request_id)
    assert engine.pool.block_table(request.sequences[0].seq_id) == []
    while engine.has_unfinished():
        engine.step()
    assert request.output(llama_llm.tokenizer).finish_reason == "abort"
    assert other.finished and len(other.output(llama_llm.tokenizer).token_ids) == 3
    assert engine.pool.num_used_blocks == 0


def test_async_streams_share_the_engine(llama_llm):
    import asyncio

    from autodeploy import AsyncLLM

    params = SamplingParams(max_tokens=6, **GREEDY)
    prompts = ["def f(x):", "import os", "class A:"]
    expected = [o.token_ids for o in llama_llm.generate(prompts, params)]

    async def main():
        async_llm = AsyncLLM(llama_llm)
        try:
            outputs = await asyncio.gather(*(async_llm.generate(p, params) for p in prompts))

            async def cancel_after_two():
                seen = 0
                async for _ in async_llm.stream("x = 1", SamplingParams(max_tokens=40, **GREEDY)):
                    seen += 1
                    if seen == 2:
                        break
                return seen

            seen = await cancel_after_two()
            with pytest.raises(InvalidRequestError):
                await async_llm.generate("x", SamplingParams(temperature=-1))
            return outputs, seen
        finally:
            async_llm.shutdown()

    outputs, seen = asyncio.run(main())
    assert [o.token_ids for o in outputs] == expected and seen == 2
    assert llama_llm.engine.pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([5] * 600, SamplingParams(max_tokens=4), "max_seq_len"),
        ([5] * 10, SamplingParams(max_tokens=600), "max_seq_len"),
        ([5], SamplingParams(temperature=-0.5), "temperature"),
        ([5], SamplingParams(top_p=0), "top_p"),
        ([5], SamplingParams(top_p=1.5), "top_p"),
        ([5], SamplingParams(stop=5), "stop"),
        ([5], SamplingParams(stop=[1]), "stop"),
        ([9999], SamplingParams(), "vocabulary"),
        ([], SamplingParams(), "empty"),
    ],
)
def test_bad_requests_raise_typed_errors_and_the_engine_keeps_serving(llama_llm, prompt, params, message):
    engine = llama_llm.engine
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert good.finished and len(good.output(llama_llm.tokenizer).token_ids) == 4
    assert engine.pool.num_used_blocks == 0


def test_free_kv_cache_drops_the_engine_only_when_idle(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu")
    params = SamplingParams(max_tokens=3, **GREEDY)
    before = llm.generate([[5, 6, 7]], params)[0].token_ids
    running = llm.engine.add_request([8, 9], params)
    with pytest.raises(InvalidRequestError, match="still running"):
        llm.free_kv_cache()
    llm.engine.abort(running.request_id)
    first_engine = llm.engine
    llm.free_kv_cache()
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == before and llm.engine is not first_engine


def test_streams_never_show_text_that_a_stop_string_later_cuts(llama_llm):
    free = llama_llm.generate(["def f(x):"], SamplingParams(max_tokens=12, **GREEDY))[0]
    stop = free.text[4:7]
    assert len(stop) == 3
    chunks = list(llama_llm.stream("def f(x):", SamplingParams(max_tokens=12, stop=[stop], **GREEDY)))
    streamed = "".join(c.outputs[0].new_text for c in chunks)
    assert streamed == chunks[-1].text == free.text[: free.text.find(stop)]


def test_streamable_prefix_holds_back_partial_stops_and_characters():
    from autodeploy.runtime.request import streamable_prefix

    assert streamable_prefix("hello wo", ["world"]) == "hello "
    assert streamable_prefix("hello w", ["xyz"]) == "hello w"
    assert streamable_prefix("abc\ufffd", []) == "abc"
    assert streamable_prefix("abcw", ["wx", "cwy"]) == "ab"


@pytest.mark.parametrize("call", ["logits", "generate", "stream"])
def test_sequences_past_max_seq_len_raise_naming_the_numbers(llama_llm, call):
    too_long = [5] * (llama_llm.engine.max_seq_len + 1)
    with pytest.raises(InvalidRequestError, match=r"513 tokens.*max_seq_len=512"):
        if call == "logits":
            llama_llm.logits([[5, 6], too_long])
        elif call == "generate":
            llama_llm.generate([too_long], SamplingParams(max_tokens=1))
        else:
            next(llama_llm.stream(too_long, SamplingParams(max_tokens=1)))
    assert llama_llm.logits([[5] * 512])[0].shape[0] == 512


def test_a_prompt_that_is_not_valid_unicode_is_an_invalid_request(llama_llm):
    with pytest.raises(InvalidRequestError, match=r"not valid Unicode: character 3 .*lone surrogate.*errors='replace'"):
        llama_llm.generate("abc\ud800def", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="character 0"):
        next(llama_llm.stream("\udfff", SamplingParams(max_tokens=2)))
    assert llama_llm.generate("abc\ufffddef", SamplingParams(max_tokens=2, **GREEDY))[0].finish_reason == "length"


def test_a_model_with_non_finite_logits_fails_when_the_engine_is_built(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from autodeploy.errors import UnsupportedModelError

    directory = tmp_path / "llama-with-a-nan"
    shutil.copytree(tiny_checkpoint("llama"), directory)
    weights = load_file(directory / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"not finite.*float32 gave 512 nan among 512 logits; check the checkpoint"):
        autodeploy(str(directory), device="cpu").engine
