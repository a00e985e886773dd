"""Tool calling through the OpenAI server: ``tools`` / ``tool_choice`` (none, auto, required, a named
function), calls generated under the grammar and returned as ``tool_calls`` (whole and streamed),
``tool`` messages fed back, and the 400s. ``auto`` needs a model that decides to call: the tiny Llama
with its head edited so that ``<tool_call>`` (an added token) is its first choice on one conversation."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
import torch
from transformers import AutoTokenizer

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from autodeploy.frontend.chat_template import render_chat
from autodeploy.frontend.tool_calls import ToolChoice, tool_call_grammar
from autodeploy.serve import ServerOptions, build_app
from tests.frontend.test_tool_calls import SPECS, TOOLS, TOOLS_TEMPLATE, WEATHER
from tests.serve.test_openai_server import MODEL, serving
from tests.tiny_models import tiny_hf_model

GREEDY = dict(temperature=0.0)
QUESTION = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def client(llama_llm):
    with serving(llama_llm, chat_template=TOOLS_TEMPLATE) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def calling_client(llama_dir, tmp_path_factory):
    """A server over the tiny Llama whose greedy first token on ``QUESTION`` (with the tools) is ``<tool_call>``."""
    directory = tmp_path_factory.mktemp("tiny-llama-calls")
    shutil.copytree(llama_dir, directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen's tokenizer has them
    tokenizer.save_pretrained(directory)
    model = tiny_hf_model("llama")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    prompt = torch.tensor([render_chat(tokenizer, QUESTION, TOOLS_TEMPLATE, SPECS)])
    with torch.no_grad():
        hidden = model(prompt, output_hidden_states=True).hidden_states[-1][0, -1]  # after the final norm
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<tool_call>")] = 30 * hidden / hidden.norm() ** 2
    model.save_pretrained(directory)
    llm = autodeploy(str(directory), device="cpu")
    with serving(llm, chat_template=TOOLS_TEMPLATE) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client, **request) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls, finish_reason) accumulated from a stream's deltas."""
    content, calls, finish = "", {}, None
    for number, chunk in enumerate(client.chat.completions.create(model=MODEL, stream=True, **request)):
        (choice,) = chunk.choices
        assert number == 0 or choice.delta.content or choice.delta.tool_calls or choice.finish_reason  # no empty chunks
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            assert call.id and call.type == "function" and call.index not in calls
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_come_back_as_tool_calls(client, tool_choice):
    request = dict(messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, max_tokens=150, parallel_tool_calls=False, **GREEDY)
    response = client.chat.completions.create(model=MODEL, **request)
    (choice,) = response.choices
    calls = calls_of(choice.message)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and len(calls) == 1
    name, arguments = calls[0]
    assert isinstance(tool_choice, str) or name == "get_weather"
    jsonschema.validate(arguments, WEATHER if name == "get_weather" else {"type": "object"})
    assert choice.message.tool_calls[0].id.startswith("call_")
    assert streamed(client, **request) == ("", calls, "tool_calls")


def test_a_call_cut_off_by_max_tokens_is_reported_as_openai_does(client):
    """finish_reason "length"; the call so far in tool_calls (its arguments' JSON text cut where generation
    stopped); no markup in content, whole or streamed (it leaked '<tool_call>\\n{"name": …' before)."""
    request = dict(messages=QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False, **GREEDY)
    answer = client.chat.completions.create(model=MODEL, max_tokens=150, **request)
    full_arguments = answer.choices[0].message.tool_calls[0].function.arguments
    reported = 0
    for max_tokens in range(2, answer.usage.completion_tokens, 4):
        (choice,) = client.chat.completions.create(model=MODEL, max_tokens=max_tokens, **request).choices
        if choice.finish_reason != "length":
            continue
        assert choice.message.content is None, choice.message.content
        for call in choice.message.tool_calls or []:
            # the text as generated (the whole call's arguments come back re-encoded, with ", " and ": ")
            assert call.function.name == "get_weather" and compact(full_arguments).startswith(compact(call.function.arguments))
            reported += 1
        content, arguments = "", []
        for chunk in client.chat.completions.create(model=MODEL, max_tokens=max_tokens, stream=True, **request):
            content += chunk.choices[0].delta.content or ""
            arguments += [c.function.arguments for c in chunk.choices[0].delta.tool_calls or []]
        assert content == "" and arguments == [c.function.arguments for c in choice.message.tool_calls or []]
    assert reported  # some cut fell inside the arguments


def compact(json_text: str) -> str:
    return "".join(json_text.split())


def test_tool_choice_none_generates_text_as_without_tools(client, llama_llm):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=12, **GREEDY)
    prompt = render_chat(llama_llm.tokenizer, QUESTION, TOOLS_TEMPLATE, SPECS)
    expected = llama_llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0]
    assert response.choices[0].message.content == expected.text and not response.choices[0].message.tool_calls


def test_auto_calls_when_the_model_starts_a_call(calling_client):
    request = dict(messages=QUESTION, tools=TOOLS, max_tokens=150, parallel_tool_calls=False, **GREEDY)  # tool_choice: auto
    (choice,) = calling_client.chat.completions.create(model=MODEL, **request).choices
    calls = calls_of(choice.message)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and len(calls) == 1
    name, arguments = calls[0]
    jsonschema.validate(arguments, WEATHER if name == "get_weather" else {"type": "object"})
    assert streamed(calling_client, **request) == ("", calls, "tool_calls")


def test_tool_results_are_fed_back(client, llama_llm):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, **GREEDY)
    prompt = render_chat(llama_llm.tokenizer, messages, TOOLS_TEMPLATE, SPECS)
    assert response.usage.prompt_tokens == len(prompt)
    text = llama_llm.tokenizer.decode(prompt)
    assert '"arguments": {"city": "Rome"}' in text and '<|tool|>{"temperature": 21}' in text


@pytest.mark.parametrize("request_fields, param, message", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice", "not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), None, "use one"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools", "function.name must be"),
    (dict(messages=[*QUESTION, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]),
     None, "arguments are not valid JSON"),
])
def test_bad_tool_requests_are_400s(client, request_fields, param, message):
    request = dict(messages=QUESTION, max_tokens=4) | request_fields
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        client.chat.completions.create(model=MODEL, **request)
    assert raised.value.body["param"] == param
    # the server keeps serving (ignore_eos: a sampled EOS would end it early, with "stop")
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"


def test_calls_in_the_json_format(llama_llm):
    """``--tool-call-format json``: calls generated as bare {"name", "parameters"} objects (Llama 3.x's)."""
    with serving(llama_llm, chat_template=TOOLS_TEMPLATE, tool_call_format="json") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        request = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=150, parallel_tool_calls=False, **GREEDY)
        (choice,) = client.chat.completions.create(model=MODEL, **request).choices
        calls = calls_of(choice.message)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None and len(calls) == 1
        assert streamed(client, **request) == ("", calls, "tool_calls")
    prompt = render_chat(llama_llm.tokenizer, QUESTION, TOOLS_TEMPLATE, SPECS)
    raw = llama_llm.generate(prompt, SamplingParams(max_tokens=150, **GREEDY, structural_tag=tool_call_grammar(
        SPECS, ToolChoice("required", parallel=False, format="json"))))[0].text
    assert raw.startswith('{"name": ') and '"parameters": ' in raw


def test_a_bad_tool_call_format_fails_when_the_app_is_built(llama_llm):
    with pytest.raises(ConfigError, match="tool call format must be"):
        build_app(llama_llm, ServerOptions(served_model_name=MODEL, tool_call_format="xml"))
