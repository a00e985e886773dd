"""``autodeploy serve``: the OpenAI-compatible server over the tiny Llama, on loopback, driven by the official
``openai`` client (and raw HTTP where the client would hide what is sent or returned)."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from autodeploy import SamplingParams
from autodeploy.cli.main import build_parser, main
from autodeploy.errors import ConfigError
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.server import serving_in_thread
from tests.tiny_models import tiny_hf_model

MODEL = "tiny-llama"
API_KEY = "sk-test"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GREEDY = dict(temperature=0.0)


@contextlib.contextmanager
def serving(llm, **options):
    """The app under uvicorn in a background thread, on a free loopback port; yields its base URL."""
    with serving_in_thread(build_app(llm, ServerOptions(served_model_name=MODEL, **options))) as base:
        yield base


@pytest.fixture(scope="module")
def url(llama_llm):
    with serving(llama_llm, chat_template=CHAT_TEMPLATE) as base:
        yield base


@pytest.fixture(scope="module")
def guarded_url(llama_llm):
    """No chat template and an API key (a full queue: tests/serve/test_server_limits.py)."""
    with serving(llama_llm, api_key=API_KEY) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(llm, timeout: float = 10.0) -> None:
    """Every request finished or aborted and the KV pool back to empty."""
    engine = llm.engine
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.pool.num_used_blocks:
        assert time.monotonic() < deadline, f"still busy: {len(engine.requests)} requests, {engine.pool.num_used_blocks} blocks"
        time.sleep(0.01)


def chat_prompt(llm, messages) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer(text, add_special_tokens=False).input_ids


def metric(url: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# ---- endpoints ------------------------------------------------------------------------------------------------


def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200
    missing = httpx.get(f"{url}/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_greedy_completions_equal_in_process_generate_token_for_token(llama_llm, client):
    prompts = ["def fibonacci(n):", "import os"]
    token_prompt = llama_llm.tokenizer("class Point:").input_ids
    expected = llama_llm.generate([*prompts, token_prompt], SamplingParams(max_tokens=12, **GREEDY))
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, logprobs=0, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=token_prompt, max_tokens=12, **GREEDY)
    choices = [*response.choices, *by_ids.choices]
    for choice, reference in zip(choices, expected):
        assert choice.text == reference.text and choice.finish_reason == reference.finish_reason
    for choice, reference in zip(response.choices, expected):
        assert choice.logprobs.tokens == [llama_llm.tokenizer.decode([t]) for t in reference.token_ids]
        assert len(choice.logprobs.token_logprobs) == len(reference.token_ids)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected[:2])
    assert response.usage.completion_tokens == sum(len(o.token_ids) for o in expected[:2])
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_deltas_concatenate_to_the_greedy_text(llama_llm, client):
    expected = llama_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=16, **GREEDY))[0]
    chunks = list(client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)

    messages = [{"role": "user", "content": "hello"}]
    reference = llama_llm.generate(chat_prompt(llama_llm, messages), SamplingParams(max_tokens=16, **GREEDY))[0]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, stream=True, **GREEDY)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == reference.text


def test_stream_interval_sends_a_chunk_every_n_tokens(llama_llm):
    """``stream_interval`` 4: the first token at once, then 4 a chunk; text and log-probabilities add up."""
    expected = llama_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=13, ignore_eos=True, **GREEDY))[0]
    with serving(llama_llm, stream_interval=4) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = [c for c in client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=13, stream=True, logprobs=1,
                                                       extra_body={"ignore_eos": True}, **GREEDY) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 13
    assert len(chunks) <= 1 + 3 + 1, [c.choices[0].text for c in chunks]  # 1 + 4 + 4 + 4 tokens, and perhaps a finish chunk
    with pytest.raises(ConfigError, match="stream_interval must be a positive integer"):
        build_app(llama_llm, ServerOptions(served_model_name=MODEL, stream_interval=0))


def test_echo_with_logprobs_scores_the_prompt_as_hf(llama_llm, client, url):
    """OpenAI's legacy scoring, as evaluation harnesses use it: ``echo`` with ``logprobs`` gives the prompt's
    tokens their log-probabilities under the model (HF's log-softmax), the first none; ``max_tokens`` 0
    generates nothing; with tokens generated, their entries follow the prompt's."""
    ids = llama_llm.tokenizer("def fibonacci(n): return n").input_ids
    expected = torch.log_softmax(tiny_hf_model("llama")(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    choice, logprobs = scored.choices[0], scored.choices[0].logprobs
    assert (choice.text, choice.finish_reason, scored.usage.completion_tokens) == (llama_llm.tokenizer.decode(ids), "length", 0)
    assert logprobs.tokens == [llama_llm.tokenizer.decode([t]) for t in ids] and logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([expected[i, t].item() for i, t in enumerate(ids[1:])], abs=1e-4)
    top = expected[2].topk(2)
    assert list(logprobs.top_logprobs[3]) == [llama_llm.tokenizer.decode([t]) for t in top.indices.tolist()]

    generated = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, **GREEDY).choices[0]
    assert len(generated.logprobs.tokens) == len(ids) + 1 and generated.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        logprobs.token_logprobs[1:], abs=1e-6)
    greedy_token = generated.logprobs.token_logprobs[-1]  # lm-eval's is_greedy: the token is its position's best
    assert greedy_token == max(generated.logprobs.top_logprobs[-1].values())
    for body, param in (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
                        ({"echo": True, "logprobs": 1, "stream": True}, "echo")):
        error = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", **body})
        assert error.status_code == 400 and error.json()["error"]["param"] == param, error.text


THINKING_TEMPLATE = CHAT_TEMPLATE.replace("<|assistant|>", "<|assistant|><think>\n")  # the prompt opens the block (R1's style)


def test_reasoning_parser_puts_the_think_block_in_reasoning_content(llama_llm):
    """``--reasoning-parser think``: generation that starts inside a think block the prompt opened (and never
    closes it in 10 tokens) is all reasoning, whole or streamed; without the opened block it is content. The
    split itself is ``tests/runtime/test_reasoning.py``'s."""
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    for template, thinking in ((THINKING_TEMPLATE, True), (CHAT_TEMPLATE, False)):
        prompt = llama_llm.tokenizer(llama_llm.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids
        expected = llama_llm.generate(prompt, SamplingParams(max_tokens=10, **GREEDY, ignore_eos=True))[0].text
        assert "</think>" not in expected and not expected.lstrip().startswith("<think>")
        with serving(llama_llm, chat_template=template, reasoning_parser="think") as base:
            message = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            chunks = [json.loads(line[6:]) for line in httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True},
                                                                  timeout=60).text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        if thinking:
            assert (message["reasoning_content"], message["content"]) == (expected, None)
            assert "".join(d.get("reasoning_content", "") for d in deltas) == expected and not any(d.get("content") for d in deltas)
        else:
            assert (message["reasoning_content"], message["content"]) == (None, expected)
            assert "".join(d.get("content") or "" for d in deltas) == expected
    with pytest.raises(ConfigError, match="reasoning parser must be one of none, think"):
        build_app(llama_llm, ServerOptions(served_model_name=MODEL, reasoning_parser="deepseek"))


def test_logit_bias_forces_and_bans_tokens(llama_llm, client):
    """Greedy under ``logit_bias`` equals in-process generate with the same bias: +100 forces a token, -100
    bans the one greedy decoding would choose first."""
    plain = llama_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=6, **GREEDY))[0]
    for bias in ({plain.token_ids[0]: -100.0}, {7: 100.0}):
        expected = llama_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=6, logit_bias=bias, **GREEDY))[0]
        response = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=6,
                                             logit_bias={str(t): b for t, b in bias.items()}, **GREEDY)
        assert response.choices[0].text == expected.text
    assert expected.token_ids == [7] * 6
    assert llama_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=6, logit_bias={plain.token_ids[0]: -100.0},
                                                                  **GREEDY))[0].token_ids[0] != plain.token_ids[0]


def test_tokenize_and_detokenize(llama_llm, url):
    """vLLM's /tokenize (a prompt as completions tokenize it, messages as chat renders them) and /detokenize."""
    ids = llama_llm.tokenizer("def fibonacci(n):").input_ids
    response = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "def fibonacci(n):"}).json()
    assert response == {"count": len(ids), "max_model_len": llama_llm.engine.max_seq_len, "tokens": ids}
    bare = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "def fibonacci(n):", "add_special_tokens": False}).json()
    assert bare["tokens"] == llama_llm.tokenizer("def fibonacci(n):", add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == chat_prompt(llama_llm, messages)
    assert httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": llama_llm.tokenizer.decode(ids)}
    for route, body, param in (("tokenize", {"model": MODEL}, "prompt"),
                               ("tokenize", {"model": MODEL, "prompt": "x", "messages": messages}, "prompt"),
                               ("tokenize", {"model": MODEL, "prompt": "x", "tools": [{"type": "function"}]}, "tools"),
                               ("tokenize", {"model": "other", "prompt": "x"}, "model"),
                               ("detokenize", {"model": MODEL, "tokens": [10**6]}, "tokens"),
                               ("detokenize", {"model": MODEL, "tokens": "abc"}, "tokens")):
        error = httpx.post(f"{url}/{route}", json=body)
        assert error.status_code == 400 and error.json()["error"]["param"] == param, (route, body, error.text)


def test_chat_completion_renders_the_template_and_returns_logprobs(llama_llm, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    prompt = chat_prompt(llama_llm, [messages[0], {"role": "user", "content": "hi"}])  # text parts are joined
    reference = llama_llm.generate(prompt, SamplingParams(max_tokens=10, **GREEDY))[0]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=3,
                                              **GREEDY)
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    content = choice.logprobs.content
    assert [entry.token for entry in content] == [llama_llm.tokenizer.decode([t]) for t in reference.token_ids]
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == len(reference.token_ids)


def test_n_seed_and_stop(llama_llm, client):
    sampled = dict(model=MODEL, prompt="import os", max_tokens=8, temperature=1.0, n=3, seed=7)
    first, second = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    expected = llama_llm.generate("import os", SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7))[0]
    assert [c.text for c in first.choices] == [c.text for c in expected.outputs]

    greedy = llama_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=12, **GREEDY))[0].text
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    reference = llama_llm.generate("def fibonacci(n):", SamplingParams(max_tokens=12, stop=[stop], **GREEDY))[0]
    response = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, stop=stop, **GREEDY)
    assert response.choices[0].text == reference.text and stop not in reference.text
    assert response.choices[0].finish_reason == "stop"


def test_echo_and_engine_only_fields(llama_llm, client):
    reference = llama_llm.generate("import os", SamplingParams(max_tokens=6, top_k=5, repetition_penalty=1.3, **GREEDY))[0]
    response = client.completions.create(model=MODEL, prompt="import os", max_tokens=6, echo=True, **GREEDY,
                                         extra_body={"top_k": 5, "repetition_penalty": 1.3})
    assert response.choices[0].text == "import os" + reference.text


# An enum and a bounded integer, no other properties: the random model's JSON ends within a few dozen tokens.
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "size"], "additionalProperties": False}


def test_response_format_json_schema_on_both_endpoints(llama_llm, client):
    response_format = {"type": "json_schema", "json_schema": {"name": "paint", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def f(x):"}], max_tokens=60,
                                          response_format=response_format, **GREEDY)
    completion = client.completions.create(model=MODEL, prompt="import os", max_tokens=60, n=2, seed=1,
                                           extra_body={"response_format": response_format})
    for choice, text in [(chat.choices[0], chat.choices[0].message.content)] + [(c, c.text) for c in completion.choices]:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert choice.finish_reason == "stop"
    reference = llama_llm.generate("import os", SamplingParams(max_tokens=60, temperature=1.0, n=2, seed=1, json_schema=SCHEMA))[0]
    assert [c.text for c in completion.choices] == [c.text for c in reference.outputs]

    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=60,
                                              response_format={"type": "json_object"}, seed=2, stream=True)
    chunks = list(streamed)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, 'Unsupported type "nonsense"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}}, "properties must be an object"),
    ({"type": "json_schema"}, "needs json_schema"),
    ({"type": "yaml"}, "response_format"),
])
def test_a_bad_response_format_is_a_400(url, client, response_format, message):
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       response_format=response_format)
    assert raised.value.body["param"] == "response_format"
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "response_format": response_format})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


# ---- errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ('{"model": "tiny-llama", "prompt": ', None),                                    # malformed JSON
    ('{"model": "tiny-llama", "prompt": "x", "max_tokens": "many"}', "max_tokens"),  # wrong type
    ('{"model": "other", "prompt": "x"}', "model"),                                  # unknown model
    ('{"prompt": "x"}', "model"),                                                    # missing model
    ('{"model": "tiny-llama", "prompt": "x", "temperature": -1}', "temperature"),    # out of range
    ('{"model": "tiny-llama", "prompt": "x", "max_tokens": 100000}', None),          # over the context
    ('{"model": "tiny-llama", "prompt": "x", "logit_bias": {"five": 1}}', "logit_bias"),  # not a token id
    ('{"model": "tiny-llama", "prompt": "x", "logit_bias": {"5": 101}}', "logit_bias"),   # over 100
    ('{"model": "tiny-llama", "prompt": "x", "logit_bias": {"100000": 1}}', "logit_bias"),  # outside the vocabulary
    ('{"model": "tiny-llama", "prompt": "x", "n": 4, "best_of": 2}', "best_of"),      # best_of < n
    ('{"model": "tiny-llama", "prompt": "x", "best_of": 4, "stream": true}', "best_of"),
    ('{"model": "tiny-llama", "prompt": ["x", "y"], "n": 8, "best_of": 20}', "n"),    # 40 sequences, 32 seats
    ('{"model": "tiny-llama", "prompt": [], "max_tokens": 2}', None),
    ('{"model": "tiny-llama", "prompt": [100000]}', None),                           # outside the vocabulary
])
def test_bad_requests_are_400s_in_the_openai_schema(url, body, param):
    response = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and error["param"] == param


def test_chat_errors(client, guarded_url):
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\] \(f\): its parameters cannot be enforced") as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}])
    assert raised.value.body["param"] == "tools"
    guarded = openai.OpenAI(base_url=f"{guarded_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template.*--chat-template"):
        guarded.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_api_key(guarded_url):
    for key in ("wrong", None):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(f"{guarded_url}/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded_url}/v1", api_key="wrong", max_retries=0).models.list()
    guarded = openai.OpenAI(base_url=f"{guarded_url}/v1", api_key=API_KEY, max_retries=0)
    assert guarded.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(f"{guarded_url}/health").status_code == 200  # probes need no key


# ---- load and disconnects -------------------------------------------------------------------------------------


def test_concurrent_clients_get_the_in_process_greedy_answers(llama_llm, url):
    """64 clients × 20 requests (every fourth client streams): each answer is complete and equals in-process
    greedy ``generate``, and the KV pool is empty afterwards."""
    clients, requests_each = 64, 20
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(clients * requests_each)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    expected = [o.text for o in llama_llm.generate(prompts, params)]
    answers: dict[int, str] = {}
    failures: list[BaseException] = []

    def one_client(first: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            for index in range(first, len(prompts), clients):
                if first % 4 == 0:
                    chunks = list(client.completions.create(model=MODEL, prompt=prompts[index], max_tokens=8, stream=True, **GREEDY))
                    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                    answers[index] = "".join(c.choices[0].text for c in chunks)
                else:
                    response = client.completions.create(model=MODEL, prompt=prompts[index], max_tokens=8, **GREEDY)
                    assert response.choices[0].finish_reason in ("stop", "length")
                    answers[index] = response.choices[0].text
        except BaseException as error:  # reported below, with the request that failed
            failures.append(error)

    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not failures, failures[:3]
    assert [answers.get(i) for i in range(len(prompts))] == expected
    wait_idle(llama_llm)


def test_a_client_leaving_mid_stream_aborts_its_request(llama_llm, url):
    aborted = metric(url, "autodeploy_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        first = json.loads(next(line for line in response.iter_lines() if line.startswith("data: "))[len("data: "):])
        assert first["choices"][0]["finish_reason"] is None
    wait_idle(llama_llm)  # aborted long before its 500 tokens: its blocks are back
    assert metric(url, "autodeploy_requests_total", finish_reason="abort") == aborted + 1


def test_a_client_leaving_before_a_full_answer_aborts_its_request(llama_llm, url):
    aborted = metric(url, "autodeploy_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True, **GREEDY}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
    wait_idle(llama_llm)
    assert metric(url, "autodeploy_requests_total", finish_reason="abort") == aborted + 1


def test_metrics_count_requests_and_tokens(url, client):
    before = metric(url, "autodeploy_generation_tokens_total")
    finished = metric(url, "autodeploy_time_to_first_token_seconds_count")
    client.completions.create(model=MODEL, prompt="import os", max_tokens=4, extra_body={"ignore_eos": True}, **GREEDY)
    text = httpx.get(f"{url}/metrics").text
    for name in ("autodeploy_time_per_output_token_seconds", "autodeploy_e2e_request_latency_seconds",
                 "autodeploy_num_requests_waiting", "autodeploy_num_requests_running", "autodeploy_kv_cache_usage_ratio",
                 "autodeploy_prefix_cache_hit_rate", "autodeploy_requests_total"):
        assert name in text
    assert metric(url, "autodeploy_generation_tokens_total") == before + 4
    assert metric(url, "autodeploy_time_to_first_token_seconds_count") == finished + 1
    assert metric(url, "autodeploy_num_requests_running") == 0


# ---- command line ---------------------------------------------------------------------------------------------


def test_serve_command_line(capsys, tmp_path):
    args = build_parser().parse_args(["serve", "some/model", "--api-key", "k", "--set", "device=cpu"])
    assert (args.host, args.port, args.api_key, args.max_queued_requests) == ("127.0.0.1", 8000, "k", 256)
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    assert "--chat-template: cannot read" in capsys.readouterr().err
    assert main(["serve", "--stream-interval", "0"]) == 1
    assert "--stream-interval must be ≥ 1" in capsys.readouterr().err


def test_a_model_without_a_tokenizer_streams_every_steps_tokens(tmp_path):
    """No tokenizer: no text, but each step that made tokens is still a chunk, with those tokens' log-probabilities
    (progress a client sees, latency a benchmark measures; chunks without text were once held back, their tokens'
    log-probabilities lost, and a benchmark saw the first token, then the other 127 at the end)."""
    from autodeploy import autodeploy

    tiny_hf_model("llama").save_pretrained(tmp_path)  # weights and config only
    llm = autodeploy(str(tmp_path), device="cpu")
    with serving(llm) as base:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True,
                "logprobs": 0}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    choices = [event["choices"][0] for event in events if event.get("choices")]
    assert all(choice["text"] == "" for choice in choices) and choices[-1]["finish_reason"] == "length"
    assert sum(len(choice["logprobs"]["token_logprobs"]) for choice in choices) == 6
