"""``ToolRegistry``: Python functions a model may call, with JSON Schemas read from their type hints and
docstrings, for ``LLM.chat(messages, tools=registry)`` — the loop that runs the model's calls and feeds
the results back (``frontend/chat.py``).

    registry = ToolRegistry()

    @registry.register
    def get_weather(city: Literal["Paris", "Rome"], unit: str = "celsius") -> dict:
        \"\"\"The weather in a city now.

        Args:
            city: where.
            unit: celsius or fahrenheit.
        \"\"\"
        return {"city": city, "temperature": 21, "unit": unit}

    reply = llm.chat([{"role": "user", "content": "Is it warm in Rome?"}], tools=registry, max_rounds=4)
    reply.content, reply.trace  # the final answer, and each call with its result

Parameters map to JSON Schema as: ``str`` string, ``int`` integer, ``float`` number, ``bool`` boolean,
``None`` null, ``list[T]`` / ``tuple[T, ...]`` array, ``dict[str, T]`` object, ``Literal[…]`` and ``Enum``
subclasses enum, ``T | None`` / ``Union`` anyOf, ``Annotated[T, "description"]`` a described ``T``; a
parameter with a default is optional. Anything else, or a parameter without a hint, is a ``ConfigError``
when the function is registered.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from autodeploy.errors import ConfigError
from autodeploy.frontend.tool_calls import ToolCall, ToolSpec

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_ARGUMENT_SECTIONS = ("Args", "Arguments", "Parameters")
_SECTIONS = (*_ARGUMENT_SECTIONS, "Returns", "Return", "Raises", "Yields", "Examples", "Example", "Notes", "Note")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^\s*:param\s+(?:\w+\s+)?(\w+)\s*:\s*(.*)$")


@dataclass
class ToolResult:
    """One executed call: what the model asked for and what went back to it (``error`` when it raised)."""

    call: ToolCall
    output: str
    error: str | None = None


class ToolRegistry:
    """Functions by name, each with the ``ToolSpec`` (JSON Schema) the model sees."""

    def __init__(self):
        self._functions: dict[str, Callable] = {}
        self._specs: dict[str, ToolSpec] = {}

    def register(self, function: Callable | None = None, *, name: str | None = None, description: str | None = None):
        """Register ``function`` (also as a decorator, with or without ``name=`` / ``description=``); its
        schema comes from its type hints and docstring (Google ``Args:`` or Sphinx ``:param x:`` lines)."""
        if function is None:
            return lambda f: self.register(f, name=name, description=description)
        tool_name = name or function.__name__
        if tool_name in self._functions:
            raise ConfigError(f"a tool named {tool_name!r} is already registered; pass name=… to register this one under another")
        summary, argument_docs = _docstring(function)
        self._specs[tool_name] = ToolSpec(tool_name, description if description is not None else summary,
                                          _parameters_schema(function, argument_docs))
        self._functions[tool_name] = function
        return function

    def specs(self) -> list[ToolSpec]:
        return list(self._specs.values())

    def schemas(self) -> list[dict]:
        """The tools in OpenAI's request format (``{"type": "function", "function": {…}}``)."""
        return [spec.to_openai() for spec in self._specs.values()]

    def __contains__(self, name: str) -> bool:
        return name in self._functions

    def __len__(self) -> int:
        return len(self._functions)

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call. Its return value goes back as text (JSON unless it is a string); an exception,
        an unknown tool or arguments that do not bind become an error message for the model, which may
        try again, rather than ending the conversation."""
        function = self._functions.get(call.name)
        if function is None:
            return _failed(call, f"there is no tool named {call.name!r} (tools: {', '.join(self._functions)})")
        try:
            bound = inspect.signature(function).bind(**call.arguments)
        except TypeError as error:
            return _failed(call, f"the arguments do not fit {call.name}: {error}")
        try:
            value = function(*bound.args, **bound.kwargs)
        except Exception as error:  # the tool's own failure is the model's to handle
            return _failed(call, f"{call.name} raised {type(error).__name__}: {error}")
        output = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        return ToolResult(call, output)


def _failed(call: ToolCall, message: str) -> ToolResult:
    return ToolResult(call, f"error: {message}", error=message)


def _docstring(function: Callable) -> tuple[str, dict[str, str]]:
    """The description (the text before any section) and each argument's description (Google ``Args:``
    entries, or Sphinx ``:param name:`` lines)."""
    summary, arguments = [], {}
    section, entry_indent, current = None, None, None
    for line in (inspect.getdoc(function) or "").splitlines():
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if indent == 0 and stripped.endswith(":") and stripped[:-1] in _SECTIONS:
            section, entry_indent, current = stripped[:-1], None, None
            continue
        sphinx = _SPHINX_PARAM.match(line)
        if sphinx:
            section, current = ":param", sphinx.group(1)
            arguments[current] = sphinx.group(2).strip()
            continue
        if stripped.startswith(":") and section in (None, ":param"):  # :returns:, :raises: …
            section, current = ":param", None
            continue
        entry = _ARG_LINE.match(line) if section in _ARGUMENT_SECTIONS else None
        if entry and (entry_indent is None or indent <= entry_indent):
            entry_indent, current = indent, entry.group(1).lstrip("*")
            arguments[current] = entry.group(2).strip()
        elif section is None:
            summary.append(stripped)
        elif current is not None and stripped and section in (*_ARGUMENT_SECTIONS, ":param") and not stripped.startswith(":"):
            arguments[current] = f"{arguments[current]} {stripped}".strip()
    return " ".join(" ".join(summary).split()), arguments


def _parameters_schema(function: Callable, argument_docs: dict[str, str]) -> dict:
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except Exception as error:  # a hint naming something that does not resolve
        raise ConfigError(f"tool {function.__name__}: its type hints cannot be read ({error})") from None
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ConfigError(f"tool {function.__name__}: *{parameter.name} cannot be described as a JSON Schema; "
                              "give each argument a name and a type hint")
        if parameter.name not in hints:
            raise ConfigError(f"tool {function.__name__}: parameter {parameter.name!r} has no type hint, so its JSON Schema is unknown; "
                              "add one (str, int, float, bool, list[…], dict[str, …], Literal[…], an Enum, …)")
        schema = _schema(hints[parameter.name], f"tool {function.__name__}, parameter {parameter.name!r}")
        if parameter.name in argument_docs and "description" not in schema:
            schema["description"] = argument_docs[parameter.name]
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        properties[parameter.name] = schema
    return {"type": "object", "properties": properties, "required": required}


def _schema(hint, where: str) -> dict:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if origin is typing.Annotated:
        schema = _schema(arguments[0], where)
        notes = [a for a in arguments[1:] if isinstance(a, str)]
        return {**schema, "description": " ".join(notes)} if notes else schema
    if origin is typing.Literal:
        if not all(isinstance(a, (str, int, float, bool)) for a in arguments):
            raise ConfigError(f"{where}: Literal values must be strings, numbers or booleans")
        return {"enum": list(arguments)}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [member.value for member in hint]}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema(a, where) for a in arguments]}
    if hint is list or origin is list or (origin is tuple and len(arguments) == 2 and arguments[1] is Ellipsis):
        return {"type": "array", "items": _schema(arguments[0], where)} if arguments else {"type": "array"}
    if hint is dict or origin is dict:
        if arguments and arguments[0] is not str:
            raise ConfigError(f"{where}: JSON object keys are strings; use dict[str, …]")
        return {"type": "object", "additionalProperties": _schema(arguments[1], where)} if arguments else {"type": "object"}
    raise ConfigError(f"{where}: {hint!r} has no JSON Schema here; use str, int, float, bool, None, list[…], tuple[…, ...], "
                      "dict[str, …], Literal[…], an Enum, a Union or Annotated[…, \"description\"]")
