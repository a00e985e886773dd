"""The OpenAI-compatible HTTP API over one deployed model: ``build_app(llm, options)`` → a FastAPI app.

Every request runs through one ``AsyncLLM``, so requests from all clients share the engine's batches.
A prompt list (completions) becomes one engine request per prompt; choice ``i`` of prompt ``p`` is
choice ``p * n + i``, as OpenAI numbers them. A client that disconnects aborts its requests, which frees
their KV blocks at once; a request that finds ``max_queued_requests`` requests already admitted and waiting
for a seat waits in a lobby, before its prompt is even tokenized, and gets a 503 with ``Retry-After`` if no room
comes within ``queue_timeout_s`` (``admission.py``). Tokenizing, rendering chat
templates and validating run in worker threads, so a large prompt never stalls the event loop, and a body
over ``max_request_bytes`` is a 413 before it is read (``body_limit.py``). A model that does not generate (``llm.tasks``
without "generate": an embedding model, a reranker) gets an app without an engine: the embedding routes
(``embeddings_api.py``), its card and ``/tokenize``; on either app, a route of a task the model lacks answers a 400
saying what it serves.

    app = build_app(autodeploy("path/to/checkpoint"), ServerOptions(served_model_name="tiny"))
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from autodeploy.errors import AutoDeployError, ConfigError, InvalidRequestError, error_summary
from autodeploy.frontend.async_llm import AsyncLLM, check_stream_interval
from autodeploy.frontend.llm import LLM
from autodeploy.runtime.images import load_image
from autodeploy.runtime.outputs import CompletionOutput, RequestOutput
from autodeploy.runtime.request import Request as EngineRequest
from autodeploy.frontend.chat_template import render_chat_text, tool_call_format
from autodeploy.frontend.reasoning import CONTENT, REASONING, ReasoningParser, opens_thinking, split_reasoning
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.frontend.tool_calls import ToolCallParser, ToolSpec, parse_tool_calls, tool_call_grammar
from autodeploy.serve.api_key import API_KEY_SCOPES, KeyOnEveryRoute, bearer_key_matches, missing_key_error
from autodeploy.serve.admission import Admission, Place
from autodeploy.serve.batches_api import ENDPOINTS, BatchStore, add_batch_routes, add_disabled_batch_routes
from autodeploy.serve.disagg.worker import (
    KV_HEADER, PHASE_HEADER, RESUME_HEADER, TOKENS_HEADER, DisaggWorker, WorkerOptions, resume_requests,
)
from autodeploy.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from autodeploy.serve.embeddings_api import TASK_OF_ROUTE, EmbeddingService, add_embedding_routes
from autodeploy.serve.metrics import ServerMetrics
from autodeploy.serve.model_info import add_model_info_routes
from autodeploy.serve.openai_errors import APIError, error_body, install_error_handlers, invalid_request
from autodeploy.serve.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, echoed_prompt, legacy_function_call,
)
from autodeploy.serve.responses import add_responses_routes

logger = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    """``served_model_name``: the id clients pass as ``model``. ``api_key``: when set, the API's routes need
    ``Authorization: Bearer <api_key>``; ``api_key_scope`` ``"all"`` extends that to every route but ``/health``
    (``api_key.py``). ``chat_template``: Jinja text overriding the tokenizer's.
    ``max_queued_requests``: how many admitted requests may wait for a seat in the batch; one more waits in a lobby
    for up to ``queue_timeout_s`` seconds, then is refused (503, ``Retry-After: retry_after_s``; ``admission.py``).
    ``max_request_bytes``: a larger request body is refused (413) before it is read.
    ``tool_call_format``: how tool calls are generated, ``"hermes"`` tags or bare ``"json"`` (``"auto"``: the
    one the chat template teaches, ``frontend/tool_calls.py``). ``stream_interval``: a stream's chunks after
    the first carry this many new tokens each (the last fewer): fewer events to encode and send, at longer
    gaps between them (``AsyncLLM.stream``). ``reasoning_parser``: ``"think"`` splits a chat answer's
    ``<think>…</think>`` block into ``reasoning_content`` (``frontend/reasoning.py``); ``"none"`` leaves it in
    the content. ``batch_dir``: where the Files and Batch APIs keep their files and batches (``batches_api.py``);
    None: those routes answer 404."""

    served_model_name: str
    api_key: str | None = None
    api_key_scope: str = "api"
    chat_template: str | None = None
    max_queued_requests: int = 256
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tool_call_format: str = "auto"
    stream_interval: int = 1
    reasoning_parser: str = "none"
    batch_dir: str | None = None
    disagg: WorkerOptions | None = None  # a disaggregated worker's role (serve/disagg/worker.py); None: a plain server


REASONING_PARSERS = ("none", "think")


def build_app(llm: LLM, options: ServerOptions) -> FastAPI:
    """A FastAPI app serving ``llm``; the engine (and its KV pool) is built here, before the first request. A model
    that does not generate gets the embedding app instead, and no engine (``_build_embedding_app``)."""
    _check_options(options)
    if "generate" not in llm.tasks:
        return _build_embedding_app(llm, options)
    engine = llm.engine
    try:
        call_format = tool_call_format(llm.tokenizer, options.chat_template, options.tool_call_format)
        check_stream_interval(options.stream_interval)
    except InvalidRequestError as error:  # a bad option fails here, before the server starts
        raise ConfigError(str(error)) from None
    metrics = ServerMetrics(engine)
    server = _Server(llm, options, metrics)
    embedding = EmbeddingService(llm, options)  # a model that also embeds or scores: those routes answer too
    batches = _batch_store(llm, options)
    server.disagg = DisaggWorker(llm, options.disagg) if options.disagg is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_llm = AsyncLLM(llm)
        try:
            async with _serving(app, embedding, batches):
                yield
        finally:
            server.async_llm.shutdown()  # in-flight requests end with "abort", their blocks freed
            if server.disagg is not None:
                server.disagg.close()  # leaves the registry at once

    app = _api_app(options, lifespan)
    authorized = [Depends(server.check_api_key)]

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        return server.model_list()

    @app.get("/disagg/load")  # open, as /metrics: a router polls it without the clients' key
    async def disagg_load() -> dict:  # what a router balances by (serve/disagg/router.py)
        if server.disagg is None:
            return {"role": "both", "load": engine.load()}
        return server.disagg.info()

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        body.check_supported()
        async with server.queue_place() as place:  # waits in the lobby, or the 503 (admission.py)
            texts = body.prompts()
            prompts = await asyncio.to_thread(_indexed, engine.tokenize, texts)
            samples = body.best_of or body.n
            # best_of > n: every sample scored by its log-probability, so the engine returns them
            logprobs = body.logprobs if samples == body.n or body.logprobs is not None else 0
            max_tokens = body.max_tokens if body.max_tokens is not None else 16
            params = body.sampling_params(max_tokens or 1, logprobs)  # max_tokens 0 (echo only): the fields still checked
            params.n = samples
            echoes = [echoed_prompt(text, ids, llm.tokenizer) if body.echo else ("", 0) for text, ids in zip(texts, prompts)]
            writer = _CompletionFormat(server, [text for text, _ in echoes], keep=body.n, logprobs=body.logprobs is not None)
            if body.echo and body.logprobs is not None:  # the prompt's own log-probabilities
                writer.prompt_logprobs = [writer.scored_prompt(ids, await asyncio.to_thread(engine.prompt_logits, ids), body.logprobs, first)
                                          for ids, (_, first) in zip(prompts, echoes)]
            if max_tokens == 0:
                return JSONResponse(writer.echo_only(prompts))
            return await server.respond(request, writer, prompts, params, body.stream,
                                        body.stream_options is not None and body.stream_options.include_usage, place)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        body.check_supported()
        tools, choice = body.tool_setup(call_format)
        async with server.queue_place() as place:  # waits in the lobby, or the 503 (admission.py)
            prompt = await asyncio.to_thread(server.render_chat, [m.template_input() for m in body.messages], tools)
            max_tokens = body.requested_max_tokens()
            if max_tokens is None:  # OpenAI's default: whatever the context leaves
                max_tokens = engine.max_seq_len - server.prompt_length(prompt)
                if max_tokens < 1:
                    raise APIError(400, f"the messages take {server.prompt_length(prompt)} tokens, the whole context (max_seq_len="
                                        f"{engine.max_seq_len}); shorten them", param="messages", code="context_length_exceeded")
            params = body.sampling_params(max_tokens, body.requested_logprobs(), tools and tool_call_grammar(tools, choice))
            thinking = None  # without a reasoning parser: no split
            if options.reasoning_parser == "think":
                ids = prompt["prompt"] if isinstance(prompt, dict) else prompt
                thinking = llm.tokenizer is not None and opens_thinking(llm.tokenizer.decode(ids[-8:]))
            writer = (_LegacyFunctionFormat if body.functions is not None else _ChatFormat)(server, tools if choice.mode != "none" else None,
                                                                                            thinking)
            return await server.respond(request, writer, [prompt], params, body.stream,
                                        body.stream_options is not None and body.stream_options.include_usage, place)

    if batches is not None:
        add_batch_routes(app, batches, authorized)
    else:
        add_disabled_batch_routes(app)

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            tools = body.checked_tools()
            tokens = await asyncio.to_thread(server.render_chat, [m.template_input() for m in body.messages], tools)
            if isinstance(tokens, dict):  # each image's placeholder as the model reads it
                tokens = engine.vision.expand_placeholders(tokens["prompt"], len(tokens["images"]))[0]
        else:
            tokens = await asyncio.to_thread(engine.tokenize, body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_seq_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer files, so token ids cannot be decoded", param="tokens")
        outside = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if outside:
            raise APIError(400, f"tokens outside the vocabulary [0, {engine.vocab_size}): {outside[:4]}", param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    add_model_info_routes(app, server, list_models=models)
    add_responses_routes(app, server, chat=chat_completions)  # a response is the chat path's answer, rewritten
    add_embedding_routes(app, server, embedding)
    return app


@contextlib.asynccontextmanager
async def _serving(app: FastAPI, embedding: EmbeddingService, batches: BatchStore | None):
    """What every app runs while it serves: the embedder's worker and the batches in ``batch_dir`` (a batch the last
    server left running goes on). They stop before whatever runs their requests (the engine, the embedder's own calls),
    so a batch's requests in flight are not written as aborted; requests still queued for the embedder answer 503."""
    embedding.start()
    if batches is not None:
        batches.start(app)
    try:
        yield
    finally:
        if batches is not None:
            await batches.stop()
        embedding.stop()


def _batch_store(llm: LLM, options: ServerOptions) -> BatchStore | None:
    """The Files and Batch APIs' store in ``options.batch_dir`` (None without one)."""
    if options.batch_dir is None:
        return None
    try:
        endpoints = tuple(route for route in ENDPOINTS if TASK_OF_ROUTE[route] in llm.tasks)
        return BatchStore(options.batch_dir, options.served_model_name, 2 * llm.settings.max_batch_size, endpoints)
    except OSError as error:
        raise ConfigError(f"--batch-dir {options.batch_dir}: {error.strerror}") from None


def _check_options(options: ServerOptions) -> None:
    """The options every app reads, checked before anything is built."""
    if options.reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"the reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {options.reasoning_parser!r}")
    if options.api_key_scope not in API_KEY_SCOPES:
        raise ConfigError(f"api_key_scope must be one of {', '.join(API_KEY_SCOPES)}, got {options.api_key_scope!r}")
    if options.api_key_scope == "all" and options.api_key is None:
        raise ConfigError("api_key_scope all needs an api_key (--api-key)")
    if options.max_queued_requests < 1 or options.max_request_bytes < 1 or not options.queue_timeout_s >= 0:
        raise ConfigError(f"max_queued_requests and max_request_bytes must be ≥ 1 and queue_timeout_s ≥ 0, got "
                          f"{options.max_queued_requests}, {options.max_request_bytes} and {options.queue_timeout_s}")


def _api_app(options: ServerOptions, lifespan) -> FastAPI:
    """The app every deployment's routes go on: errors in OpenAI's shape, the body size limit, the API key on every
    route with ``api_key_scope`` "all", and ``/health``."""
    app = FastAPI(title="autodeploy", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=options.max_request_bytes)
    if options.api_key_scope == "all":
        app.add_middleware(KeyOnEveryRoute, api_key=options.api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def _build_embedding_app(llm: LLM, options: ServerOptions) -> FastAPI:
    """The app of a model that does not generate (an embedding model, a cross-encoder reranker): the embedding
    routes over an ``AsyncEmbedder`` its lifespan starts, ``/v1/models`` and ``/tokenize``; the generation routes
    answer the 400 saying what the model serves. With ``batch_dir``, the Files and Batch APIs run /v1/embeddings batches."""
    server = _ModelServer(llm, options, llm.max_seq_len)
    embedding = EmbeddingService(llm, options)
    batches = _batch_store(llm, options)

    app = _api_app(options, lambda app: _serving(app, embedding, batches))
    authorized = [Depends(server.check_api_key)]

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        return server.model_list()

    # model_info.py's route would do, but its /tokenizer_info beside it reads the generation engine
    @app.get("/v1/models/{model_id:path}", dependencies=authorized)
    async def retrieve_model(model_id: str) -> dict:
        if model_id != options.served_model_name:
            raise APIError(404, f"the model {model_id!r} does not exist here; this server serves {options.served_model_name!r}",
                           param="model", code="model_not_found")
        return server.model_list()["data"][0]

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(body: TokenizeRequest) -> dict:  # the token ids the model reads, special tokens included
        if body.model is not None:
            server.check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            raise APIError(400, "this model renders no chats (it does not generate); send prompt", param="messages")
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer files, so text cannot be tokenized", param="prompt")
        tokens = (await asyncio.to_thread(llm.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)).input_ids
        return {"count": len(tokens), "max_model_len": llm.max_seq_len, "tokens": tokens}

    add_embedding_routes(app, server, embedding)
    if batches is not None:
        add_batch_routes(app, batches, authorized)
    else:
        add_disabled_batch_routes(app)
    return app


def _indexed(tokenize, prompts: list) -> list[list[int]]:
    """Token ids of each prompt; an error names the prompt when there are several."""
    token_ids = []
    for index, prompt in enumerate(prompts):
        try:
            token_ids.append(tokenize(prompt))
        except InvalidRequestError as error:
            raise InvalidRequestError(f"prompt {index}: {error}" if len(prompts) > 1 else str(error)) from None
    return token_ids


class _ModelServer:
    """What every app's routes read: the model, the options, and the checks of a request's key and model."""

    def __init__(self, llm: LLM, options: ServerOptions, max_seq_len: int):
        self.llm = llm
        self.options = options
        self.max_seq_len = max_seq_len
        self.started = int(time.time())

    def model_list(self) -> dict:
        """``GET /v1/models``: the served model's card."""
        card = {"id": self.options.served_model_name, "object": "model", "created": self.started, "owned_by": "autodeploy",
                "max_model_len": self.max_seq_len}
        return {"object": "list", "data": [card]}

    async def check_api_key(self, request: Request) -> None:
        if self.options.api_key is not None and not bearer_key_matches(request.headers.get("authorization", ""), self.options.api_key):
            raise missing_key_error()

    def check_model(self, model: str) -> None:
        if model != self.options.served_model_name:
            raise APIError(400, f"model {model!r} is not served here; this server serves {self.options.served_model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")


class _Server(_ModelServer):
    """A generating model's: its engine, admission and metrics."""

    def __init__(self, llm: LLM, options: ServerOptions, metrics: ServerMetrics):
        self.engine = llm.engine
        super().__init__(llm, options, self.engine.max_seq_len)
        self.metrics = metrics
        self.async_llm: AsyncLLM | None = None
        self.disagg: DisaggWorker | None = None  # a disaggregated worker's role (build_app sets it)
        self.admission = Admission(self.engine.scheduler, options.max_queued_requests, options.queue_timeout_s,
                                   options.retry_after_s, on_refusal=metrics.rejected.inc)
        metrics.waiting_for_room.set_function(lambda: self.admission.lobby_size)

    def render_chat(self, messages: list[dict], tools: list[ToolSpec] | None) -> list[int] | dict:
        """The chat's prompt token ids (its text checked for length before it is tokenized); with image parts,
        ``{"prompt": ids, "images": …}``, local files among them read here, only from ``vision.allowed_local_dir``."""
        images: list = []
        image_token = self.llm.image_token
        text = render_chat_text(self.llm.tokenizer, messages, self.options.chat_template, tools,
                                images if image_token else None, image_token)
        ids = self.engine.tokenize(text, add_special_tokens=False)
        if not images:
            return ids
        return {"prompt": ids, "images": [self._server_side(index, url) for index, url in enumerate(images)]}

    def _server_side(self, index: int, url):
        """An image URL as the engine may take it from a client: data: and http(s) URLs as they are (the engine fetches
        those within its limits); a local file only inside ``vision.allowed_local_dir``, read here."""
        if isinstance(url, str) and urlsplit(url).scheme.lower() in ("data", "http", "https"):
            return url
        allowed = self.llm.settings.vision.allowed_local_dir
        if allowed is None:
            raise InvalidRequestError(f"image {index}: this server reads no local files ({str(url)[:80]!r}); send a data: "
                                      f"or http(s) URL, or start it with --set vision.allowed_local_dir=DIR")
        vision = self.engine.vision
        return load_image(url, index=index, limits=vision.limits, local_files=Path(allowed)).image

    def prompt_length(self, prompt: list[int] | dict) -> int:
        """Tokens the prompt takes in the context (each image's placeholder as many as its feature rows)."""
        if isinstance(prompt, dict):  # as admission will expand it (a bad placeholder count is the request's 400 now)
            return len(self.engine.vision.expand_placeholders(prompt["prompt"], len(prompt["images"]))[0])
        return len(prompt)

    def queue_place(self):
        """A place in the queue for this request's engine requests (``Admission.place``), waited for in the lobby
        for ``queue_timeout_s`` at most, before its prompt is tokenized."""
        return self.admission.place(asyncio.get_running_loop().time() + self.options.queue_timeout_s)

    def make_requests(self, prompts: list[list[int]], params: SamplingParams) -> list[EngineRequest]:
        """The engine's requests, one per prompt, each validated before any is queued."""
        sequences, seats = len(prompts) * params.n, self.engine.scheduler.max_num_seqs
        if sequences > seats:  # the samples fork together; more than the batch holds would evict everyone else
            raise APIError(400, f"this request needs {sequences} sequences ({len(prompts)} prompt(s) × {params.n} samples (n or "
                                f"best_of)), more than the batch's {seats} seats (max_batch_size); ask for fewer",
                           param="n", code="too_many_sequences")
        requests = []
        for index, prompt in enumerate(prompts):
            try:
                requests.append(self.engine.make_request(prompt, params))
            except InvalidRequestError as error:
                raise invalid_request(InvalidRequestError(f"prompt {index}: {error}" if len(prompts) > 1 else str(error))) from None
        return requests

    async def respond(self, request: Request, writer: _ResponseFormat, prompts: list[list[int]], params: SamplingParams,
                      stream: bool, include_usage: bool, place: Place) -> Response:
        """Queue the requests in their ``place`` (``queue_place``) and answer them. On a disaggregated worker, the router's
        headers (``serve/disagg/worker.py``) make it the prefill phase (compute the prompts, hold their KV blocks, say
        where they are), pull the prompts' blocks first, or resume a stream another worker began."""
        headers = request.headers
        if {PHASE_HEADER, KV_HEADER, RESUME_HEADER} & set(headers) and self.disagg is None:
            raise APIError(400, "this server is not a disaggregated worker (start it with --role prefill or --role decode)")
        if RESUME_HEADER in headers and headers.get(PHASE_HEADER) == "prefill":  # the KV of the tokens streamed so far too
            tokens, _ = resume_requests(headers[RESUME_HEADER], await asyncio.to_thread(self.make_requests, prompts, params))
            prompts = [_extended(prompts[0], tokens)]
        if headers.get(PHASE_HEADER) == "prefill":
            if self.disagg.kv_address is None:
                raise APIError(400, "a decode worker serves no prefill phase (it has no KV transfer service); send the request "
                                    "to a prefill worker")
            return await self._prefill(prompts, place)
        holders = []
        if KV_HEADER in headers:
            if self.disagg.role == "prefill":
                raise APIError(400, "a prefill worker does not decode; send the request to a decode worker")
            try:
                holders = await asyncio.to_thread(self.disagg.receive, headers[KV_HEADER], len(prompts))
            except InvalidRequestError:
                raise
            except AutoDeployError as error:  # TransferError: the workers serve different models or KV layouts
                raise APIError(409, str(error), code="kv_mismatch") from None
        try:
            queued = await asyncio.to_thread(self.make_requests, prompts, params)
            resumed = resume_requests(headers[RESUME_HEADER], queued) if RESUME_HEADER in headers else None
        except BaseException:
            if holders:
                self.disagg.release(holders)
            raise
        self.admission.enter(queued, place)
        if stream:
            events = self._events(writer, queued, params, include_usage, resumed, annotate=TOKENS_HEADER in headers)
            return StreamingResponse(self._releasing(events, holders), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            finals = await _unless_disconnected(request, self._finals(queued))
        finally:
            self.admission.leave(queued)
            if holders:
                self.disagg.release(holders)
        if finals is None:  # the client left; its requests were aborted
            for _ in queued:
                self.metrics.observe_abandoned()
            return Response(status_code=499)
        if any(o.finish_reason == "abort" for o in finals):
            raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
        kept = [writer.kept(output.outputs) for output in finals]
        choices = [writer.choice(p * len(k) + i, c, p) for p, k in enumerate(kept) for i, c in enumerate(k)]
        return JSONResponse(writer.envelope(choices, usage=_usage(finals)))

    async def _prefill(self, prompts: list, place: Place) -> Response:
        """A prefill worker's phase: compute the prompts (one greedy token each, not returned: the decode worker samples
        every token), then hold their blocks for the decode worker to pull."""
        queued = await asyncio.to_thread(self.make_requests, prompts, SamplingParams(max_tokens=1, temperature=0))
        self.admission.enter(queued, place)
        try:
            finals = await self._finals(queued)
        finally:
            self.admission.leave(queued)
        if any(o.finish_reason == "abort" for o in finals):
            raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
        return JSONResponse({"kv_transfer": self.disagg.hold(queued)})

    async def _releasing(self, events: AsyncIterator[str], holders: list[str]) -> AsyncIterator[str]:
        """``events``, then the decode phase's received blocks go back (the request has long found its prefix)."""
        try:
            async for event in events:
                yield event
        finally:
            if holders:
                self.disagg.release(holders)

    async def _finals(self, queued: list[EngineRequest]) -> list[RequestOutput]:
        finals = await asyncio.gather(*(self.async_llm.generate(engine_request) for engine_request in queued))
        for output in finals:
            self.metrics.observe_finished(output)
        return finals

    async def _events(self, writer: _ResponseFormat, queued: list[EngineRequest], params: SamplingParams,
                      include_usage: bool, resumed: tuple[list[int], str] | None = None, annotate: bool = False) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new piece of a choice, its finish, then usage (if asked) and [DONE].
        ``resumed``: the tokens and text another worker streamed, which the writer reads (its parsers' state) but does
        not send. ``annotate``: each choice also carries ``autodeploy: {token_ids, text}``, its new tokens and raw text,
        and a choice the writer holds back is sent with only those (a router strips them; ``serve/disagg/router.py``)."""
        streams = [self.async_llm.stream(engine_request, stream_interval=self.options.stream_interval) for engine_request in queued]
        finals: dict[int, RequestOutput] = {}
        started: set[int] = set()
        if resumed is not None:
            tokens, text = resumed
            writer.delta(0, CompletionOutput(0, text, tokens, None, new_token_ids=tokens, new_text=text), 0, first=True)
            started.add(0)
        try:
            async with contextlib.aclosing(_merged(streams)) as merged:  # closed at once when the client leaves
                async for prompt_index, output in merged:
                    chunk_choices = []
                    for completion in output.outputs:
                        index = prompt_index * params.n + completion.index
                        if completion.finish_reason == "abort":
                            raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
                        # A chunk per step that made tokens, even with no new text (a model without a tokenizer, bytes
                        # of a character still arriving): clients see progress, and inter-token latency is measurable.
                        if index not in started or completion.new_text or completion.new_token_ids \
                                or completion.finish_reason is not None or annotate:
                            delta = writer.delta(index, completion, prompt_index, first=index not in started)
                            if annotate:
                                delta = delta or {"index": index, "autodeploy_only": True}
                                delta["autodeploy"] = {"token_ids": completion.new_token_ids, "text": completion.new_text}
                            if delta is not None:
                                chunk_choices.append(delta)
                            started.add(index)
                    if chunk_choices:
                        yield _event(writer.envelope(chunk_choices, chunk=True))
                    if output.finished:
                        finals[prompt_index] = output
                        self.metrics.observe_finished(output)
            if include_usage:
                yield _event(writer.envelope([], chunk=True, usage=_usage([finals[p] for p in sorted(finals)])))
        except APIError as error:
            yield _event(error_body(error.status, error.message, error.param, error.code))
        except Exception as error:  # a failed engine step: the stream has started, so the error goes in it
            logger.exception("stream failed")
            yield _event(error_body(500, error_summary(error)))
        finally:
            self.admission.leave(queued)
            for _ in range(len(queued) - len(finals)):
                self.metrics.observe_abandoned()
        yield "data: [DONE]\n\n"


def _extended(prompt: list[int] | dict, tokens: list[int]) -> list[int] | dict:
    """A prompt with ``tokens`` after it (a dict prompt's ids, its images kept)."""
    if isinstance(prompt, dict):
        return {**prompt, "prompt": list(prompt["prompt"]) + tokens}
    return list(prompt) + tokens


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(stream index, output)`` in arrival order. Closing it cancels the streams' pending reads, which
    aborts their requests (``AsyncLLM.stream``)."""
    if len(streams) == 1:  # the common case, without a task and a wait per output
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, output
    finally:
        for task in pending:
            task.cancel()


async def _unless_disconnected(request: Request, work: Awaitable):
    """``work``'s result, or None once the client disconnects (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its requests are aborted as the cancellation unwinds AsyncLLM's generators
    if not task.done():
        await asyncio.wait({task})  # the cancellation has unwound
        return None
    return task.result()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class _ResponseFormat:
    """How one endpoint writes choices and the object around them."""

    object: str
    chunk_object: str
    id_prefix: str

    def __init__(self, server: _Server):
        self.server = server
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokenizer = server.llm.tokenizer

    def envelope(self, choices: list[dict], chunk: bool = False, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.chunk_object if chunk else self.object, "created": self.created,
                "model": self.server.options.served_model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def kept(self, completions: list[CompletionOutput]) -> list[CompletionOutput]:
        """The completions a prompt returns (all of them, unless ``best_of`` generated more)."""
        return completions


class _CompletionFormat(_ResponseFormat):
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, server: _Server, echoes: list[str], keep: int, logprobs: bool):
        super().__init__(server)
        self.echoes = echoes
        self.offsets: dict[int, int] = {}  # streamed text length per choice, for text_offset
        self.keep = keep  # n, of best_of samples
        self.logprobs = logprobs  # asked for (best_of > n asks the engine anyway, to rank the samples)
        self.prompt_logprobs: list[dict] | None = None  # per prompt, with echo and logprobs (scored_prompt)

    def scored_prompt(self, token_ids: list[int], logits, top: int, first: int = 0) -> dict:
        """The prompt's tokens from ``first`` on (those before it a tokenizer added: context, not echoed) in
        OpenAI's legacy logprobs format: each its log-probability after the tokens before it and the ``top``
        most likely there, but token 0, which nothing precedes."""
        import torch

        chosen, best = [None], [None]
        following = torch.tensor(token_ids[1:], device=logits.device)
        for start in range(0, len(token_ids) - 1, 256):  # a few rows of float32 log-probabilities at a time
            rows = torch.log_softmax(logits[start : start + 256].float(), dim=-1)[: len(token_ids) - 1 - start]
            chosen += rows.gather(1, following[start : start + len(rows), None]).squeeze(1).tolist()
            values, indices = rows.topk(top, dim=-1)
            best += [{self.token_text(t): v for t, v in zip(i, val)} for i, val in zip(indices.tolist(), values.tolist())]
        tokens = [self.token_text(t) for t in token_ids[first:]]
        offsets = [0, *itertools.accumulate(map(len, tokens[:-1]))]
        return {"tokens": tokens, "token_logprobs": chosen[first:], "top_logprobs": best[first:], "text_offset": offsets}

    def echo_only(self, prompts: list[list[int]]) -> dict:
        """``max_tokens`` 0: each prompt echoed (with its logprobs, if asked), ``n`` times, nothing generated."""
        choices = [{"index": p * self.keep + i, "text": self.echoes[p], "finish_reason": "length",
                    "logprobs": self.prompt_logprobs[p] if self.prompt_logprobs is not None else None}
                   for p in range(len(prompts)) for i in range(self.keep)]
        prompt_tokens = sum(map(len, prompts))
        return self.envelope(choices, usage={"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens})

    def kept(self, completions: list[CompletionOutput]) -> list[CompletionOutput]:
        """With ``best_of`` > ``n``: the ``n`` samples of highest log-probability, best first (OpenAI's order)."""
        if len(completions) == self.keep:
            return completions
        ranked = sorted(completions, key=lambda c: sum(c.logprobs), reverse=True)[: self.keep]
        return ranked if self.logprobs else [dataclasses.replace(c, logprobs=None, top_logprobs=None) for c in ranked]

    def choice(self, index: int, completion: CompletionOutput, prompt_index: int) -> dict:
        echo = self.echoes[prompt_index]
        logprobs = self._logprobs(completion, len(completion.token_ids), len(echo))
        if self.prompt_logprobs is not None and logprobs is not None:  # the prompt's entries first
            prompt = self.prompt_logprobs[prompt_index]
            logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
        return {"index": index, "text": echo + completion.text, "finish_reason": completion.finish_reason, "logprobs": logprobs}

    def delta(self, index: int, completion: CompletionOutput, prompt_index: int, first: bool) -> dict:
        text = (self.echoes[prompt_index] if first else "") + completion.new_text
        offset = self.offsets.get(index, len(text) - len(completion.new_text))
        self.offsets[index] = offset + len(completion.new_text)
        return {"index": index, "text": text, "finish_reason": completion.finish_reason,
                "logprobs": self._logprobs(completion, len(completion.new_token_ids), offset)}

    def _logprobs(self, completion: CompletionOutput, last: int, offset: int) -> dict | None:
        """OpenAI's legacy format for the completion's ``last`` tokens."""
        if completion.logprobs is None:
            return None
        start = len(completion.token_ids) - last
        tokens = [self.token_text(t) for t in completion.token_ids[start:]]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": completion.logprobs[start:], "text_offset": offsets,
                "top_logprobs": [{self.token_text(t): lp for t, lp in top.items()} for top in completion.top_logprobs[start:]]}


class _ChatFormat(_ResponseFormat):
    """With ``tools`` (a tool_choice other than "none"), calls are parsed out of each choice's text: as a
    whole, or as the text streams (each call is sent in one delta once its end tag has arrived)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, server: _Server, tools: list[ToolSpec] | None, thinking: bool | None = None):
        super().__init__(server)
        self.tools = tools
        self.parsers: dict[int, ToolCallParser] = {}
        self.thinking = thinking  # None: no reasoning split; else whether the prompt opened a think block
        self.reasoners: dict[int, ReasoningParser] = {}

    def choice(self, index: int, completion: CompletionOutput, prompt_index: int) -> dict:
        text = completion.text
        message = {"role": "assistant"}
        if self.thinking is not None:  # an output that is all reasoning has no content (None)
            message["reasoning_content"], text = split_reasoning(text, self.thinking)
        message["content"] = text
        finish_reason = completion.finish_reason
        if self.tools is not None:
            message["content"], calls = parse_tool_calls(text or "", self.tools)
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": index, "message": message, "finish_reason": finish_reason,
                "logprobs": self._logprobs(completion, len(completion.token_ids))}

    def delta(self, index: int, completion: CompletionOutput, prompt_index: int, first: bool) -> dict | None:
        """The choice's chunk; None when there is nothing to send yet (text the tool-call parser holds back)."""
        delta = {"role": "assistant"} if first else {}
        finish_reason = completion.finish_reason
        text = completion.new_text
        if self.thinking is not None:
            reasoner = self.reasoners.setdefault(index, ReasoningParser(self.thinking))
            pieces = reasoner.feed(text) + (reasoner.finish() if finish_reason is not None else [])
            text = "".join(piece for kind, piece in pieces if kind == CONTENT)
            reasoning = "".join(piece for kind, piece in pieces if kind == REASONING)
            if reasoning:
                delta["reasoning_content"] = reasoning
        calls = []
        if self.tools is None:
            delta["content"] = text
        else:
            parser = self.parsers.setdefault(index, ToolCallParser(self.tools))
            calls_before = parser.num_calls
            events = parser.feed(text) + (parser.finish() if finish_reason is not None else [])
            delta["content"] = "".join(e for e in events if isinstance(e, str))
            calls = [e for e in events if not isinstance(e, str)]  # ToolCalls, and at the end perhaps a CutOffToolCall
            if calls:
                delta["tool_calls"] = [{"index": calls_before + i, **c.to_openai()} for i, c in enumerate(calls)]
            if parser.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if (self.tools is not None or self.thinking is not None) and not (
                first or delta["content"] or calls or "reasoning_content" in delta or finish_reason is not None):
            return None
        return {"index": index, "delta": delta, "finish_reason": finish_reason,
                "logprobs": self._logprobs(completion, len(completion.new_token_ids))}

    def _logprobs(self, completion: CompletionOutput, last: int) -> dict | None:
        if completion.logprobs is None:
            return None
        start = len(completion.token_ids) - last

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top.items()]}
                   for t, lp, top in zip(completion.token_ids[start:], completion.logprobs[start:], completion.top_logprobs[start:])]
        return {"content": content}


class _LegacyFunctionFormat(_ChatFormat):
    """Chat for a request made with the deprecated ``functions``: OpenAI answers it with the call in
    ``function_call`` and the finish reason ``function_call`` (``protocol.legacy_function_call``)."""

    def choice(self, index: int, completion: CompletionOutput, prompt_index: int) -> dict:
        return legacy_function_call(super().choice(index, completion, prompt_index))

    def delta(self, index: int, completion: CompletionOutput, prompt_index: int, first: bool) -> dict | None:
        delta = super().delta(index, completion, prompt_index, first)
        return delta if delta is None else legacy_function_call(delta)
