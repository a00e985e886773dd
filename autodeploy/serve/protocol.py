"""The OpenAI request bodies the server accepts, and how each maps onto ``SamplingParams``.

Unknown fields are ignored, as OpenAI does. Fields OpenAI defines that this server cannot honour
(``logit_bias``, ``suffix``, ``tools``, ``best_of`` > ``n``, …) are a 400 saying so, never silently
dropped. ``response_format`` (``text``, ``json_object``, ``json_schema``) is accepted by both endpoints, as
vLLM does; the JSON ones become ``SamplingParams.json_object`` / ``json_schema`` (grammar-constrained
decoding). Beyond OpenAI's fields, the SamplingParams ones without an OpenAI counterpart are accepted under vLLM's names (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``) and ``beam_width`` / ``length_penalty`` / ``early_stopping``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.sampling_params import SamplingParams


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
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias", "biasing token logits")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true")
        if self.stream and (self.beam_width or 1) > 1:
            raise UnsupportedFieldError("stream", "streaming beam search (beams are known only when it ends)")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; unset fields keep OpenAI's defaults (temperature 1, top_p 1)."""
        given = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                         "repetition_penalty", "stop_token_ids", "ignore_eos", "beam_width", "length_penalty", "early_stopping")
            if getattr(self, name) is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        structured = self.response_format.sampling_fields() if self.response_format is not None else {}
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, stop=stop, **given, **structured)
        params.validate()
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UnsupportedFieldError("suffix", "insertion (a suffix after the completion)")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", f"best_of ≠ n (got best_of={self.best_of}, n={self.n}); every sample is returned")
        if self.echo and self.logprobs is not None:
            raise UnsupportedFieldError("echo", "echo with logprobs (the prompt's log-probabilities)")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is empty; give a string, a list of strings or token ids")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None

    def template_input(self) -> dict:
        """The message as chat templates read it: text content only."""
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UnsupportedFieldError("messages", f"a content part of type {part.get('type')!r} (only text parts are)")
                parts.append(part["text"])
            content = "".join(parts)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise UnsupportedFieldError("tools", "tool calling (not yet)")
        if self.tool_choice not in (None, "none"):
            raise UnsupportedFieldError("tool_choice", "tool calling (not yet)")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
