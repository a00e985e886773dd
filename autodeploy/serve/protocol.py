"""The OpenAI request bodies the server accepts, and how each maps onto ``SamplingParams``.

Bodies are read as strictly as a careful OpenAI-compatible server reads them (``docs/openai-server.md`` lists
every field and what it does here):

- JSON's types, never coerced: ``"4"`` and ``true`` are not integers (a float field takes an integer), and
  ``null`` is the field left out, as OpenAI's SDKs send unset fields;
- a field this server does not know is a 400 naming it, in nested objects (messages, tools, response_format,
  stream_options) too;
- OpenAI fields that would change the output and are not implemented (audio, moderation, web search, reasoning
  effort, verbosity, ``suffix``, image parts, …) are a 400 naming them (``UnsupportedFieldError``); bookkeeping
  fields that change nothing here (``user``, ``store``, ``metadata``, ``service_tier``, prompt-cache hints,
  ``prediction``) are accepted and ignored;
- the deprecated ``functions`` / ``function_call`` are ``tools`` / ``tool_choice`` with one call at most, and
  are answered as OpenAI answers them (``legacy_function_call``); ``function`` messages are tool turns.

``echo`` returns the prompt as given (``echoed_prompt``): a text prompt's text, token ids' decoding; the tokens
a tokenizer puts in front of a text (a BOS) are context the model reads, not part of the echo. With
``logprobs`` it scores the prompt too (its tokens' log-probabilities, as OpenAI's legacy completions and
evaluation harnesses use them), and ``max_tokens`` 0 with ``echo`` generates nothing. ``logit_bias`` (token ids
as strings → bias) becomes ``SamplingParams.logit_bias``, which converts the keys. ``best_of`` > ``n`` generates
``best_of`` samples and returns the ``n`` of highest log-probability, as OpenAI's legacy completions do.
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` become a grammar over the tools' calls
(``frontend/tool_calls.py``). ``response_format`` (``text``, ``json_object``, ``json_schema``) is accepted by
both endpoints, as vLLM does; the JSON ones become ``SamplingParams.json_object`` / ``json_schema``
(grammar-constrained decoding). Beyond OpenAI's fields, the SamplingParams ones without an OpenAI counterpart
are accepted under vLLM's names (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``) and ``beam_width`` / ``length_penalty`` / ``early_stopping``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.frontend.tool_calls import ToolChoice, ToolSpec, parse_tool_choice, tool_specs

# OpenAI chat fields that would change the output and are not implemented: a 400 naming them when given.
_NOT_IMPLEMENTED = {
    "audio": "audio output",
    "moderation": "moderation of the input and output",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning effort (a model that reasons does so as its chat template asks; see --reasoning-parser)",
    "verbosity": "verbosity",
}


class UnsupportedFieldError(InvalidRequestError):
    """A request field OpenAI defines that this server does not implement."""

    def __init__(self, param: str, what: str):
        super().__init__(f"{param}: {what} is not supported by this server")
        self.param = param


def _invalid(message: str, param: str) -> InvalidRequestError:
    error = InvalidRequestError(message)
    error.param = param
    return error


class StrictModel(BaseModel):
    """JSON's types only, unknown fields refused, and ``null`` the same as leaving a field out."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool = False  # padding against a length side channel: accepted, nothing is padded here


class JSONSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``. ``strict`` is always honoured: the grammar enforces the schema either way."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def sampling_fields(self) -> dict:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise _invalid('response_format of type "json_schema" needs json_schema: {"name": …, "schema": {…}}', "response_format")
            return {"json_schema": self.json_schema.schema_}
        return {}


class _SamplingFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # bookkeeping
    # SamplingParams fields without an OpenAI counterpart (vLLM's names where it has them)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true")
        if self.stream and (self.beam_width or 1) > 1:
            raise UnsupportedFieldError("stream", "streaming beam search (beams are known only when it ends)")

    def sampling_params(self, max_tokens: int, logprobs: int | None, structural_tag: dict | None = None) -> SamplingParams:
        """The engine's parameters; unset fields keep OpenAI's defaults (temperature 1, top_p 1).
        ``structural_tag``: the grammar of tool calls (``frontend/tool_calls.py``)."""
        given = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                         "repetition_penalty", "stop_token_ids", "ignore_eos", "beam_width", "length_penalty", "early_stopping")
            if getattr(self, name) is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.logit_bias:
            given["logit_bias"] = self.logit_bias  # string token ids: validate converts them
        structured = self.response_format.sampling_fields() if self.response_format is not None else {}
        if structural_tag is not None:
            structured = {"structural_tag": structural_tag}
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, stop=stop, **given, **structured)
        params.validate()
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=128)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UnsupportedFieldError("suffix", "insertion (a suffix after the completion)")
        if self.best_of is not None and self.best_of < self.n:
            raise _invalid(f"best_of must be ≥ n (got best_of={self.best_of}, n={self.n}): it is how many samples are generated, "
                           "n how many of the best are returned", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise UnsupportedFieldError("best_of", "streaming with best_of > n (the best samples are known only at the end)")
        if self.best_of is not None and self.best_of > self.n and (self.beam_width or 1) > 1:
            raise UnsupportedFieldError("best_of", "best_of > n with beam search (beam search already returns the n best)")
        if self.echo and self.logprobs is not None and self.stream:
            raise UnsupportedFieldError("echo", "streaming echo with logprobs (the prompt's log-probabilities come whole)")
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise _invalid("max_tokens 0 generates nothing: it is for scoring a prompt, with echo (and logprobs), not streamed", "max_tokens")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is empty; give a string, a list of strings or token ids")
        return list(prompt)


def echoed_prompt(prompt: str | list[int], token_ids: list[int], tokenizer) -> tuple[str, int]:
    """``echo``'s text for a prompt, as given (a text as sent, token ids decoded), and the index of its first
    token in ``token_ids``: the tokens the tokenizer put in front of a text (a BOS) come before it, context the
    model reads but not part of the echo, so that an evaluation harness that counts the text's tokens finds them
    where it counted."""
    if not isinstance(prompt, str):
        return (tokenizer.decode(token_ids) if tokenizer is not None else ""), 0
    text_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    added = len(token_ids) - len(text_ids)
    return prompt, added if added > 0 and token_ids[added:] == text_ids else 0


class TextPart(StrictModel):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict | None = None  # a caching hint: accepted, the prefix cache needs none


class CalledFunction(StrictModel):
    name: str
    arguments: str | dict  # OpenAI's JSON text; a dict as Hugging Face chat templates take it


class MessageToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ImageURL(StrictModel):
    url: str  # a data: URL, an http(s) URL (fetched with vision's limits), or a file the server may read
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the resolution


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


def _text_and_image_parts(content):
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("text", "image_url"):
            raise PydanticCustomError("content_part", "a content part of type {kind!r} is not supported by this server "
                                                      "(text and image_url parts are)", {"kind": kind})
    return content


class ChatMessage(StrictModel):
    """One turn: ``tool_calls`` on an assistant turn that called tools, ``tool_call_id`` on a tool's result; the
    deprecated ``function_call`` (assistant) and ``function`` role (a function's result) are the same, one call a
    turn. ``refusal`` (an earlier answer's) is bookkeeping; ``audio`` (an earlier audio answer) is refused."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    function_call: CalledFunction | None = None
    refusal: str | None = None
    audio: dict | None = None

    content_parts = field_validator("content", mode="before")(_text_and_image_parts)

    def template_input(self) -> dict:
        """The message in OpenAI's current form, as ``frontend/chat_template.render_chat`` reads it."""
        message = self.model_dump(exclude_none=True, include={"role", "content", "name", "tool_calls", "tool_call_id"})
        if self.role == "function":
            message["role"] = "tool"
        if self.function_call is not None:
            message["tool_calls"] = [{"type": "function", "function": self.function_call.model_dump()}]
        return message


class FunctionDefinition(StrictModel):
    """A function tool. ``strict`` is always honoured: calls are generated under a grammar of the parameters'
    schema either way."""

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def _function_tools_only(tools):
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        if kind != "function":
            raise PydanticCustomError("tool_type", "tools[{index}]: tools of type {kind!r} are not supported by this server "
                                                   "(only function tools are)", {"index": index, "kind": kind})
    return tools


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


def _tool_choices_this_server_has(choice):
    if isinstance(choice, dict) and choice.get("type") in ("allowed_tools", "custom"):
        raise PydanticCustomError("tool_choice", "tool_choice of type {kind!r} is not supported by this server (only "
                                                 '"none", "auto", "required" and a named function are)', {"kind": choice["type"]})
    return choice


def _checked_tools(tools: list[Tool] | None) -> list[ToolSpec] | None:
    """The tools' specs (each schema checked to compile into a grammar); None without tools."""
    return tool_specs([tool.model_dump(exclude_none=True) for tool in tools]) if tools else None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # deprecated, mapped onto tools and tool_choice
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # refused when given (_NOT_IMPLEMENTED), and modalities with "audio"
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict | None = None
    moderation: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # bookkeeping: accepted, and nothing here depends on them
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    prediction: dict | None = None  # a draft of the answer, to answer faster: the answer is the same without it

    tools_of_function_type = field_validator("tools", mode="before")(_function_tools_only)
    tool_choices_this_server_has = field_validator("tool_choice", mode="before")(_tool_choices_this_server_has)

    def check_supported(self) -> None:
        super().check_supported()
        for name, what in _NOT_IMPLEMENTED.items():
            if getattr(self, name) is not None:
                raise UnsupportedFieldError(name, what)
        if "audio" in (self.modalities or ()):
            raise UnsupportedFieldError("modalities", "audio output")
        if any(message.audio is not None for message in self.messages):
            raise UnsupportedFieldError("messages", "an assistant turn's audio (audio output)")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")

    def tool_setup(self, call_format: str) -> tuple[list[ToolSpec] | None, ToolChoice]:
        """The tools (checked: each schema compiles into a grammar) and how they may be called, in ``call_format``."""
        if self.functions is None:
            if self.function_call is not None:
                raise _invalid("function_call needs functions (or use tools and tool_choice)", "function_call")
            specs = _checked_tools(self.tools)
            choice = parse_tool_choice(self.tool_choice if self.tool_choice is None or isinstance(self.tool_choice, str)
                                       else self.tool_choice.model_dump(), specs, self.parallel_tool_calls, call_format)
        else:
            specs, choice = self._legacy_function_setup(call_format)
        if choice.mode != "none" and self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequestError("response_format json_object / json_schema and tool calls each constrain the whole output; "
                                      'use one (tool_choice "none" turns tool calls off)')
        if choice.mode != "none" and (self.beam_width or 1) > 1:
            raise UnsupportedFieldError("beam_width", "beam search with tool calls (calls are generated under a grammar)")
        return specs, choice

    def _legacy_function_setup(self, call_format: str) -> tuple[list[ToolSpec] | None, ToolChoice]:
        """``functions`` as tools and ``function_call`` as the tool choice, one call at most (a ``function_call``
        answer holds one)."""
        if self.tools is not None:
            raise _invalid("give tools or the deprecated functions, not both", "functions")
        if self.tool_choice is not None:
            raise _invalid("function_call goes with functions and tool_choice with tools; give one pair", "function_call")
        specs = _checked_tools([Tool(function=function) for function in self.functions])
        choice = self.function_call
        choice = {"type": "function", "function": choice.model_dump()} if isinstance(choice, FunctionName) else choice
        try:
            return specs, parse_tool_choice(choice, specs, False, call_format)
        except InvalidRequestError as error:
            raise _invalid(f"function_call: {error}", "function_call") from None

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def legacy_function_call(choice: dict) -> dict:
    """A chat choice (whole, or a stream chunk's) as OpenAI answers a request made with the deprecated
    ``functions``: its call in ``function_call`` (name and arguments) rather than ``tool_calls``, and the finish
    reason ``function_call``."""
    key = "message" if "message" in choice else "delta"
    message = dict(choice[key])
    calls = message.pop("tool_calls", None)
    if calls:
        message["function_call"] = calls[0]["function"]
    finish_reason = "function_call" if choice["finish_reason"] == "tool_calls" else choice["finish_reason"]
    return {**choice, key: message, "finish_reason": finish_reason}


class TokenizeRequest(StrictModel):
    """``/tokenize`` (vLLM's): a ``prompt`` as the completions endpoint tokenizes it, or ``messages`` (and
    ``tools``) as the chat endpoint renders them. ``model`` may be left out, as vLLM allows (lm-eval's remote
    tokenizer sends none)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True

    tools_of_function_type = field_validator("tools", mode="before")(_function_tools_only)

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise _invalid("give prompt (text) or messages (a chat), not both or neither", "prompt")
        if self.tools and self.messages is None:
            raise UnsupportedFieldError("tools", "tools without messages (they are rendered by the chat template)")

    def checked_tools(self) -> list[ToolSpec] | None:
        return _checked_tools(self.tools)


class DetokenizeRequest(StrictModel):
    """``/detokenize`` (vLLM's): token ids → text."""

    model: str | None = None  # optional, as for /tokenize
    tokens: list[int]

