"""Tool calls: parsing calls out of text (whole or streamed), the tools' checks, and generation under the
call grammar on the tiny Llama (every call parses and its arguments validate against the tool's schema)."""

from __future__ import annotations

import doctest
import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy import SamplingParams
from autodeploy.errors import InvalidRequestError
from autodeploy.frontend.chat_template import render_chat, tool_call_format, tool_calls_of
from autodeploy.frontend.tool_calls import (
    CutOffToolCall, ToolCall, ToolCallParser, ToolChoice, ToolSpec, parse_tool_calls, parse_tool_choice, tool_call_grammar, tool_specs,
)

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
SPECS = tool_specs(TOOLS)
# A template that reads ``tools`` (names only: the tiny model's context is 512 byte-level tokens).
TOOLS_TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }} {% endfor %}{{ '\\n' }}{% endif %}"
                  "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ (m.tool_calls | tojson) if m.tool_calls else '' }}\n"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


# ---- parsing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", {"city": "Rome"})]),
    ("Let me look.\n" + CALL, "Let me look.\n", [("get_weather", {"city": "Rome"})]),
    (CALL + "\n" + CALL.replace("Rome", "Paris"), None, [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Paris"})]),
    (CALL + "\nDone.", "\nDone.", [("get_weather", {"city": "Rome"})]),
    ('{"name": "now", "parameters": {}}', None, [("now", {})]),                                   # Llama 3.1's bare JSON
    ('[{"name": "now", "arguments": "{}"}, {"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("now", {}), ("get_weather", {"city": "Paris"})]),                                              # a list, arguments as text
    ('```json\n{"name": "now", "arguments": {}}\n```', None, [("now", {})]),
    ('{"name": "now", "parameters": {}}\n{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("now", {}), ("get_weather", {"city": "Rome"})]),                                          # json format, several
    ('{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}', None, [("now", {}), ("now", {})]),
    ('{"name": "now", "parameters": {}} and more', "and more", [("now", {})]),
    ('{"name": "now", "parameters": {}}\n{"name": "now", "param', None, [("now", {}), ("now", "")]),  # cut short
    ('{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),           # not a tool: content
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('<tool_call>\n{"name": "now", "arguments": {}}', None, [("now", {})]),                          # cut before its end tag
    ("a < b and <tool", "a < b and ", []),                                                          # cut inside the tag
    ("a <", "a <", []),
    # cut off by max_tokens mid-call: reported as OpenAI does, with the arguments so far, never as content
    ('<tool_call>\n{"name": "get_weather", "arguments', None, [("get_weather", "")]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
    ('Sure.\n<tool_call>\n{"na', "Sure.\n", []),
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_c', None, [("now", {})]),      # cut inside the end tag
    ('{"name": "now", "parameters": {}}\n{"n', None, [("now", {})]),
    ('{"name": "get_w', None, []),
    ('<tool_call>\n{"name": "unknown", "arguments": {', None, []),
    ('{"name": "get_weather", "parameters": {"ci', None, [("get_weather", '{"ci')]),
    ("plain text", "plain text", []),
    ("", None, []),
])
def test_parse_tool_calls(text, content, calls):
    parsed_content, parsed = parse_tool_calls(text, SPECS)
    assert parsed_content == content
    assert [summary(c) for c in parsed] == calls
    assert len({c.id for c in parsed}) == len(parsed)


def summary(call: ToolCall | CutOffToolCall) -> tuple:
    """(name, arguments): a dict for a whole call, the JSON text so far for one cut off."""
    return (call.name, call.arguments) if isinstance(call, ToolCall) else (call.name, call.arguments_text)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([CALL, "Hi " + CALL + " bye", "\n \n" + CALL + "\n\n" + CALL, '{"name": "now", "arguments": {}}',
                        "x <tool_call y", "text\n\nwith  spaces ", "<tool_call>\n{bad}\n</tool_call> after",
                        CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', "a <tool_c"]),
       st.lists(st.integers(min_value=1, max_value=90), max_size=8))
def test_streamed_pieces_parse_as_the_whole_text_does(text, cuts):
    """However the text is split into deltas, the parser gives the same content and calls as on the whole."""
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    parser = ToolCallParser(SPECS)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    whole_content, whole_calls = parse_tool_calls(text, SPECS)
    assert (content if content.strip() else None) == whole_content
    assert [summary(c) for c in events if not isinstance(c, str)] == [summary(c) for c in whole_calls]


# ---- checks ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tools, message", [
    ([], "non-empty list"),
    ([{"type": "code_interpreter"}], "only function tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "function.name must be"),
    ([TOOLS[1], TOOLS[1]], "two tools are named 'now'"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "parameters must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], r"tools\[0\] \(f\): its parameters cannot be enforced"),
])
def test_bad_tools_are_refused(tools, message):
    with pytest.raises(InvalidRequestError, match=message) as raised:
        tool_specs(tools)
    assert raised.value.param == "tools"


@pytest.mark.parametrize("value, specs, message", [
    ("sometimes", SPECS, "tool_choice must be"),
    ("required", None, 'tool_choice "required" needs tools'),
    ({"type": "function", "function": {"name": "missing"}}, SPECS, "names 'missing', which is not among the tools"),
    ({"type": "function"}, SPECS, "tool_choice must be"),
])
def test_bad_tool_choice_is_refused(value, specs, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_tool_choice(value, specs)


def test_tool_choice_defaults_follow_openai():
    assert parse_tool_choice(None, SPECS).mode == "auto" and parse_tool_choice(None, None).mode == "none"
    named = parse_tool_choice({"type": "function", "function": {"name": "now"}}, SPECS)
    assert (named.mode, named.name, named.parallel) == ("function", "now", False)
    assert tool_call_grammar(SPECS, ToolChoice("none")) is None


# ---- rendering ------------------------------------------------------------------------------------------------


def test_a_template_that_reads_tools_gets_them_and_the_calls(llama_llm):
    tokenizer = llama_llm.tokenizer
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    text = tokenizer.decode(render_chat(tokenizer, messages, TOOLS_TEMPLATE, SPECS))
    assert text.startswith("<|tools|>get_weather now \n<|user|>Weather?\n")
    assert '"arguments": {"city": "Rome"}' in text  # a dict for the template, as Hugging Face templates expect
    assert "<|tool|>21 C\n<|assistant|>" in text


def test_a_template_that_ignores_tools_gets_them_in_the_system_turn(llama_llm):
    tokenizer = llama_llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [ToolCall("get_weather", {"city": "Rome"}, id="c")]},
                {"role": "tool", "tool_call_id": "c", "content": "21 C"}]
    text = tokenizer.decode(render_chat(tokenizer, messages, PLAIN_TEMPLATE, SPECS))
    assert text.startswith("<|system|>Be brief.\n\nYou may call these functions")
    assert json.dumps(SPECS[0].to_openai()) in text
    assert "<|assistant|>" + ToolCall("get_weather", {"city": "Rome"}).to_text() + "\n" in text
    assert "<|user|><tool_response>\n21 C\n</tool_response>\n<|assistant|>" in text


def test_malformed_tool_calls_in_messages_are_refused():
    with pytest.raises(InvalidRequestError, match="arguments are not valid JSON"):
        tool_calls_of({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]})
    with pytest.raises(InvalidRequestError, match=r"tool_calls\[0\] must be"):
        tool_calls_of({"role": "assistant", "tool_calls": [{"type": "function"}]})


# ---- generation under the grammar -----------------------------------------------------------------------------


def _generate(llm, choice: ToolChoice, seed: int | None = None, n: int = 1):
    prompt = render_chat(llm.tokenizer, [{"role": "user", "content": "Weather in Rome?"}], TOOLS_TEMPLATE, SPECS)
    params = SamplingParams(max_tokens=160, temperature=0 if seed is None else 1.0, seed=seed, n=n,
                            structural_tag=tool_call_grammar(SPECS, choice))
    return llm.generate([prompt], params)[0]


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("required", parallel=False),
                                    ToolChoice("function", "get_weather", parallel=False),
                                    ToolChoice("required", format="json"), ToolChoice("function", "now", parallel=False, format="json")])
def test_required_and_named_calls_are_valid_calls_of_the_tools(llama_llm, choice):
    output = _generate(llama_llm, choice)
    for seed in (1, 2):
        output.outputs.extend(_generate(llama_llm, choice, seed=seed, n=2).outputs)
    schemas = {spec.name: spec.parameters for spec in SPECS}
    for completion in output.outputs:
        content, calls = parse_tool_calls(completion.text, SPECS)
        assert calls, completion.text
        assert content is None, completion.text  # a call cut short is a CutOffToolCall, never text
        whole = [c for c in calls if isinstance(c, ToolCall)]
        if choice.parallel and completion.finish_reason == "length":  # a sampled model may call on and on
            assert calls in (whole, whole + calls[-1:])  # the last perhaps cut off
        else:
            assert completion.finish_reason == "stop" and calls == whole, completion.text
        assert choice.parallel or len(calls) == 1
        for call in whole:
            assert choice.mode != "function" or call.name == choice.name
            jsonschema.validate(call.arguments, schemas[call.name])


def test_the_call_format_follows_the_template(llama_llm):
    tokenizer = llama_llm.tokenizer
    llama3 = ('{% if tools %}Respond with a JSON for a function call: {"name": function name, "parameters": dictionary '
              'of argument name and its value}. {{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}')
    assert tool_call_format(tokenizer, llama3) == "json"
    assert tool_call_format(tokenizer, TOOLS_TEMPLATE) == "hermes"
    assert tool_call_format(tokenizer, PLAIN_TEMPLATE.replace("m.content", "m.content ~ '\"parameters\"'")) == "hermes"  # no tools read
    assert tool_call_format(tokenizer, llama3, requested="hermes") == "hermes"
    with pytest.raises(InvalidRequestError, match="tool call format must be"):
        tool_call_format(tokenizer, llama3, requested="xml")
    text = llama_llm.tokenizer.decode(_generate(llama_llm, ToolChoice("required", parallel=False, format="json")).outputs[0].token_ids)
    assert text.startswith('{"name": "') and '"parameters": {' in text


def test_auto_leaves_text_free_until_a_call_starts(llama_llm):
    """The tiny model never writes <tool_call> by itself, so "auto" gives the same text as no grammar."""
    free = _generate(llama_llm, ToolChoice("none")).outputs[0]
    auto = _generate(llama_llm, ToolChoice("auto")).outputs[0]
    assert auto.token_ids == free.token_ids


def test_docstrings():
    from autodeploy.frontend import tool_calls

    assert doctest.testmod(tool_calls).failed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_calls_under_the_grammar_are_valid_beside_free_requests(gpu_llama_llm):
    llm = gpu_llama_llm
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.generate("import os", free)[0].token_ids
    prompt = render_chat(llm.tokenizer, [{"role": "user", "content": "Weather in Rome?"}], TOOLS_TEMPLATE, SPECS)
    choices = [ToolChoice("required", parallel=False), ToolChoice("function", "get_weather", parallel=False)]
    calls = [SamplingParams(max_tokens=160, temperature=0.8, seed=seed, structural_tag=tool_call_grammar(SPECS, choice))
             for seed, choice in enumerate(choices)]
    outputs = llm.generate([prompt, prompt, "import os"], [*calls, free])
    for output, choice in zip(outputs, choices):
        content, (call,) = parse_tool_calls(output.text, SPECS)
        assert output.finish_reason == "stop" and content is None
        assert choice.mode != "function" or call.name == "get_weather"
        jsonschema.validate(call.arguments, {s.name: s.parameters for s in SPECS}[call.name])
    assert outputs[2].token_ids == alone
    assert llm.engine.pool.num_used_blocks == 0
