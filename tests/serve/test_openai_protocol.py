"""The OpenAI server's request contract (docs/openai-server.md): JSON bodies only, strict types, every field
implemented, mapped, accepted as bookkeeping or refused by name; schema refs that stay inside the schema;
echo of the prompt as given (an added BOS is context); the API key's reach; the demo model's chat template."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoTokenizer

from autodeploy import SamplingParams, autodeploy
from autodeploy.cli.main import build_parser, main
from autodeploy.errors import ConfigError, InvalidRequestError
from autodeploy.models.source import demo_model_directory
from autodeploy.frontend.chat_template import render_chat, tool_call_format
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.protocol import ChatCompletionRequest, CompletionRequest
from tests.frontend.test_tool_calls import TOOLS, TOOLS_TEMPLATE, WEATHER
from tests.serve.test_openai_server import MODEL, serving
from tests.tiny_models import tiny_hf_model

REPO = Path(__file__).parent.parent.parent
QUESTION = [{"role": "user", "content": "Weather in Rome?"}]
COMPLETION = {"model": MODEL, "prompt": "import os", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "temperature": 0}
API_KEY = "sk-scope"


@pytest.fixture(scope="module")
def url(llama_llm):
    with serving(llama_llm, chat_template=TOOLS_TEMPLATE) as base:
        yield base


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)


def refused(response: httpx.Response, param: str | None) -> str:
    """The 400's message, after checking it is one in OpenAI's schema naming ``param``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


# ---- item 6: JSON bodies only ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_under_another_content_type_is_a_400_and_the_connection_stays_usable(url, content_type):
    """What ``curl -d`` sends without ``-H 'Content-Type: application/json'`` (and Python's ``requests`` with
    ``data=``: no type): a 400 naming the header, and the next request on the same keep-alive connection is
    answered."""
    with httpx.Client(base_url=url, timeout=60) as client:
        headers = {"content-type": content_type} if content_type else {}
        response = client.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
        message = refused(response, None)
        assert (content_type or "no Content-Type") in message and "Content-Type: application/json" in message
        assert response.json()["error"]["code"] == "unsupported_content_type"
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert httpx.post(f"{url}/v1/completions", content=json.dumps(COMPLETION), timeout=60,
                      headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


# ---- item 7: strict types, and every field decided --------------------------------------------------------------


@pytest.mark.parametrize("route, fields, param", [
    ("completions", {"max_tokens": "4"}, "max_tokens"),
    ("completions", {"max_tokens": True}, "max_tokens"),
    ("completions", {"max_tokens": 4.0}, "max_tokens"),
    ("completions", {"n": True}, "n"),
    ("completions", {"temperature": "0.5"}, "temperature"),
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"echo": 1}, "echo"),
    ("completions", {"stream": "false"}, "stream"),
    ("completions", {"seed": "1"}, "seed"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"prompt": [1, True]}, "prompt"),
    ("completions", {"stop": 5}, "stop"),
    ("completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("chat/completions", {"logprobs": 1}, "logprobs"),
    ("chat/completions", {"max_completion_tokens": "4"}, "max_completion_tokens"),
    ("chat/completions", {"parallel_tool_calls": "true"}, "parallel_tool_calls"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
])
def test_wrong_types_are_400s_not_coerced(url, route, fields, param):
    body = (COMPLETION if route == "completions" else CHAT) | fields
    refused(post(url, route, body), param)


def test_floats_take_integers_and_null_means_unset(url):
    plain = post(url, "completions", COMPLETION).json()["choices"][0]["text"]
    body = COMPLETION | {"temperature": 0, "top_p": 1, "presence_penalty": 0, "n": None, "stop": None, "seed": None,
                         "logprobs": None, "echo": None, "stream": None, "user": None}
    response = post(url, "completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == plain


@pytest.mark.parametrize("route, fields, param, path", [
    ("completions", {"an_unknown_field": 1}, "an_unknown_field", "an_unknown_field"),
    ("completions", {"functions": [{"name": "f"}]}, "functions", "functions"),  # a chat field, as OpenAI's completions
    ("chat/completions", {"guided_json": {"type": "object"}}, "guided_json", "guided_json"),  # vLLM's
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages", "messages.0.mood"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "lang": "en"}]}]},
     "messages", "lang"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]}, "tools",
     "tools.0.function.returns"),
    ("chat/completions", {"response_format": {"type": "json_object", "schema": {}}}, "response_format", "response_format.schema"),
    ("completions", {"stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}}, "stream_options",
     "stream_options.chunk_size"),
])
def test_unknown_fields_are_400s_naming_them(url, route, fields, param, path):
    body = (COMPLETION if route == "completions" else CHAT) | fields
    message = refused(post(url, route, body), param)
    assert path in message and "not a field" in message


@pytest.mark.parametrize("fields, param", [
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]},
     "messages"),
    ({"messages": [*QUESTION, {"role": "assistant", "audio": {"id": "audio_1"}}]}, "messages"),
])
def test_fields_that_would_change_the_output_are_400s_naming_them(url, fields, param):
    message = refused(post(url, "chat/completions", CHAT | fields), param)
    assert "not supported" in message


BOOKKEEPING = {"user": "u-1", "store": False, "metadata": {"team": "evals"}, "service_tier": "auto", "safety_identifier": "h-1",
               "prompt_cache_key": "k-1", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
               "prediction": {"type": "content", "content": "It is sunny."}, "modalities": ["text"]}


def test_bookkeeping_fields_are_accepted_and_change_nothing(url):
    plain = post(url, "chat/completions", CHAT).json()["choices"][0]["message"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Weather in Rome?", "prompt_cache_breakpoint": {"mode": "explicit"}}]}]
    for fields in (BOOKKEEPING, {"messages": parts}, {"stream": True, "stream_options": {"include_obfuscation": True}}):
        response = post(url, "chat/completions", CHAT | fields)
        assert response.status_code == 200, (fields, response.text)
        if "stream" not in fields:
            assert response.json()["choices"][0]["message"] == plain
    completion = post(url, "completions", COMPLETION | {"user": "u-1"})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == post(url, "completions", COMPLETION).json()[
        "choices"][0]["text"]


def test_every_field_of_the_openai_sdk_is_decided_and_documented():
    """Each parameter of the installed ``openai`` package's ``create()`` is a field of the request model
    (implemented, mapped, bookkeeping or refused by name) and has a row in docs/openai-server.md."""
    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions

    docs = (REPO / "docs" / "openai-server.md").read_text()
    transport = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    for create, request in ((Chat.create, ChatCompletionRequest), (Completions.create, CompletionRequest)):
        names = {field.alias or name for name, field in request.model_fields.items()}
        sdk = set(inspect.signature(create).parameters) - transport
        assert sdk <= names, sdk - names
        undocumented = [name for name in names if f"`{name}`" not in docs]
        assert not undocumented, undocumented


FUNCTIONS = [tool["function"] for tool in TOOLS]


def test_legacy_functions_are_tools_and_answer_with_function_call(url):
    """``functions`` / ``function_call`` (deprecated) become tools and a tool choice, and the answer is OpenAI's for
    them: the call in ``message.function_call`` (``delta.function_call`` streamed), finish reason ``function_call``."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    request = dict(model=MODEL, messages=QUESTION, max_tokens=150, temperature=0)
    legacy = client.chat.completions.create(**request, functions=FUNCTIONS, function_call={"name": "get_weather"}).choices[0]
    tools = client.chat.completions.create(**request, tools=TOOLS, parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert legacy.finish_reason == "function_call" and not legacy.message.tool_calls and legacy.message.content is None
    assert legacy.message.function_call.name == "get_weather"
    arguments = json.loads(legacy.message.function_call.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert arguments == json.loads(tools.message.tool_calls[0].function.arguments)

    chunks = [c.choices[0] for c in client.chat.completions.create(**request, functions=FUNCTIONS, function_call={"name": "get_weather"},
                                                                   stream=True)]
    calls = [c.delta.function_call for c in chunks if c.delta.function_call]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", arguments)]
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "function_call"
    none = client.chat.completions.create(**request | {"max_tokens": 4}, functions=FUNCTIONS, function_call="none").choices[0]
    assert none.finish_reason in ("stop", "length") and none.message.function_call is None


def test_legacy_function_turns_render_as_tool_turns(llama_llm, url):
    """An assistant ``function_call`` and a ``function`` message are fed back as a tool call and its result."""
    messages = [*QUESTION, {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                {"role": "function", "name": "get_weather", "content": '{"temperature": 21}'}]
    response = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS}, timeout=60)
    assert response.status_code == 200, response.text
    text = llama_llm.tokenizer.decode(response.json()["tokens"])
    assert '"name": "get_weather", "arguments": {"city": "Rome"}' in text and '<|tool|>{"temperature": 21}' in text
    assert '<|tools|>get_weather now' in text


@pytest.mark.parametrize("fields, param", [
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"functions": FUNCTIONS, "function_call": {"name": "get_weather"}, "tool_choice": "auto"}, "function_call"),
    ({"functions": FUNCTIONS, "function_call": {"name": "missing"}}, "function_call"),
])
def test_bad_legacy_function_requests_are_400s(url, fields, param):
    refused(post(url, "chat/completions", CHAT | fields), param)


# ---- item 8: schema refs stay inside the schema -------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["https://example.com/schema.json", "file:///etc/passwd", "other.json#/$defs/a", "//example.com/s"])
def test_a_schema_ref_outside_the_schema_is_refused(url, ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    for form in (schema, json.dumps(schema)):
        with pytest.raises(InvalidRequestError, match=re.escape(ref)):
            SamplingParams(json_schema=form).validate()
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert ref in refused(post(url, "completions", COMPLETION | {"response_format": response_format}), "response_format")
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert ref in refused(post(url, "chat/completions", CHAT | {"tools": tools}), "tools")


def test_local_refs_and_data_that_looks_like_a_ref_are_enforced():
    schema = {"$defs": {"color": {"enum": ["red", "green"]}}, "type": "object", "properties": {
        "color": {"$ref": "#/$defs/color"}, "$ref": {"type": "string"}, "link": {"const": {"$ref": "https://example.com"}}}}
    SamplingParams(json_schema=schema).validate()


# ---- item 10: echo the prompt as given ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bos_llm(llama_dir, tmp_path_factory):
    """The tiny Llama with a tokenizer that puts ``<s>`` in front of every text, as Llama's and the demo model's do."""
    from tokenizers import Tokenizer, processors

    directory = tmp_path_factory.mktemp("tiny-llama-bos")
    shutil.copytree(llama_dir, directory, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    tokenizer.save(str(directory / "tokenizer.json"))
    llm = autodeploy(str(directory), device="cpu")
    assert llm.tokenizer("def f(x):").input_ids[0] == llm.tokenizer.bos_token_id
    return llm


@pytest.fixture(scope="module")
def bos_url(bos_llm):
    with serving(bos_llm) as base:
        yield base


def test_echo_is_the_prompt_as_given_and_an_added_bos_is_context(bos_llm, bos_url):
    tokenizer = bos_llm.tokenizer
    prompt = "def f(x):"
    plain = tokenizer(prompt, add_special_tokens=False).input_ids
    scored = post(bos_url, "completions", {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}).json()
    choice, logprobs = scored["choices"][0], scored["choices"][0]["logprobs"]
    assert choice["text"] == prompt and scored["usage"]["prompt_tokens"] == len(plain) + 1  # the BOS was read, not echoed
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in plain] and "".join(logprobs["tokens"]) == prompt
    assert logprobs["text_offset"][0] == 0 and isinstance(logprobs["token_logprobs"][0], float)  # after the BOS
    assert len(logprobs["top_logprobs"][0]) == 1

    generated = post(bos_url, "completions", {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0}).json()
    assert generated["choices"][0]["text"].startswith(prompt)
    streamed = httpx.post(f"{bos_url}/v1/completions", json={"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 2,
                                                             "stream": True}, timeout=60).text
    first = json.loads(next(line for line in streamed.splitlines() if line.startswith("data: {"))[len("data: "):])
    assert first["choices"][0]["text"].startswith(prompt)

    ids = tokenizer(prompt).input_ids  # token ids are echoed as sent, BOS and all
    by_ids = post(bos_url, "completions", {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 0}).json()
    assert by_ids["choices"][0]["text"] == tokenizer.decode(ids)
    assert len(by_ids["choices"][0]["logprobs"]["tokens"]) == len(ids) and by_ids["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_lm_eval_local_completions_scores_equal_hf(bos_llm, bos_url):
    """lm-eval's ``local-completions`` with text requests (``tokenized_requests=False``) encodes the context and the
    continuation without special tokens, sends their decoded text with echo and logprobs, and sums
    ``token_logprobs[ctxlen:-1]`` (its payload asks for one generated token; with ``max_tokens`` 0 it is
    ``[ctxlen:]``), ``ctxlen`` being its own count of context tokens. The sum equals HF's log-softmax over the tokens
    the server read: the BOS it added, then the text."""
    tokenizer = bos_llm.tokenizer
    context, continuation = "def fibonacci(n):", " return n"
    context_enc = tokenizer(context, add_special_tokens=False).input_ids
    continuation_enc = tokenizer(continuation, add_special_tokens=False).input_ids
    text = tokenizer.decode(context_enc + continuation_enc)
    assert tokenizer(text, add_special_tokens=False).input_ids == context_enc + continuation_enc  # the round trip lm-eval assumes
    ids = [tokenizer.bos_token_id, *context_enc, *continuation_enc]
    with torch.no_grad():
        logprobs = torch.log_softmax(tiny_hf_model("llama")(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = sum(logprobs[i - 1, ids[i]].item() for i in range(1 + len(context_enc), len(ids)))
    ctxlen = len(context_enc)
    payload = {"model": MODEL, "prompt": text, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    harness = post(bos_url, "completions", payload).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert sum(harness[ctxlen:-1]) == pytest.approx(expected, abs=1e-4)
    scored = post(bos_url, "completions", payload | {"max_tokens": 0}).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert sum(scored[ctxlen:]) == pytest.approx(expected, abs=1e-4)


# ---- item 15: what the API key guards -----------------------------------------------------------------------------


def test_api_key_scope_all_guards_every_route_but_health(llama_llm):
    key = {"authorization": f"Bearer {API_KEY}"}
    with serving(llama_llm, api_key=API_KEY) as base:  # the default scope: the API only
        assert [httpx.get(f"{base}{path}").status_code for path in ("/metrics", "/openapi.json", "/docs")] == [200] * 3
        assert httpx.get(f"{base}/v1/models").status_code == 401
    with serving(llama_llm, api_key=API_KEY, api_key_scope="all") as base:
        for path in ("/metrics", "/openapi.json", "/docs", "/redoc", "/v1/models"):
            response = httpx.get(f"{base}{path}")
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(f"{base}{path}", headers=key).status_code == 200, path
        assert httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200
    with pytest.raises(ConfigError, match="api_key_scope all needs an api_key"):
        build_app(llama_llm, ServerOptions(served_model_name=MODEL, api_key_scope="all"))
    with pytest.raises(ConfigError, match="api_key_scope must be one of api, all"):
        build_app(llama_llm, ServerOptions(served_model_name=MODEL, api_key=API_KEY, api_key_scope="everything"))


def test_serve_api_key_scope_flag(capsys):
    assert build_parser().parse_args(["serve"]).api_key_scope == "api"
    assert build_parser().parse_args(["serve", "--api-key", "k", "--api-key-scope", "all"]).api_key_scope == "all"
    assert main(["serve", "--api-key-scope", "all"]) == 1  # before the build
    assert "--api-key-scope all needs --api-key" in capsys.readouterr().err


# ---- item 16: the demo model's chat template ---------------------------------------------------------------------


def _train_demo_model_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", REPO / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_model_ships_the_training_scripts_chat_template_which_teaches_hermes_calls():
    tokenizer = AutoTokenizer.from_pretrained(demo_model_directory())
    assert tokenizer.chat_template == _train_demo_model_script().CHAT_TEMPLATE
    assert tool_call_format(tokenizer) == "hermes"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    from autodeploy.frontend.tool_calls import tool_specs

    text = tokenizer.decode(render_chat(tokenizer, messages, tools=tool_specs(TOOLS)))
    eot = tokenizer.eos_token
    assert text.startswith(f"{eot}<|system|>\nBe brief.\n\nYou may call these functions")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert (f'<|user|>\nWeather in Rome?{eot}\n<|assistant|>\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}\n'
            f'</tool_call>{eot}\n<|tool|>\n<tool_response>\n{{"temperature": 21}}\n</tool_response>{eot}\n<|assistant|>\n') in text
    assert text.endswith("<|assistant|>\n")


def test_the_demo_model_answers_chat_and_tool_calls_out_of_the_box():
    llm = autodeploy(None, device="cpu")
    unit = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "temperature_unit", "parameters": unit}}]
    with serving(llm) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a sort."}], max_tokens=8)
        assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens >= 1
        called = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice="required", max_tokens=200,
                                                parallel_tool_calls=False, temperature=0).choices[0]
        assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.name == "temperature_unit"
        jsonschema.validate(json.loads(called.message.tool_calls[0].function.arguments), unit)
        auto = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, max_tokens=8)
        assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
