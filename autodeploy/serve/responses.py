"""The OpenAI Responses API, ``POST /v1/responses``, as a translation of the chat path.

A request becomes the chat completion request of the same conversation (``instructions`` the system turn, each
``input`` item a turn, function tools, ``tool_choice`` and ``text.format`` in chat's shapes) and runs through the
handler of ``/v1/chat/completions``: the same template rendering, sampling, tool-call grammar and parsing,
reasoning split, admission, metrics and aborts, with nothing of it copied. Its answer, whole or streamed, is
rewritten as Responses output items (``reasoning``, ``message``, ``function_call``) and, streamed, as the
Responses events in the order OpenAI sends them, each with its ``sequence_number``.

Fields that would change the output and are not implemented (stored responses, background mode, built-in
tools, reasoning effort, …) are 400s naming the field; bookkeeping fields (``user``, ``metadata``, ``store``,
``service_tier``, …) are accepted. ``docs/responses-api.md`` lists every field.

    add_responses_routes(app, server, chat_completions)  # in build_app, after the chat route
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from autodeploy.errors import InvalidRequestError
from autodeploy.serve.openai_errors import APIError, invalid_request
from autodeploy.serve.protocol import ChatCompletionRequest, StrictModel
from autodeploy.serve.route_server import RouteServer

LOGPROBS = "message.output_text.logprobs"
# What a chat error's param is called here.
_PARAM_OF_CHAT_FIELD = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                        "response_format": "text", "logprobs": "include"}
# Fields that would change the output, and why they cannot: a 400 when given (neither null, false nor empty).
_REFUSED = {
    "previous_response_id": "continuing a stored response (responses are not stored on this server; send the whole "
                            "conversation as input items)",
    "conversation": "a stored conversation (conversations are not stored on this server; send the whole conversation as input items)",
    "prompt": "a stored prompt template (send its instructions and input instead)",
    "background": "background mode (send the request without it and wait, or stream it)",
    "context_management": "context compaction",
}


# ---- the request -------------------------------------------------------------------------------------------------


class TextPart(StrictModel):
    """Text of a message: ``input_text``, or the ``output_text`` of an earlier answer fed back."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None

    @property
    def value(self) -> str:
        return self.text


class RefusalPart(StrictModel):
    """A refusal in an earlier answer fed back: its text is what the assistant said."""

    type: Literal["refusal"]
    refusal: str

    @property
    def value(self) -> str:
        return self.refusal


class ImagePart(StrictModel):
    """An image in a user's message (a vision-language model's): a data: or http(s) URL, or a file the server may
    read (``vision.allowed_local_dir``); ``file_id`` (uploaded files) is not served."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the resolution

    @property
    def chat_part(self) -> dict:
        return {"type": "image_url", "image_url": {"url": self.image_url}}


def _kind(value, default: str | None = None) -> str | None:
    return value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)


Content = list[Annotated[
    Annotated[TextPart, Tag("input_text")] | Annotated[TextPart, Tag("output_text")] | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[ImagePart, Tag("input_image")],
    Discriminator(_kind, custom_error_type="content_part", custom_error_message=(
        "only text and image content parts are supported (input_text, input_image with an image_url; output_text and "
        "refusal fed back): input_file and input_audio parts are not"))]]


def _parts(value):
    """A string content is one text part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    content_as_parts = field_validator("content", mode="before")(_parts)

    def append_to(self, messages: list[dict]) -> None:
        if any(isinstance(part, ImagePart) for part in self.content):  # chat's parts, images where they stand
            parts = [part.chat_part if isinstance(part, ImagePart) else {"type": "text", "text": part.value} for part in self.content]
            messages.append({"role": self.role, "content": parts})
        else:
            messages.append({"role": self.role, "content": "".join(part.value for part in self.content)})


class FunctionCallItem(StrictModel):
    """A call the model made earlier: the assistant's turn (beside its text, if that turn had some)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, value: str) -> str:
        try:
            json.loads(value)
        except ValueError:
            raise PydanticCustomError("arguments", "arguments must be JSON text, as the call's output item gave them") from None
        return value

    def append_to(self, messages: list[dict]) -> None:
        call = {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


class FunctionCallOutputItem(StrictModel):
    """A call's result: the tool's turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    output_as_parts = field_validator("output", mode="before")(_parts)

    def append_to(self, messages: list[dict]) -> None:
        messages.append({"role": "tool", "tool_call_id": self.call_id, "content": "".join(part.value for part in self.output)})


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """Reasoning of an earlier turn, fed back as agents do: not rendered, as chat templates drop earlier turns'
    reasoning (and the chat path has no field for it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def append_to(self, messages: list[dict]) -> None:
        return None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(lambda item: _kind(item, "message"), custom_error_type="input_item", custom_error_message=(
        "input items must be messages, function_call, function_call_output or reasoning items: built-in tools' "
        "calls are not supported, nor item_reference (responses are not stored on this server)"))]


class FunctionTool(StrictModel):
    """A function tool in the Responses' flat shape. ``strict`` is always honoured: calls are generated under a
    grammar of the parameters' schema either way."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict:
        """Chat's ``response_format`` of the same output."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None or self.name is None:
            raise APIError(400, 'text.format of type "json_schema" needs name and schema: {"type": "json_schema", "name": …, '
                                '"schema": {…}}', param="text")
        json_schema = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in json_schema.items() if v is not None}}


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # padding against a length side channel; nothing is obfuscated here


class ResponsesRequest(StrictModel):
    """The body of ``POST /v1/responses`` (OpenAI's fields; docs/responses-api.md says what each does here)."""

    model: str
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    include: list[Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                          "message.input_image.image_url", "computer_call_output.output.image_url",
                          "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)  # counts built-in tools' calls only: none here
    # refused when given (_REFUSED)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    context_management: list | None = None
    # bookkeeping: accepted, echoed where OpenAI echoes them
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _a_string_is_a_user_message(cls, value):
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value):
        for index, tool in enumerate(value if isinstance(value, list) else []):
            if _kind(tool) != "function":
                raise PydanticCustomError("tool_type", f"tool {index} is of type {_kind(tool)!r}: only function tools are supported; "
                                                       "built-in tools (web_search, file_search, code_interpreter, computer use, mcp, …) are not")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _a_tool_choice_this_server_has(cls, value):
        if value is None or value in ("none", "auto", "required") or (_kind(value) == "function" and isinstance(value.get("name"), str)):
            return value
        raise PydanticCustomError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": …}; '
                                                 'allowed_tools and built-in or MCP tool choices are not supported')

    def check_supported(self, reasoning_parser: str) -> None:
        """400s for what the fields' types allow but this server cannot do."""
        for field, what in _REFUSED.items():
            if getattr(self, field):
                raise APIError(400, f"{field}: {what} is not supported by this server", param=field)
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            raise APIError(400, "reasoning: a reasoning effort or summary cannot be set on this server (a model that "
                                "reasons does so as its chat template asks; see --reasoning-parser)", param="reasoning")
        if self.truncation == "auto":
            raise APIError(400, 'truncation "auto" (dropping the start of the conversation to fit the context) is not '
                                'supported by this server; shorten the input', param="truncation")
        if self.text.verbosity not in (None, "medium"):
            raise APIError(400, f'text.verbosity "{self.text.verbosity}" cannot be honoured by this server (only "medium")', param="text")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        calls = bool(self.tools) and self.tool_choice != "none"
        if calls and self.text.format is not None and self.text.format.type != "text":
            raise APIError(400, 'text.format json_object / json_schema and function calls each constrain the whole output; use '
                                'one (tool_choice "none" turns calls off)', param="text")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, f'top_logprobs needs include: ["{LOGPROBS}"]', param="top_logprobs")
        if self.logprobs and (reasoning_parser != "none" or calls):
            raise APIError(400, f"include {LOGPROBS} is supported for text answers only, without function tools and a reasoning "
                                "parser (the log-probabilities would mix the text's tokens with the calls' or the reasoning's)",
                           param="include")

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request of the same conversation and output."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        for item in self.input:
            item.append_to(messages)
        if not messages:
            raise APIError(400, "input: nothing to answer (only reasoning items); give a message", param="input")
        choice = self.tool_choice
        fields = {
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "tools": [tool.chat_tool() for tool in self.tools] or None,
            "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice) else choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.text.format.response_format() if self.text.format is not None else None,
            "logprobs": self.logprobs or None, "top_logprobs": self.top_logprobs if self.logprobs else None,
            "stream_options": {"include_usage": True} if self.stream else None,  # usage for response.completed
        }
        body = {"model": self.model, "messages": messages, "stream": self.stream} | {k: v for k, v in fields.items() if v is not None}
        return ChatCompletionRequest.model_validate(body)

    def echoed(self) -> dict:
        """The settings a Response repeats, with OpenAI's defaults where the request left them out."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice) else self.tool_choice or "auto"
        text_format = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text.format else {"type": "text"}
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens, "max_tool_calls": self.max_tool_calls,
            "temperature": 1.0 if self.temperature is None else self.temperature, "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs or 0, "tools": [tool.model_dump(exclude_none=True) for tool in self.tools],
            "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {"format": text_format, "verbosity": "medium"}, "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled", "previous_response_id": None, "background": False, "service_tier": "default",
            "metadata": self.metadata or {}, "user": self.user, "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
        }


# ---- the response ------------------------------------------------------------------------------------------------


class _OutputWriter:
    """A response's output items, built from the chat answer's pieces (a whole message, or a stream's deltas), and
    the events that announce them. Text opens a ``message`` item (reasoning a ``reasoning`` item) that grows until
    something else begins or the answer ends; each tool call is a ``function_call`` item of its own."""

    def __init__(self, request: ResponsesRequest, model: str, count_tokens: Callable[[str], int]):
        self.request = request
        self.model = model
        self.count_tokens = count_tokens
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.status = "in_progress"
        self.output: list[dict] = []
        self.open: dict | None = None  # the message or reasoning item that text goes to
        self.usage: dict | None = None
        self.error: dict | None = None
        self.sequence_number = 0

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response()), self._event("response.in_progress", response=self.response())]

    def add(self, piece: dict, logprobs: list[dict] | None) -> list[dict]:
        """A chat message or delta: its reasoning, then its text, then its calls (the order they were written in)."""
        events = []
        if piece.get("reasoning_content"):
            events += self._text("reasoning", piece["reasoning_content"], None)
        if piece.get("content"):
            events += self._text("message", piece["content"], logprobs)
        for call in piece.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, finish_reason: str | None, chat_usage: dict) -> list[dict]:
        """The end of the answer: ``length`` makes the response (and its last item) incomplete."""
        incomplete = finish_reason == "length"
        events = [] if self.output else self._open("message")  # an empty answer is still a message
        events += self._close("incomplete" if incomplete else "completed")
        reasoning = "".join(part["text"] for item in self.output if item["type"] == "reasoning" for part in item["content"])
        self.usage = {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": chat_usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
                      "total_tokens": chat_usage["total_tokens"]}
        self.status = "incomplete" if incomplete else "completed"
        return events + [self._event(f"response.{self.status}", response=self.response())]

    def fail(self, error: dict) -> list[dict]:
        """A stream that failed after it began (an engine error, or the server shutting down)."""
        events = self._close("incomplete")
        self.status, self.error = "failed", {"code": "server_error", "message": error.get("message") or "the response failed"}
        return events + [self._event("response.failed", response=self.response())]

    def response(self) -> dict:
        """The Response object as it stands."""
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model, "status": self.status,
            "completed_at": int(time.time()) if self.status == "completed" else None, "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "output": copy.deepcopy(self.output), "usage": self.usage, **self.request.echoed(),
        }

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **copy.deepcopy(fields)}  # items change after
        self.sequence_number += 1
        return event

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": [] if self.request.logprobs else None}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self.open = item
        events = [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item),
                  self._event("response.content_part.added", **self._where(item), content_index=0, part=part)]
        item["content"].append(part)
        return events

    def _text(self, kind: str, text: str, logprobs: list[dict] | None) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed") + self._open(kind)
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **self._where(self.open), content_index=0, delta=text)]
        if part["logprobs"] is not None:
            part["logprobs"] += logprobs or []
        return events + [self._event("response.output_text.delta", **self._where(self.open), content_index=0, delta=text,
                                     logprobs=logprobs or [])]

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        part = item["content"][0]
        item["status"] = status
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **self._where(item), content_index=0, text=part["text"])
        else:
            done = self._event("response.output_text.done", **self._where(item), content_index=0, text=part["text"],
                               logprobs=part["logprobs"] or [])
        return [done, self._event("response.content_part.done", **self._where(item), content_index=0, part=part),
                self._event("response.output_item.done", output_index=self.output.index(item), item=item)]

    def _call(self, call: dict) -> list[dict]:
        """A whole call (the chat path sends each call once it is complete): its item, arguments and end."""
        events = self._close("completed")
        function = call["function"]
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        events.append(self._event("response.function_call_arguments.delta", **self._where(item), delta=function["arguments"]))
        item["arguments"], item["status"] = function["arguments"], "completed"
        events.append(self._event("response.function_call_arguments.done", **self._where(item), arguments=function["arguments"]))
        return events + [self._event("response.output_item.done", output_index=self.output.index(item), item=item)]


def _logprobs(choice: dict) -> list[dict] | None:
    return (choice.get("logprobs") or {}).get("content")


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _events(writer: _OutputWriter, chat_stream: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
    """The Responses events of a streamed chat answer. Closing this closes the chat stream, which aborts the request."""
    for event in writer.start():
        yield _sse(event)
    finish_reason, usage = None, None
    async with contextlib.aclosing(chat_stream) as chunks:
        async for chunk in chunks:
            text = chunk.decode() if isinstance(chunk, bytes) else chunk
            for line in text.splitlines():
                if not line.startswith("data: {"):  # blank separators and the final [DONE]
                    continue
                payload = json.loads(line[len("data: "):])
                if "error" in payload:
                    for event in writer.fail(payload["error"]):
                        yield _sse(event)
                    return
                for choice in payload["choices"]:
                    for event in writer.add(choice["delta"], _logprobs(choice)):
                        yield _sse(event)
                    finish_reason = choice["finish_reason"] or finish_reason
                usage = payload.get("usage") or usage
    for event in writer.finish(finish_reason, usage):
        yield _sse(event)


def add_responses_routes(app: FastAPI, server: RouteServer, chat: Callable[[ChatCompletionRequest, Request], Awaitable[Response]]) -> None:
    """Register ``POST /v1/responses`` on ``app``; ``server`` is app.py's ``_Server`` (a ``RouteServer``) and ``chat``
    the handler of ``/v1/chat/completions`` that every response runs through."""
    tokenizer = server.llm.tokenizer

    def count_tokens(text: str) -> int:  # reasoning tokens, re-counted from the reasoning text
        return len(tokenizer(text, add_special_tokens=False).input_ids) if tokenizer is not None else 0

    @app.post("/v1/responses", dependencies=[Depends(server.check_api_key)])
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        body.check_supported(server.options.reasoning_parser)
        writer = _OutputWriter(body, server.options.served_model_name, count_tokens)
        try:
            answer = await chat(body.chat_request(), request)
        except (APIError, InvalidRequestError) as error:  # named in the Responses' terms
            error = error if isinstance(error, APIError) else invalid_request(error)
            error.param = "input" if error.code == "context_length_exceeded" else _PARAM_OF_CHAT_FIELD.get(error.param, error.param)
            raise error from None
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(_events(writer, answer.body_iterator), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if answer.status_code != 200:  # the client left (499): nothing to rewrite
            return answer
        completion = json.loads(answer.body)
        (choice,) = completion["choices"]
        writer.add(choice["message"], _logprobs(choice))
        writer.finish(choice["finish_reason"], completion["usage"])
        return JSONResponse(writer.response())
