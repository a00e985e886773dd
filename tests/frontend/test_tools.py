"""``ToolRegistry`` (schemas from type hints and docstrings, calls that fail as messages) and the
in-process agent loop ``LLM.chat`` over the tiny Llama."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Literal

import jsonschema
import pytest

from autodeploy import SamplingParams, ToolRegistry
from autodeploy.errors import ConfigError, InvalidRequestError
from autodeploy.frontend.tool_calls import CutOffToolCall, ToolCall
from tests.frontend.test_tool_calls import TOOLS, TOOLS_TEMPLATE


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def weather_registry(calls: list | None = None) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.register
    def get_weather(city: Literal["Paris", "Rome"], unit: Unit = Unit.CELSIUS) -> dict:
        """The weather in a city now.

        Args:
            city: the city's name,
                one of two.
            unit: how temperatures are given.

        Returns:
            the temperature.
        """
        if calls is not None:
            calls.append(city)
        return {"city": city, "temperature": 21 if city == "Rome" else 14}

    return registry


def test_schemas_come_from_type_hints_and_docstrings():
    registry = ToolRegistry()

    @registry.register(name="search", description="Search the docs.")
    def find(query: str, limit: int = 5, tags: list[str] | None = None, weights: dict[str, float] | None = None,
             exact: Annotated[bool, "match the whole phrase"] = False, ratio: tuple[float, ...] = ()) -> list:
        """Ignored, since a description is given.

        :param query: what to look for
        :param limit: at most this many
        :returns: the hits
        """
        return []

    weather = weather_registry()
    (spec,) = registry.specs()
    assert (spec.name, spec.description) == ("search", "Search the docs.")
    assert spec.parameters == {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": "what to look for"},
        "limit": {"type": "integer", "description": "at most this many"},
        "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "weights": {"anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]},
        "exact": {"type": "boolean", "description": "match the whole phrase"},
        "ratio": {"type": "array", "items": {"type": "number"}}}}
    (weather_spec,) = weather.specs()
    assert weather_spec.description == "The weather in a city now."
    assert weather_spec.parameters["properties"] == {
        "city": {"enum": ["Paris", "Rome"], "description": "the city's name, one of two."},
        "unit": {"enum": ["celsius", "fahrenheit"], "description": "how temperatures are given."}}
    assert weather.schemas()[0]["function"]["name"] == "get_weather" and "get_weather" in weather and len(weather) == 1
    jsonschema.Draft202012Validator.check_schema(spec.parameters)


def untyped(x):
    return x


def star(*values: int):
    return values


def odd_keys(table: dict[int, str]):
    return table


def a_set(values: set[int]):
    return values


@pytest.mark.parametrize("function, message", [
    (untyped, "parameter 'x' has no type hint"),
    (star, r"\*values cannot be described"),
    (odd_keys, "keys are strings"),
    (a_set, "has no JSON Schema here"),
])
def test_functions_without_a_schema_are_refused_at_registration(function, message):
    with pytest.raises(ConfigError, match=message):
        ToolRegistry().register(function)


def test_a_name_registered_twice_is_refused():
    registry = weather_registry()
    with pytest.raises(ConfigError, match="already registered"):
        registry.register(lambda city: city, name="get_weather")


def test_calls_that_fail_come_back_as_messages_for_the_model():
    registry = weather_registry()

    @registry.register
    def explode() -> None:
        """Always fails."""
        raise RuntimeError("no network")

    assert registry.call(ToolCall("get_weather", {"city": "Rome"})).output == '{"city": "Rome", "temperature": 21}'
    failures = [registry.call(ToolCall("explode", {})), registry.call(ToolCall("get_weather", {"town": "Rome"})),
                registry.call(ToolCall("missing", {}))]
    assert [f.error for f in failures] == [
        "explode raised RuntimeError: no network",
        "the arguments do not fit get_weather: missing a required argument: 'city'",
        "there is no tool named 'missing' (tools: get_weather, explode)",
    ]
    assert all(f.output == f"error: {f.error}" for f in failures)


def test_chat_runs_the_calls_and_feeds_the_results_back(llama_llm):
    ran: list[str] = []
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    params = SamplingParams(max_tokens=120, temperature=0)
    reply = llama_llm.chat(messages, params, tools=weather_registry(ran), tool_choice="required", max_rounds=3,
                           chat_template=TOOLS_TEMPLATE)
    assert len(reply.trace) == len(ran) >= 1  # round 1 had to call; later rounds are "auto"
    first = reply.messages[1]
    assert first["role"] == "assistant" and first["content"] is None
    call = first["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    result = reply.messages[2]
    assert result == {"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": reply.trace[0].output}
    assert reply.messages[:1] == messages and reply.messages[-1]["role"] == "assistant"
    assert reply.finish_reason in ("stop", "length") and reply.content == reply.messages[-1]["content"]
    assert len(reply.outputs) == 2  # the tiny model answers in text once the call is made
    # the second round saw the call and its result: its prompt is the rendered conversation so far
    assert reply.outputs[1].prompt_token_ids[: len(reply.outputs[0].prompt_token_ids)] == reply.outputs[0].prompt_token_ids


def test_chat_never_runs_a_call_cut_off_by_max_tokens(llama_llm):
    ran: list[str] = []
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    call = dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, chat_template=TOOLS_TEMPLATE)
    schemas = [spec.to_openai() for spec in weather_registry().specs()]  # the same tools, returned unrun
    whole = llama_llm.chat(messages, SamplingParams(max_tokens=120, temperature=0), tools=schemas, **call)
    cut = len(whole.outputs[0].outputs[0].token_ids) - 20  # inside the arguments (the byte-level end tag and braces are ~16)
    reply = llama_llm.chat(messages, SamplingParams(max_tokens=cut, temperature=0), tools=weather_registry(ran), **call)
    assert reply.finish_reason == "length" and not ran and not reply.trace and reply.content is None
    [cut_off] = reply.tool_calls
    assert isinstance(cut_off, CutOffToolCall) and cut_off.name == "get_weather"
    assert reply.messages[-1]["tool_calls"] == [cut_off.to_openai()]


def test_chat_with_tool_schemas_returns_the_calls_unrun(llama_llm):
    reply = llama_llm.chat([{"role": "user", "content": "Time?"}], SamplingParams(max_tokens=120, temperature=0), tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "now"}}, chat_template=TOOLS_TEMPLATE)
    assert [c.name for c in reply.tool_calls] == ["now"] and reply.finish_reason == "tool_calls" and not reply.trace


def test_chat_in_the_json_call_format(llama_llm):
    reply = llama_llm.chat([{"role": "user", "content": "Time?"}], SamplingParams(max_tokens=120, temperature=0), tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "now"}}, chat_template=TOOLS_TEMPLATE,
                           tool_call_format="json")
    assert [c.name for c in reply.tool_calls] == ["now"] and reply.outputs[0].outputs[0].text.startswith('{"name": "now", "parameters": ')


def test_chat_stops_after_max_rounds(llama_llm):
    reply = llama_llm.chat([{"role": "user", "content": "Weather?"}], SamplingParams(max_tokens=120, temperature=0),
                           tools=weather_registry(), tool_choice="required", max_rounds=1, chat_template=TOOLS_TEMPLATE)
    assert reply.finish_reason == "max_rounds" and len(reply.trace) >= 1 and reply.messages[-1]["role"] == "tool"


def test_chat_without_tools_is_one_turn(llama_llm):
    messages = [{"role": "user", "content": "Hello"}]
    reply = llama_llm.chat(messages, SamplingParams(max_tokens=8, temperature=0), chat_template=TOOLS_TEMPLATE)
    prompt = llama_llm.tokenizer.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True)
    expected = llama_llm.generate(llama_llm.tokenizer(prompt, add_special_tokens=False).input_ids, SamplingParams(max_tokens=8, temperature=0))
    assert reply.content == expected[0].text and reply.tool_calls == [] and len(reply.messages) == 2


def test_chat_splits_off_the_reasoning(llama_llm):
    """``reasoning=True`` with a template whose generation prompt opens a think block: the turn (10 tokens,
    never closing it) is all reasoning, kept beside the turn; without ``reasoning`` it is the content."""
    template = TOOLS_TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>\n{% endif %}")
    assert template != TOOLS_TEMPLATE
    messages, params = [{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = llama_llm.chat(messages, params, chat_template=template)
    thought = llama_llm.chat(messages, params, chat_template=template, reasoning=True)
    assert "</think>" not in plain.content
    assert (thought.reasoning, thought.content) == (plain.content, None) and plain.reasoning is None
    assert thought.messages[-1] == {"role": "assistant", "content": None, "reasoning_content": plain.content}


@pytest.mark.parametrize("kwargs, message", [
    (dict(messages=[]), "non-empty list of messages"),
    (dict(max_rounds=0), "max_rounds must be"),
    (dict(params=SamplingParams(n=2)), "use n=1"),
    (dict(tool_choice="required"), 'tool_choice "required" needs tools'),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]), "cannot be enforced"),
])
def test_bad_chat_calls_are_refused(llama_llm, kwargs, message):
    arguments = dict(messages=[{"role": "user", "content": "x"}], chat_template=TOOLS_TEMPLATE) | kwargs
    with pytest.raises(InvalidRequestError, match=message):
        llama_llm.chat(**arguments)
