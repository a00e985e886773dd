"""Encoder–decoder models served end to end (issue 44), on tiny random BART and mBART: greedy output equal to Hugging
Face's ``generate`` token for token — requests in one batch, arriving mid-decode, preempted by a small KV pool — the
encoder's cross blocks freed with the request, the build verified against HF (and a broken encoder refused)."""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import InvalidRequestError, UnsupportedModelError
from tests.tiny_seq2seq_models import hf_generate_greedy, lively

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 60)), [7]]


@pytest.fixture(scope="module", params=["bart", "mbart"])
def served(request, tmp_path_factory):
    model = lively(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, autodeploy(str(directory), device="cpu", dtype="float32")


def test_greedy_output_is_hf_generates_and_the_build_was_verified(served):
    model, llm = served
    assert llm.verification is not None and llm.verification.relative_error <= llm.verification.tolerance
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_generate_greedy(model, p, 12) for p in PROMPTS]
    assert [o.prompt_token_ids for o in outputs] == PROMPTS  # the prompt is the encoder's input
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > 1


def test_requests_arriving_mid_decode_get_their_own_output_and_free_both_caches(served):
    model, llm = served
    engine = llm.engine
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 4, 12, 6)]
    requests = []
    for prompt, p in zip(PROMPTS, params):  # one request a step: encoder passes and decodes share the steps
        requests.append(engine.add_request(prompt, p))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    outputs = {r.request_id: r.output(llm.tokenizer).outputs[0].token_ids for r in requests}
    assert [outputs[r.request_id] for r in requests] == [hf_generate_greedy(model, p, s.max_tokens) for p, s in zip(PROMPTS, params)]
    assert engine.pool.num_used_blocks == 0 and engine.encoder.pool.num_used_blocks == 0


def test_an_abort_during_decode_frees_the_cross_blocks_too(served):
    _, llm = served
    engine = llm.engine
    request = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.encoder.pool.num_used_blocks > 0 and request.cross_table is not None
    engine.abort(request.request_id)
    assert engine.pool.num_used_blocks == 0 and engine.encoder.pool.num_used_blocks == 0


def test_preempted_requests_are_encoded_again_and_keep_hf_output(tmp_path):
    model = lively("bart", seed=6)
    model.save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", verify={"enabled": False},
                     kv_cache={"num_blocks": 4, "block_size": 4}, max_batch_size=4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [hf_generate_greedy(model, p, 10) for p in PROMPTS]
    assert llm.engine.encoder.encoded > len(PROMPTS)  # a preempted request's encoder ran again
    assert llm.engine.encoder.pool.num_used_blocks == 0


def test_a_prompt_longer_than_the_encoder_takes_and_bare_logits_are_refused(served):
    _, llm = served
    with pytest.raises(InvalidRequestError, match=r"encoder-decoder model's input takes 1 to \d+ \(max_seq_len="):
        llm.generate([[5] * (llm.settings.max_seq_len + 1)], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="reads its request's encoder input"):
        llm.logits([[2, 5, 6]])  # decoder tokens alone would be scored against no encoder output: refused


def test_verification_refuses_an_encoder_whose_keys_and_values_are_swapped(tmp_path, monkeypatch):
    from autodeploy.export import encoder_decoder

    model = lively("bart", seed=7)
    model.save_pretrained(tmp_path)
    forward = encoder_decoder.EncoderCrossKV.forward
    monkeypatch.setattr(encoder_decoder.EncoderCrossKV, "forward", lambda self, input_ids: forward(self, input_ids)[::-1])
    with pytest.raises(UnsupportedModelError, match=r"does not compute what Hugging Face computes.*first diverging module: model.decoder.layers.0.encoder_attn"):
        autodeploy(str(tmp_path), device="cpu", dtype="float32")


def test_beam_search_is_hf_generates_and_forked_sequences_share_one_cross_cache(served):
    model, llm = served
    prompt = PROMPTS[0]
    beams = llm.generate([prompt], SamplingParams(max_tokens=8, beam_width=3, n=3, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, num_beams=3, num_return_sequences=3,
                                  do_sample=False, early_stopping=False)
    assert [c.token_ids for c in beams.outputs] == [row[1:].tolist() for row in expected]
    sampled = llm.generate([prompt], SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert len(sampled.outputs) == 2 and all(len(c.token_ids) == 8 for c in sampled.outputs)
    assert llm.engine.encoder.pool.num_used_blocks == 0 and llm.engine.encoder.encoded >= 2


def test_saving_an_encoder_decoder_deployment_is_refused_by_name(served, tmp_path):
    from autodeploy.errors import ConfigError

    _, llm = served
    with pytest.raises(ConfigError, match="has an encoder graph beside its model graph, which saved deployments do not hold yet"):
        llm.save(tmp_path / "saved")


@pytest.mark.timeout(120)
def test_the_openai_completions_endpoint_serves_the_encoders_prompt(tmp_path):
    """The official client's completion (and its stream) of a text prompt: the text is the encoder's input, and the
    reply is Hugging Face's greedy ``generate`` decoded."""
    import openai
    from transformers import PreTrainedTokenizerFast

    from autodeploy.serve import ServerOptions, build_app
    from autodeploy.serve.server import serving_in_thread
    from tests.tiny_models import train_tiny_tokenizer

    model = lively("bart", seed=8)
    model.save_pretrained(tmp_path)
    train_tiny_tokenizer(tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32")
    prompt = "def add(a, b): return a + b"
    expected = tokenizer.decode(hf_generate_greedy(model, tokenizer(prompt)["input_ids"], 6))
    with serving_in_thread(build_app(llm, ServerOptions(served_model_name="bart"))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="bart", prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="bart", prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}) if chunk.choices)
    assert reply.choices[0].text == expected == streamed
    assert reply.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"]) and reply.usage.completion_tokens == 6
    assert llm.engine.encoder.pool.num_used_blocks == 0


def test_an_encoder_pass_counts_against_the_steps_token_budget(tmp_path):
    """Two new requests of 30 input tokens with a 40-token budget: the first step encodes one of them (30 + its start
    token), the second waits for the next step; the output is still HF's."""
    model = lively("bart", seed=9)
    model.save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", verify={"enabled": False}, scheduler={"max_num_tokens": 40})
    engine = llm.engine
    prompts = [list(range(10, 40)), list(range(50, 80))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    engine.step()
    assert [r.cross_table is not None for r in requests] == [True, False]
    while engine.has_unfinished():
        engine.step()
    assert [r.output(None).outputs[0].token_ids for r in requests] == [hf_generate_greedy(model, p, 5) for p in prompts]
    with pytest.raises(InvalidRequestError, match=r"takes 1 to 40 .*scheduler.max_num_tokens=40: its encoder runs in one step"):
        llm.generate([list(range(41))], params)


def test_pipeline_and_expert_parallelism_and_speculation_are_refused_by_name_before_anything_is_built(tmp_path):
    """Tensor parallelism is served (tests/distributed/test_encoder_decoder_tensor_parallel.py); pipeline stages are not
    cut for an encoder–decoder, and BART has no experts to place."""
    from autodeploy.errors import ConfigError

    lively("bart").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="encoder-decoder models are not cut into pipeline stages yet"):
        autodeploy(str(tmp_path), device="cpu", pipeline_parallel=2)
    with pytest.raises(ConfigError, match="expert_parallel=2 but BartConfig has no MoE experts"):
        autodeploy(str(tmp_path), device="cpu", expert_parallel=2)
    with pytest.raises(ConfigError, match=r"speculative.method='ngram'\) drafts for decoder-only models"):
        autodeploy(str(tmp_path), device="cpu", speculative={"method": "ngram", "num_tokens": 3})


def test_the_bench_measures_an_encoder_decoder_against_hf_generate(tmp_path):
    """``autodeploy bench`` on a seq2seq checkpoint: the synthetic prompts are the encoder's inputs, HF's baseline is its
    seq2seq ``generate``, and both count the same input and output tokens."""
    from autodeploy.bench.benchmark import BenchmarkConfig, run_benchmark

    lively("bart").save_pretrained(tmp_path)
    result = run_benchmark(BenchmarkConfig(model=str(tmp_path), set_arguments=["device=cpu", "dtype=float32"], workloads=["synthetic"],
                                           batch=[2], input_len=[12], output_len=[6], compare=["hf-eager"], repeats=1, progress=False))
    ours, hf = (result.run(f"synthetic/b2-in12-out6/{engine}") for engine in ("autodeploy", "hf-eager"))
    for run in (ours, hf):
        assert (run.metrics["input_tokens"], run.metrics["output_tokens"]) == (24, 12) and run.metrics["output_tokens_per_s"] > 0


def test_the_shipped_bart_large_shape_builds_and_verifies_on_meta():
    llm = autodeploy("bart-large", weights="random", device="meta")
    assert llm.verification.relative_error <= llm.verification.tolerance
    assert set(llm.deployment.graphs) == {"model", "encoder"} and len(llm.deployment.signature.cross_kv_caches) == 12


def test_on_a_gpu_the_decoder_stays_eager_and_the_build_says_why(served):
    """The cross-attention's kernels read lengths on the host: the compile stage declares no CUDA graphs for a GPU
    deploy and names the cross-attention, not a choice of kernels that would not help."""
    from omegaconf import OmegaConf

    from autodeploy.transforms.compile_model import CompileModel
    from autodeploy.transforms.registry import TransformConfig, TransformContext

    _, llm = served
    settings = OmegaConf.merge(llm.settings, {"device": "cuda", "compile": {"backend": "cuda_graph"}})
    context = TransformContext(settings=settings)
    result = CompileModel(TransformConfig()).apply(llm.graph, context)
    assert result.notes == "no CUDA graphs: kernels that sync with the host" and context.decode_graph_batch_sizes == ()
    assert "an encoder-decoder's cross-attention has no capturable kernel yet" in result.details[-1]


def test_logprobs_are_hf_scores_and_a_stop_token_ends_the_output(served):
    """Each output token's logprob is Hugging Face's log-softmax of that step's logits (decoder fed the tokens so far,
    the encoder the prompt), and a stop token ends the output where it is sampled."""
    model, llm = served
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0))[0].outputs[0]
    decoder_ids = torch.tensor([[llm.deployment.decoder_start_token_id, *out.token_ids[:-1]]])
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([prompt]), decoder_input_ids=decoder_ids).logits[0].log_softmax(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected[torch.arange(6), out.token_ids], rtol=1e-4, atol=1e-4)
    stop = out.token_ids[2]
    first = out.token_ids.index(stop)
    cut = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop]))[0].outputs[0]
    assert cut.token_ids == out.token_ids[: first + 1] and cut.finish_reason == "stop"
