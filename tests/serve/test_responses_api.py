"""The Responses API (``POST /v1/responses``), ``GET /v1/models/{id}`` and ``GET /tokenizer_info`` over the tiny
Llama, driven by the official ``openai`` client (and raw HTTP where the client would hide what is sent or returned).

A response is the chat path's answer in another shape, so each test compares it with the chat completion of the
same conversation on the same server (greedy): the same text, calls, finish and token counts. Every object and
stream event is validated against the client's own pydantic types."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from autodeploy import SamplingParams
from autodeploy.frontend.chat_template import render_chat
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.responses import ResponsesRequest, _events, _OutputWriter
from autodeploy.serve.server import serving_in_thread
from tests.serve.test_openai_server import metric, wait_idle

MODEL = "tiny/llama"  # a slash, as hub ids have: GET /v1/models/{id} must take it
GREEDY = dict(temperature=0.0)
# A template that reads ``tools`` (names only: the tiny model's context is 512 byte-level tokens) and writes calls.
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }} {% endfor %}{{ '\\n' }}{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ (m.tool_calls | tojson) if m.tool_calls else '' }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather now.", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in tool.items() if k not in ("type", "strict")}} for tool in TOOLS]
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


# An enum and a bounded integer, no other properties: the random model's JSON ends within a few dozen tokens.
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "size"], "additionalProperties": False}


class Paint(pydantic.BaseModel):
    """SCHEMA as a pydantic model, for the client's ``text_format``."""

    color: Literal["red", "green"]
    size: int = pydantic.Field(ge=0, le=9)


def app(llm, **options):
    return build_app(llm, ServerOptions(served_model_name=MODEL, **options))


@pytest.fixture(scope="module")
def url(llama_llm):
    """A server on loopback whose chat template reads tools."""
    with serving_in_thread(app(llama_llm, chat_template=TEMPLATE)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def checked(response) -> Response:
    """The response, validated as the client's pydantic type (the client itself builds objects without checking)."""
    return Response.model_validate(response.to_dict())


def events_of(client, **request) -> list:
    """A streamed response's events, each validated; sequence numbers count from 0."""
    events = [STREAM_EVENT.validate_python(event.to_dict()) for event in client.responses.create(model=MODEL, stream=True, **request)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def chat(client, messages, **request):
    return client.chat.completions.create(model=MODEL, messages=messages, **request).choices[0]


# ---- /v1/models/{id} and /tokenizer_info -----------------------------------------------------------------------


def test_models_retrieve_returns_the_listed_card_and_404s_an_unknown_id(client, url):
    card = client.models.retrieve(MODEL)
    assert card.to_dict() == client.models.list().data[0].to_dict() and card.id == MODEL
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4o")
    error = raised.value.body
    assert set(error) == {"message", "type", "param", "code"} and "tiny/llama" in error["message"]
    assert (error["type"], error["param"], error["code"]) == ("not_found_error", "model", "model_not_found")
    assert httpx.get(f"{url}/v1/models/{MODEL}").json()["id"] == MODEL  # the slash unescaped, as a browser sends it


def test_tokenizer_info_is_vllms(llama_llm, url):
    """What lm-eval's remote tokenizer reads (``eos_token``, ``bos_token``, ``pad_token``, ``chat_template``) and
    vLLM's other keys: the tokenizer's config with ``tokenizer_class``, and the server's template."""
    info = httpx.get(f"{url}/tokenizer_info").json()
    tokenizer = llama_llm.tokenizer
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token)
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["chat_template"] == TEMPLATE
    assert info["model_max_length"] == llama_llm.engine.max_seq_len
    assert "vocab_file" not in info and "tokenizer_file" not in info  # no paths of the server's disk
    assert tokenizer(info["eos_token"], add_special_tokens=False).input_ids == [tokenizer.eos_token_id]


def test_lm_evals_remote_tokenizer_probe(url):
    """lm_eval.utils.check_remote_tokenizer_support's calls: /tokenize and /detokenize without a model."""
    assert "eos_token" in httpx.get(f"{url}/tokenizer_info").json()
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "test"
    assert httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "test"}).status_code == 400  # a wrong one still is


def test_the_new_routes_need_the_api_key(llama_llm):
    with serving_in_thread(app(llama_llm, chat_template=TEMPLATE, api_key="sk-test")) as base:
        for method, path in [("GET", f"/v1/models/{MODEL}"), ("GET", "/tokenizer_info"), ("POST", "/v1/responses")]:
            refused = httpx.request(method, f"{base}{path}", json={"model": MODEL, "input": "x"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        answer = httpx.get(f"{base}/tokenizer_info", headers={"Authorization": "Bearer sk-test"})
        assert answer.status_code == 200


# ---- text ---------------------------------------------------------------------------------------------------------


def test_a_plain_response_is_the_chat_answer(client):
    reference = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=12,
                                               **GREEDY)
    response = checked(client.responses.create(model=MODEL, input="hello", max_output_tokens=12, **GREEDY))
    assert response.output_text == reference.choices[0].message.content
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        reference.usage.prompt_tokens, reference.usage.completion_tokens, reference.usage.total_tokens)
    finished = reference.choices[0].finish_reason == "stop"
    assert response.status == ("completed" if finished else "incomplete") and message.status == response.status
    assert response.max_output_tokens == 12 and response.temperature == 0.0 and response.tools == []


def test_a_response_cut_off_by_max_output_tokens_is_incomplete(llama_llm, client):
    prompt = render_chat(llama_llm.tokenizer, [{"role": "user", "content": "hello"}], TEMPLATE)
    assert llama_llm.generate(prompt, SamplingParams(max_tokens=3, **GREEDY))[0].finish_reason == "length"
    response = checked(client.responses.create(model=MODEL, input="hello", max_output_tokens=3, **GREEDY))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = events_of(client, input="hello", max_output_tokens=3, **GREEDY)
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


def test_instructions_and_input_items_are_the_chat_messages(client):
    """``instructions`` is the system turn; message items (text parts, an earlier answer fed back as an output
    message) are the turns, in order."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "def fib"}, {"type": "input_text", "text": "(n):"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "return n", "annotations": []}]},
             {"type": "message", "role": "user", "content": "again"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def fib(n):"},
                {"role": "assistant", "content": "return n"}, {"role": "user", "content": "again"}]
    reference = chat(client, messages, max_completion_tokens=10, **GREEDY)
    response = checked(client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=10, **GREEDY))
    assert response.output_text == reference.message.content and response.instructions == "Be brief."


def test_streamed_events_come_in_openais_order_and_add_up(client):
    whole = checked(client.responses.create(model=MODEL, input="hello", max_output_tokens=40, **GREEDY))
    events = events_of(client, input="hello", max_output_tokens=40, **GREEDY)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                                     "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text and final.usage.to_dict() == whole.usage.to_dict()
    assert {e.item_id for e in events[3:-2]} == {final.output[0].id}


def test_the_clients_stream_helper_accumulates_the_final_response(client):
    """``responses.stream`` checks the events' order and item ids as it accumulates them, and needs a
    ``response.completed``: under a JSON schema the tiny model's answer ends (its free text never does)."""
    with client.responses.stream(model=MODEL, input="x", text_format=Paint, max_output_tokens=60, **GREEDY) as stream:
        final = stream.get_final_response()
    reference = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=Paint,
                                              max_tokens=60, **GREEDY).choices[0].message
    assert final.status == "completed" and final.output_text == reference.content and final.output_parsed == reference.parsed


def test_logprobs_are_the_chat_logprobs(client):
    reference = chat(client, [{"role": "user", "content": "hi"}], max_completion_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    request = dict(input="hi", max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY)
    # approx: a prompt served from the prefix cache runs a shorter prefill, with other rounding
    expected = [(c.token, pytest.approx(c.logprob, abs=1e-4), [t.token for t in c.top_logprobs]) for c in reference.logprobs.content]
    part = checked(client.responses.create(model=MODEL, **request)).output[0].content[0]
    assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in part.logprobs] == expected
    streamed = [lp for e in events_of(client, **request) if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in streamed] == expected
    plain = checked(client.responses.create(model=MODEL, input="hi", max_output_tokens=2))
    assert plain.output[0].content[0].logprobs is None  # only when included


def test_a_client_leaving_mid_stream_aborts_its_request(llama_llm, url):
    aborted = metric(url, "autodeploy_requests_total", finish_reason="abort")
    body = {"model": MODEL, "input": "x", "max_output_tokens": 400, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as response:
        kinds = (line for line in response.iter_lines() if line.startswith("event: "))
        assert next(kinds) == "event: response.created" and "event: response.output_text.delta" in kinds
    wait_idle(llama_llm)  # aborted long before its 400 tokens (the greedy answer to "x" runs to the limit): its blocks are back
    assert metric(url, "autodeploy_requests_total", finish_reason="abort") == aborted + 1


# ---- tools and structured output -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_are_the_chat_tool_calls(client, tool_choice):
    question = [{"role": "user", "content": "Weather in Rome?"}]
    chat_choice = tool_choice if isinstance(tool_choice, str) else {"type": "function", "function": {"name": "get_weather"}}
    reference = chat(client, question, tools=CHAT_TOOLS, tool_choice=chat_choice, parallel_tool_calls=False, max_tokens=150, **GREEDY)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in reference.message.tool_calls]
    request = dict(input="Weather in Rome?", tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_output_tokens=150,
                   **GREEDY)
    response = checked(client.responses.create(model=MODEL, **request))
    assert [(c.name, json.loads(c.arguments)) for c in response.output] == expected and len(expected) == 1
    (call,) = response.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "get_weather" else {"type": "object"})
    assert response.status == "completed" and response.output_text == ""
    echoed = response.tool_choice if isinstance(response.tool_choice, str) else response.tool_choice.to_dict()
    assert echoed == tool_choice and [t.to_dict() for t in response.tools] == TOOLS

    events = events_of(client, **request)
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
    assert delta.delta == done.arguments == item_done.item.arguments and json.loads(done.arguments) == expected[0][1]
    assert {added.item.id, delta.item_id, done.item_id, item_done.item.id} == {events[-1].response.output[0].id}


def test_function_call_outputs_are_fed_back_as_tool_turns(llama_llm, client):
    """A ``function_call`` item is the assistant's call and its ``function_call_output`` the tool's turn: the same
    prompt as the chat messages, so the same greedy answer."""
    items = [{"role": "user", "content": "Weather in Rome?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}', "id": "fc_1",
              "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [{"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reference = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, tool_choice="none", max_tokens=8, **GREEDY)
    response = checked(client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=8, **GREEDY))
    assert response.output_text == reference.choices[0].message.content
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    prompt = llama_llm.tokenizer.decode(render_chat(llama_llm.tokenizer, messages, TEMPLATE))
    assert '"arguments": {"city": "Rome"}' in prompt and '<|tool|>{"temperature": 21}' in prompt


def test_text_format_json_schema_is_structured_output(client):
    text = {"format": {"type": "json_schema", "name": "paint", "schema": SCHEMA, "strict": True}}
    response = checked(client.responses.create(model=MODEL, input="def f(x):", text=text, max_output_tokens=60, **GREEDY))
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    streamed = events_of(client, input="def f(x):", text=text, max_output_tokens=60, **GREEDY)
    assert streamed[-1].response.output_text == response.output_text
    parsed = client.responses.parse(model=MODEL, input="x", text_format=Paint, max_output_tokens=60, **GREEDY)
    assert isinstance(parsed.output_parsed, Paint)
    json_object = checked(client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}},
                                                  max_output_tokens=60, **GREEDY))
    reference = chat(client, [{"role": "user", "content": "x"}], response_format={"type": "json_object"}, max_tokens=60, **GREEDY)
    assert json_object.output_text == reference.message.content and json_object.output_text.startswith("{")


def test_reasoning_is_a_reasoning_item(llama_llm):
    """``--reasoning-parser think`` with a prompt that opens the block: an answer cut off inside it is all
    reasoning, returned as a reasoning item with the chat's ``reasoning_content`` (whole and streamed)."""
    template = TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>\n{% endif %}")
    with serving_in_thread(app(llama_llm, chat_template=template, reasoning_parser="think")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        reference = chat(client, [{"role": "user", "content": "hello"}], max_tokens=10, **GREEDY).message.to_dict()
        response = checked(client.responses.create(model=MODEL, input="hello", max_output_tokens=10, **GREEDY))
        events = events_of(client, input="hello", max_output_tokens=10, **GREEDY)
    assert reference.get("content") is None and reference["reasoning_content"]
    (item,) = response.output
    assert item.type == "reasoning" and item.content[0].text == reference["reasoning_content"] and item.summary == []
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reference["reasoning_content"]
    assert events[-1].response.output[0].content[0].text == reference["reasoning_content"]


# ---- refusals --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param, message", [
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input", "input items"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "input items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input", "text"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input", "role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "now", "arguments": "{"}]}, "input", "JSON"),
    ({"input": 5}, "input", None),
    ({"input": []}, "input", None),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "defer_loading": True}]}, "tools", None),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"max_output_tokens": "4"}, "max_output_tokens", None),
    ({"max_output_tokens": True}, "max_output_tokens", None),
    ({"temperature": "hot"}, "temperature", None),
    ({"temperature": 5}, "temperature", None),
    ({"stream": "yes"}, "stream", None),
    ({"an_unknown_field": 1}, "an_unknown_field", None),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"conversation": "conv_1"}, "conversation", "not stored"),
    ({"background": True}, "background", "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
    ({"include": ["message.output_text.logprobs", "everything"]}, "include", None),
    ({"top_logprobs": 2}, "top_logprobs", "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text", "nonsense"),
    ({"text": {"verbosity": "low"}}, "text", "verbosity"),
    ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text", "use one"),
    ({"include": ["message.output_text.logprobs"], "tools": TOOLS}, "include", "text answers only"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input", None),
    ({"model": "gpt-4o"}, "model", "not served"),
    ({"input": "x" * 3000}, "input", "max_seq_len"),
])
def test_bad_requests_are_400s_in_openais_shape(url, client, fields, param, message):
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 2} | fields
    answer = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and (message is None or message in error["message"]), error
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hello", extra_body=body)


def test_bookkeeping_fields_are_accepted(client):
    response = checked(client.responses.create(
        model=MODEL, input="hello", max_output_tokens=2, user="u1", metadata={"run": "7"}, store=False, service_tier="auto",
        prompt_cache_key="k", safety_identifier="s", parallel_tool_calls=True, truncation="disabled", background=False,
        reasoning={"effort": None}, include=["reasoning.encrypted_content"], text={"verbosity": "medium"}))
    assert response.metadata == {"run": "7"} and response.user == "u1"


def test_a_chat_stream_that_fails_ends_the_response_as_failed():
    """The chat stream reports an engine failure (or a shutdown) in the stream once it has begun: the response
    ends with ``response.failed``, carrying the error and the output so far."""
    async def chat_stream():
        delta = {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None, "logprobs": None}
        yield f"data: {json.dumps({'choices': [delta]})}\n\n"
        error = {"message": "the request was aborted", "type": "server_error", "param": None, "code": "aborted"}
        yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"

    async def events():
        request = ResponsesRequest.model_validate({"model": MODEL, "input": "hello", "stream": True})
        writer = _OutputWriter(request, MODEL, count_tokens=len)
        return [line async for line in _events(writer, chat_stream())]

    sent = [json.loads(event.split("data: ", 1)[1]) for event in asyncio.run(events())]
    kinds = [STREAM_EVENT.validate_python(event).type for event in sent]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.failed"]
    failed = sent[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "the request was aborted"}
    assert failed["output"][0]["content"][0]["text"] == "Hel" and failed["output"][0]["status"] == "incomplete"
