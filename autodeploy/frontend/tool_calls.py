"""Tool calls: the grammar a call is generated under, and the calls read back out of generated text.

Calls are generated in one of two formats (``ToolChoice.format``): ``"hermes"``, the tags of Hermes,
Qwen and most open chat models::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or ``"json"``, the bare object Llama 3.x's templates ask for: ``{"name": "get_weather", "parameters":
{"city": "Paris"}}``. ``format_for_template`` picks the one the chat template teaches.

``tool_call_grammar(tools, choice)`` is the xgrammar structural tag for ``SamplingParams.structural_tag``:
with ``"auto"`` the text is free until ``<tool_call>`` appears, then the call must be valid JSON for one of
the tools (its name, then arguments that satisfy its parameters' schema); with ``"required"`` or a named
function the output is calls and nothing else. ``ToolCallParser`` reads calls back out of text as it
streams: in that format, or as a bare JSON object (or list of them) with ``"name"`` and ``"arguments"``
(``"parameters"``, Llama 3.1's spelling) that makes up the whole output.

    tools = tool_specs([{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}])
    params = SamplingParams(max_tokens=64, structural_tag=tool_call_grammar(tools, ToolChoice("required")))
    content, calls = parse_tool_calls(llm.generate(prompt, params)[0].text, tools)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.request import streamable_prefix

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
# One whitespace character at a time inside a call's JSON: ", " and ": " as models write them, while a
# model cannot spend its max_tokens on whitespace.
_MAX_WHITESPACE = 1


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: its name, what it does and its parameters' JSON Schema."""

    name: str
    description: str
    parameters: dict

    def to_openai(self) -> dict:
        """The ``{"type": "function", "function": {…}}`` form that OpenAI requests and chat templates take."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    """A call the model made: the function's name and its arguments (decoded JSON)."""

    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        """OpenAI's ``tool_calls`` entry: the arguments as JSON text."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}

    def to_text(self) -> str:
        """The call as the model writes it (for chat templates that know nothing of tool calls)."""
        return f"{CALL_START}\n{json.dumps({'name': self.name, 'arguments': self.arguments}, ensure_ascii=False)}\n{CALL_END}"


@dataclass
class CutOffToolCall:
    """A call that ``max_tokens`` cut short: the function's name and its arguments' JSON text so far. OpenAI
    reports such a call as it stands (``finish_reason`` "length"); it is never run."""

    name: str
    arguments_text: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_text}}


# The start of a call's JSON: its complete name, then what follows it.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)', re.DOTALL)
_ARGUMENTS_BEGUN = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)', re.DOTALL)
_KEY_BEGUN = re.compile(r'\s*(?:,\s*(?:"\w*)?)?')


def _begins_call(text: str) -> bool:
    """Whether ``text`` is a call's JSON cut off before its name was whole (``{"na``, ``{"name": "get_w``)."""
    compact = re.sub(r"\s+", "", text.removeprefix("```json").removeprefix("```"))
    return bool(compact) and ('{"name":"'.startswith(compact) or re.fullmatch(r'\{"name":"[^"]*', compact) is not None)


def _cut_off_call(text: str, specs: list[ToolSpec]) -> CutOffToolCall | None:
    """The call a text cut off mid-call had begun, once its name is whole and names a tool; else None."""
    head = _CALL_HEAD.fullmatch(text.removeprefix("```json").removeprefix("```"))
    if head is None or not any(spec.name == json.loads(f'"{head.group(1)}"') for spec in specs):
        return None
    arguments = _ARGUMENTS_BEGUN.fullmatch(head.group(2))
    if arguments is None and not _KEY_BEGUN.fullmatch(head.group(2)):
        return None
    return CutOffToolCall(json.loads(f'"{head.group(1)}"'), arguments.group(1) if arguments else "")


TOOL_CALL_FORMATS = ("hermes", "json")


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is ``"none"`` (no calls), ``"auto"`` (the model decides), ``"required"`` (at least one
    call) or ``"function"`` (a call of ``name``); ``parallel``: more than one call in a turn; ``format``:
    how calls are written (``"hermes"`` tags or a bare ``"json"`` object)."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True
    format: str = "hermes"


def format_for_template(template: str | None) -> str:
    """The call format a chat template teaches: ``"json"`` for one that describes bare ``"parameters"``
    objects and no ``<tool_call>`` tags (Llama 3.x), else ``"hermes"`` (also what templates without tools
    are taught, in the system turn ``frontend/chat_template.py`` writes).

    >>> format_for_template('... {"name": function name, "parameters": dictionary of argument name and its value} ...')
    'json'
    >>> format_for_template("... <tool_call> {'name': <function-name>, 'arguments': <args-json-object>} </tool_call> ...")
    'hermes'
    """
    if isinstance(template, str) and CALL_START not in template and '"parameters"' in template:
        return "json"
    return "hermes"


def _invalid(message: str, param: str) -> InvalidRequestError:
    error = InvalidRequestError(message)
    error.param = param  # the server's 400 names the field
    return error


def tool_specs(tools: list) -> list[ToolSpec]:
    """Check OpenAI's ``tools`` list (function tools, unique names, parameters the grammar compiler
    accepts) and return their specs; an ``InvalidRequestError`` names the first bad tool."""
    if not isinstance(tools, list) or not tools:
        raise _invalid("tools must be a non-empty list of {\"type\": \"function\", \"function\": {…}}", "tools")
    specs: list[ToolSpec] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise _invalid(f"{where}: only function tools are supported: {{\"type\": \"function\", \"function\": {{\"name\": …}}}}", "tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise _invalid(f"{where}: function.name must be 1–64 letters, digits, '_', '-' or '.', got {name!r}", "tools")
        if any(spec.name == name for spec in specs):
            raise _invalid(f"{where}: two tools are named {name!r}; names must be unique", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _invalid(f"{where} ({name}): parameters must be a JSON Schema object, got {type(parameters).__name__}", "tools")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise _invalid(f"{where} ({name}): description must be a string", "tools")
        spec = ToolSpec(name, description, parameters)
        _check_compiles(spec, where)
        specs.append(spec)
    return specs


def parse_tool_choice(value, specs: list[ToolSpec] | None, parallel: bool = True, format: str = "hermes") -> ToolChoice:
    """OpenAI's ``tool_choice`` (``"none"``, ``"auto"``, ``"required"``, ``{"type": "function", "function":
    {"name": …}}``); without tools only ``"none"`` (or nothing) is valid. The default is ``"auto"`` with
    tools and ``"none"`` without, as OpenAI's."""
    if value is None:
        return ToolChoice("auto" if specs else "none", parallel=parallel, format=format)
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _invalid(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": …}}}}, got {value!r}', "tool_choice")
        if value != "none" and not specs:
            raise _invalid(f'tool_choice "{value}" needs tools', "tool_choice")
        return ToolChoice(value, parallel=parallel, format=format)
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(name, str):
        raise _invalid(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": …}}}}, got {value!r}', "tool_choice")
    if not any(spec.name == name for spec in specs or ()):
        raise _invalid(f"tool_choice names {name!r}, which is not among the tools ({', '.join(s.name for s in specs or ()) or 'none given'})", "tool_choice")
    return ToolChoice("function", name, parallel=False, format=format)


_JSON_CALL_START = '{"name": '  # the json format's trigger: every call begins so


def _tag(spec: ToolSpec, format: str = "hermes") -> dict:
    content = {"type": "json_schema", "json_schema": spec.parameters, "max_whitespace_cnt": _MAX_WHITESPACE}
    if format == "json":
        return {"type": "tag", "begin": f'{_JSON_CALL_START}{json.dumps(spec.name)}, "parameters": ', "content": content, "end": "}"}
    begin = f'{CALL_START}\n{{"name": {json.dumps(spec.name)}, "arguments": '
    return {"type": "tag", "begin": begin, "content": content, "end": f"}}\n{CALL_END}"}


def tool_call_grammar(specs: list[ToolSpec], choice: ToolChoice) -> dict | None:
    """The structural tag (xgrammar's format) that the generation of ``choice`` runs under; None for "none"."""
    if choice.mode == "none":
        return None
    if choice.format not in TOOL_CALL_FORMATS:
        raise InvalidRequestError(f"tool call format must be one of {', '.join(TOOL_CALL_FORMATS)}, got {choice.format!r}")
    if choice.mode == "auto":
        trigger = CALL_START if choice.format == "hermes" else _JSON_CALL_START
        grammar = {"type": "triggered_tags", "triggers": [trigger], "tags": [_tag(s, choice.format) for s in specs],
                   "stop_after_first": not choice.parallel}
    else:
        chosen = [s for s in specs if choice.mode == "required" or s.name == choice.name]
        grammar = {"type": "tags_with_separator", "tags": [_tag(s, choice.format) for s in chosen], "separator": "\n",
                   "at_least_one": True, "stop_after_first": not choice.parallel}
    return {"type": "structural_tag", "format": grammar}


def _check_compiles(spec: ToolSpec, where: str) -> None:
    from autodeploy.runtime.structured_output import check_structural_tag  # xgrammar, only when tools are used

    try:
        check_structural_tag({"type": "structural_tag", "format": _tag(spec)})
    except InvalidRequestError as error:
        raise _invalid(f"{where} ({spec.name}): its parameters cannot be enforced as a grammar: {error}", "tools") from None


def _call_from_json(value, specs: list[ToolSpec]) -> ToolCall | None:
    """A call from decoded JSON ``{"name": …, "arguments": {…}}`` naming one of the tools, else None."""
    if not isinstance(value, dict) or not any(spec.name == value.get("name") for spec in specs):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI returns them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def _bare_calls(text: str, specs: list[ToolSpec]) -> tuple[list[ToolCall], str]:
    """The JSON calls the text starts with (one, a list, or several apart by blanks or ``;``; fenced in
    ```json or not) and the text after them: a generation cut short mid-call keeps its whole calls."""
    text = text.strip()
    if text.startswith("```"):
        text = text.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            break
        found = [_call_from_json(v, specs) for v in (value if isinstance(value, list) else [value])]
        if not found or not all(found):
            break
        calls.extend(found)
        position = end
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
    return calls, text[position:] if calls else text


class ToolCallParser:
    """Split text, fed as it streams, into content pieces (str) and ``ToolCall``s, in order (at ``finish``, a
    call cut off by ``max_tokens`` is a ``CutOffToolCall``, never content).

    Text that may still turn into a call is held back: a tail that could begin ``<tool_call>``, a call
    until its end tag, a whole output that starts like JSON (a bare call) until ``finish``, and blank text
    until something follows it (blank text before or between calls is dropped). A block that is not a
    valid call of a known tool stays content, as written. Fed at once or piece by piece, the same text
    gives the same content and calls.
    """

    def __init__(self, specs: list[ToolSpec]):
        self.specs = specs
        self._pending = ""
        self._in_call = False
        self._emitted = False  # content or a call has been emitted (a bare JSON call is the whole output)
        self._flowing = False  # the last thing emitted was content, so blank text continues it
        self.num_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        events: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._pending.find(CALL_END)
                if end < 0:
                    return events
                body, self._pending = self._pending[:end], self._pending[end + len(CALL_END):]
                self._in_call = False
                self._emit_block(body, closed=True, events=events)
                continue
            start = self._pending.find(CALL_START)
            if start >= 0:
                self._emit_content(self._pending[:start], events)
                self._pending = self._pending[start + len(CALL_START):]
                self._in_call = True
                continue
            if not self._emitted and self._pending.lstrip()[:1] in ("{", "[", "`"):
                return events  # perhaps a bare JSON call: decided at finish
            head = streamable_prefix(self._pending, [CALL_START])  # a tail that may begin a call waits
            if head.strip() or self._flowing:
                self._emit_content(head, events)
                self._pending = self._pending[len(head):]
            return events

    def finish(self) -> list[str | ToolCall | CutOffToolCall]:
        """The rest, once the generation ended: a call cut off by ``max_tokens`` is parsed if it is whole JSON,
        else reported as a ``CutOffToolCall`` (its markup never becomes content)."""
        events: list[str | ToolCall | CutOffToolCall] = []
        rest, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            self._emit_block(rest, closed=False, events=events)
            return events
        calls, rest = _bare_calls(rest, self.specs) if not self._emitted else ([], rest)
        if calls:
            events.extend(calls)
            self.num_calls += len(calls)
            self._emitted = True
        cut_off = _cut_off_call(rest, self.specs) if not self._flowing else None
        if cut_off is not None:
            events.append(cut_off)
            self.num_calls += 1
            return events
        if not self._flowing and _begins_call(rest):  # cut off before the call's name was whole: nothing to report
            return events
        tag_begun = rest[len(streamable_prefix(rest, [CALL_START])):]
        if len(tag_begun) > 1:  # cut off inside "<tool_call>" itself: markup, not content
            rest = rest[: -len(tag_begun)]
        if rest.strip() or self._flowing:
            self._emit_content(rest, events)
        return events

    def _emit_block(self, body: str, closed: bool, events: list) -> None:
        if not closed:  # cut off, perhaps inside the end tag
            body = streamable_prefix(body, [CALL_END])
        try:
            call = _call_from_json(json.loads(body), self.specs)
        except ValueError:
            call = None
        if call is None and not closed:  # cut off: what the call has so far, or nothing before its name is whole
            call = _cut_off_call(body, self.specs)
            if call is None:
                return
        if call is None:
            self._emit_content(CALL_START + body + (CALL_END if closed else ""), events)
            return
        events.append(call)
        self.num_calls += 1
        self._emitted, self._flowing = True, False

    def _emit_content(self, text: str, events: list) -> None:
        if text and (text.strip() or self._flowing):
            events.append(text)
            self._emitted, self._flowing = True, True


def parse_tool_calls(text: str, specs: list[ToolSpec]) -> tuple[str | None, list[ToolCall | CutOffToolCall]]:
    """``(content, calls)`` of a whole generation: the text outside calls (None when blank) and the calls (the
    last a ``CutOffToolCall`` when ``max_tokens`` cut it short).

    >>> specs = [ToolSpec("now", "", {"type": "object", "properties": {}})]
    >>> parse_tool_calls('Let me look.\\n<tool_call>\\n{"name": "now", "arguments": {}}\\n</tool_call>', specs)[0]
    'Let me look.\\n'
    >>> [c.name for c in parse_tool_calls('{"name": "now", "parameters": {}}', specs)[1]]
    ['now']
    """
    parser = ToolCallParser(specs)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return (content if content.strip() else None), [e for e in events if not isinstance(e, str)]
