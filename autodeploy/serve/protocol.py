"""The OpenAI request bodies the server accepts, and how each maps onto ``SamplingParams``.

Unknown fields are ignored, as OpenAI does. Fields OpenAI defines that this server cannot honour
(``suffix``, streamed echo with logprobs, …) are a 400 saying so, never silently dropped. ``echo`` with
``logprobs`` scores the prompt too (its tokens' log-probabilities, as OpenAI's legacy completions and
evaluation harnesses use them), and ``max_tokens`` 0 with ``echo`` generates nothing. ``logit_bias`` (token ids
as strings → bias) becomes ``SamplingParams.logit_bias``, which converts the keys. ``best_of`` > ``n`` generates
``best_of`` samples and returns the ``n`` of highest log-probability, as OpenAI's legacy completions do.
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` become a grammar over the tools' calls
(``runtime/tool_calls.py``). ``response_format`` (``text``, ``json_object``, ``json_schema``) is accepted by both endpoints, as
vLLM does; the JSON ones become ``SamplingParams.json_object`` / ``json_schema`` (grammar-constrained
decoding). Beyond OpenAI's fields, the SamplingParams ones without an OpenAI counterpart are accepted under vLLM's names (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``) and ``beam_width`` / ``length_penalty`` / ``early_stopping``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.runtime.tool_calls import ToolChoice, ToolSpec, parse_tool_choice, tool_specs


class UnsupportedFieldError(InvalidRequestError):
    """A request field OpenAI defines that this server does not implement."""

    def __init__(self, param: str, what: str):
        super().__init__(f"{param}: {what} is not supported by this server")
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``. ``strict`` is always honoured: the grammar enforces the schema either way."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def sampling_fields(self) -> dict:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                error = InvalidRequestError('response_format of type "json_schema" needs json_schema: {"name": …, "schema": {…}}')
                error.param = "response_format"
                raise error
            return {"json_schema": self.json_schema.schema_}
        return {}


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
        ``structural_tag``: the grammar of tool calls (``runtime/tool_calls.py``)."""
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
            error = InvalidRequestError(f"best_of must be ≥ n (got best_of={self.best_of}, n={self.n}): it is how many samples "
                                        "are generated, n how many of the best are returned")
            error.param = "best_of"
            raise error
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise UnsupportedFieldError("best_of", "streaming with best_of > n (the best samples are known only at the end)")
        if self.best_of is not None and self.best_of > self.n and (self.beam_width or 1) > 1:
            raise UnsupportedFieldError("best_of", "best_of > n with beam search (beam search already returns the n best)")
        if self.echo and self.logprobs is not None and self.stream:
            raise UnsupportedFieldError("echo", "streaming echo with logprobs (the prompt's log-probabilities come whole)")
        if self.max_tokens == 0 and (not self.echo or self.stream):
            error = InvalidRequestError("max_tokens 0 generates nothing: it is for scoring a prompt, with echo (and logprobs), not streamed")
            error.param = "max_tokens"
            raise error

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is empty; give a string, a list of strings or token ids")
        return list(prompt)


class ChatMessage(BaseModel):
    """One turn: ``tool_calls`` on an assistant turn that called tools, ``tool_call_id`` on a tool's result."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def template_input(self) -> dict:
        """The message in OpenAI's form, as ``runtime/chat_template.render_chat`` reads it."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True

    def tool_setup(self, call_format: str) -> tuple[list[ToolSpec] | None, ToolChoice]:
        """The tools (checked: each schema compiles into a grammar) and how they may be called, in ``call_format``."""
        specs = tool_specs(self.tools) if self.tools else None
        choice = parse_tool_choice(self.tool_choice, specs, self.parallel_tool_calls, call_format)
        if choice.mode != "none" and self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequestError("response_format json_object / json_schema and tool calls each constrain the whole output; "
                                      'use one (tool_choice "none" turns tool calls off)')
        if choice.mode != "none" and (self.beam_width or 1) > 1:
            raise UnsupportedFieldError("beam_width", "beam search with tool calls (calls are generated under a grammar)")
        return specs, choice

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``/tokenize`` (vLLM's): a ``prompt`` as the completions endpoint tokenizes it, or ``messages`` (and
    ``tools``) as the chat endpoint renders them."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            error = InvalidRequestError("give prompt (text) or messages (a chat), not both or neither")
            error.param = "prompt"
            raise error
        if self.tools and self.messages is None:
            raise UnsupportedFieldError("tools", "tools without messages (they are rendered by the chat template)")


class DetokenizeRequest(BaseModel):
    """``/detokenize`` (vLLM's): token ids → text."""

    model_config = ConfigDict(extra="ignore")
    model: str
    tokens: list[int]
