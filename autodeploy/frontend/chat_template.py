"""Chat messages → prompt token ids, through the tokenizer's chat template (or one given as text).

Messages are OpenAI's: ``{"role": …, "content": …}``, assistant turns with ``tool_calls`` (arguments as
JSON text or a dict) and ``tool`` turns with the results. A template that knows tools (it reads
``tools``) gets them and the calls as Hugging Face templates expect (arguments as a dict); for one that
does not, the tools are described in the system message and calls and results are written into the
turns as text, in the format ``frontend/tool_calls.py`` generates and parses, so any template can serve
tool calling.

    ids = render_chat(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], tools=tool_specs(tools))
"""

from __future__ import annotations

import json
import re

from autodeploy.errors import InvalidRequestError
from autodeploy.frontend.tool_calls import CALL_END, CALL_START, TOOL_CALL_FORMATS, ToolCall, ToolSpec, format_for_template

_READS_TOOLS = re.compile(r"\btools\b")
_TOOLS_PROMPT = (
    "You may call these functions (JSON Schema):\n<tools>\n{tools}\n</tools>\nTo call one, write:\n"
    f'{CALL_START}\n{{{{"name": <function name>, "arguments": <arguments object>}}}}\n{CALL_END}'
)


def tool_call_format(tokenizer, chat_template: str | None = None, requested: str = "auto") -> str:
    """How calls are generated: ``requested``, or with ``"auto"`` the format the template teaches (a template
    that does not read ``tools`` is taught Hermes tags in the system turn written here)."""
    if requested != "auto":
        if requested not in TOOL_CALL_FORMATS:
            raise InvalidRequestError(f"tool call format must be auto, {' or '.join(TOOL_CALL_FORMATS)}; got {requested!r}")
        return requested
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return format_for_template(template) if isinstance(template, str) and _READS_TOOLS.search(template) else "hermes"


def render_chat(tokenizer, messages: list[dict], chat_template: str | None = None, tools: list[ToolSpec] | None = None,
                image_token: str | None = None) -> list[int] | dict:
    """Token ids of ``messages`` followed by the assistant's turn. The rendered text already holds whatever
    special tokens the template writes (BOS included), so it is tokenized without adding more. With image parts
    (a vision-language model's ``image_token`` given): ``{"prompt": ids, "images": [their sources, in order]}``."""
    images: list = []
    text = render_chat_text(tokenizer, messages, chat_template, tools, images if image_token else None, image_token)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return {"prompt": ids, "images": images} if images else ids


def render_chat_text(tokenizer, messages: list[dict], chat_template: str | None = None, tools: list[ToolSpec] | None = None,
                     images: list | None = None, image_token: str | None = None) -> str:
    """``render_chat``'s text, before tokenizing (to be tokenized with ``add_special_tokens=False``). Image parts
    (``{"type": "image_url", "image_url": {"url": …}}``, or ``{"type": "image", "image": …}`` with a path, bytes or a
    PIL image) become ``image_token`` in the text, where they stand, and their sources are appended to ``images``;
    without ``images`` (a model with no vision tower) they are refused."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so chat messages cannot be rendered; use /v1/completions with token ids")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("this model's tokenizer has no chat template; start the server with --chat-template FILE "
                                  "(a Jinja template) or use /v1/completions")
    knows_tools = isinstance(template, str) and bool(_READS_TOOLS.search(template))  # a dict of templates: by name, not read here
    turns = [_template_message(m, knows_tools, images, image_token) for m in messages]
    if tools and not knows_tools:
        turns = _with_tools_prompt(turns, tools)
    try:
        text = tokenizer.apply_chat_template(turns, chat_template=chat_template, tools=[t.to_openai() for t in tools] if tools and knows_tools else None,
                                             tokenize=False, add_generation_prompt=True)
    except Exception as error:  # jinja2 errors, and raise_exception() in templates that check the roles' order
        raise InvalidRequestError(f"the chat template could not render these messages: {error}") from None
    return text


def tool_calls_of(message: dict) -> list[ToolCall]:
    """The ``ToolCall``s of an assistant message in OpenAI's form (arguments as JSON text or a dict)."""
    calls = []
    for index, entry in enumerate(message.get("tool_calls") or []):
        if isinstance(entry, ToolCall):
            calls.append(entry)
            continue
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"tool_calls[{index}] must be {{\"id\": …, \"type\": \"function\", \"function\": {{\"name\": …, \"arguments\": …}}}}")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequestError(f"tool_calls[{index}] ({function['name']}): arguments are not valid JSON") from None
        calls.append(ToolCall(function["name"], arguments, **({"id": entry["id"]} if entry.get("id") else {})))
    return calls


def _template_message(message: dict, knows_tools: bool, images: list | None = None, image_token: str | None = None) -> dict:
    role, content = message.get("role"), _text(message.get("content"), images, image_token)
    calls = tool_calls_of(message) if role == "assistant" else []
    if knows_tools:
        turn = {"role": role, "content": content}
        if calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                turn[key] = message[key]
        return turn
    if role == "tool":  # as Hermes-style templates without a tool role write results
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if calls:
        content = "\n".join(([content] if content else []) + [c.to_text() for c in calls])
    turn = {"role": role, "content": content}
    if message.get("name") is not None:
        turn["name"] = message["name"]
    return turn


def _text(content, images: list | None = None, image_token: str | None = None) -> str:
    """Text content: a string, or OpenAI's list of parts — text, and images where ``images`` collects them (each
    written as ``image_token``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in ("image_url", "image"):
            if images is None:
                raise _messages_error("image parts are not supported by this model (it has no vision tower); send text parts only")
            source = part.get(kind)
            source = source.get("url") if kind == "image_url" and isinstance(source, dict) else source
            if source is None:
                raise _messages_error(f'an {kind} part needs its image: {{"type": "image_url", "image_url": {{"url": …}}}}')
            images.append(source)
            parts.append(image_token)
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            raise _messages_error(f"a content part of type {kind!r} is not supported (text and image_url parts are)")
        parts.append(part["text"])
    return "".join(parts)


def _messages_error(message: str) -> InvalidRequestError:
    error = InvalidRequestError(f"messages: {message}")
    error.param = "messages"
    return error


def _with_tools_prompt(turns: list[dict], tools: list[ToolSpec]) -> list[dict]:
    described = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools))
    if turns and turns[0]["role"] in ("system", "developer"):
        first = dict(turns[0], content=f"{turns[0]['content']}\n\n{described}" if turns[0]["content"] else described)
        return [first, *turns[1:]]
    return [{"role": "system", "content": described}, *turns]
