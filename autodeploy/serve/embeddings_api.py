"""The embedding and scoring routes, over one ``AsyncEmbedder`` (``frontend/async_embed.py``), which merges concurrent
requests into shared forwards:

- ``POST /v1/embeddings`` (OpenAI's): ``{model, input: str | [str] | [int] | [[int]], encoding_format: "float" |
  "base64", dimensions, user}`` → ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
  "model", "usage": {"prompt_tokens", "total_tokens"}}``. ``base64`` is each vector's little-endian float32 bytes,
  as OpenAI sends them (the official client asks for it and decodes it); ``dimensions`` keeps the first D' components
  (Matryoshka) before the L2 normalization; ``user`` is bookkeeping, accepted and ignored.
- ``POST /v1/rerank``, ``/rerank`` and ``/v2/rerank`` (Cohere's and Jina's clients, as vLLM serves them):
  ``{model, query, documents: [str] | [{"text"}], top_n, return_documents}`` → ``{"id", "model", "usage":
  {"total_tokens"}, "results": [{"index", "relevance_score", "document": {"text"}}]}``, highest score first, cut to
  ``top_n`` (None or 0: all); ``document`` only with ``return_documents`` (the default).
- ``POST /v1/score`` and ``/score`` (vLLM's): ``{model, text_1: str | [str], text_2: str | [str]}``, ``text_1``
  paired with every ``text_2`` (1:1, 1:N) or item by item (N:N) → ``{"id", "object": "list", "created", "model",
  "data": [{"index", "object": "score", "score"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens"}}``.

Which of them answer is the model's ``llm.tasks``: a route of a task the model lacks — these, or the generation routes
on a model that does not generate — answers a 400 saying what the model does serve, so a client pointed at the wrong
deployment learns why. ``model`` may be left out of rerank and score bodies, as vLLM allows.

Requests wait for the embedder as the generation routes wait for a seat (``admission.py``): at most
``max_queued_requests`` at once; the next waits up to ``queue_timeout_s``, first come first served, then gets the 503
with ``Retry-After``. ``Admission`` itself counts the engine's seats and requests, which an embedder has not.

    service = EmbeddingService(llm, options)      # in build_app; its lifespan calls service.start() / service.stop()
    add_embedding_routes(app, server, service)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from autodeploy.errors import InvalidRequestError
from autodeploy.frontend.async_embed import AsyncEmbedder, EmbedderShutDown
from autodeploy.frontend.llm import LLM
from autodeploy.serve.openai_errors import APIError
from autodeploy.serve.protocol import StrictModel


@dataclass(frozen=True)
class _Task:
    routes: tuple[str, ...]  # every route that serves it
    served: str  # how a refusal names it among what the model serves
    lacking: str  # … and what the model does not do


_TASKS = {
    "generate": _Task(("/v1/completions", "/v1/chat/completions", "/v1/responses"),
                      "text generation (/v1/completions, /v1/chat/completions)", "generate text"),
    "embed": _Task(("/v1/embeddings",), "embeddings (/v1/embeddings)", "embed text"),
    "score": _Task(("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"),
                   "relevance scores (/v1/rerank, /v1/score)", "score (rerank) texts against a query"),
}
TASK_OF_ROUTE = {route: name for name, task in _TASKS.items() for route in task.routes}


def unserved_task(tasks: frozenset[str], task: str) -> str:
    """Why a model with ``tasks`` does not answer a route of ``task``: what it serves and what it does not do."""
    served = " and ".join(spec.served for name, spec in _TASKS.items() if name in tasks) or "nothing"
    return f"this model serves {served}; it does not {_TASKS[task].lacking}"


class EmbeddingServer(Protocol):
    """What the routes read of app.py's server."""

    llm: LLM

    async def check_api_key(self, request: Request) -> None:
        """Raise the 401 ``APIError`` unless the request carries the server's key (when it has one)."""

    def check_model(self, model: str) -> None:
        """Raise the 400 ``APIError`` unless ``model`` is the served model's id."""


class EmbeddingOptions(Protocol):
    """The ``ServerOptions`` fields the routes read."""

    served_model_name: str
    max_queued_requests: int
    queue_timeout_s: float
    retry_after_s: int


class EmbeddingService:
    """The ``AsyncEmbedder`` behind the routes, started and stopped by the app's lifespan (none for a model that
    neither embeds nor scores), and the count of requests let through to it."""

    def __init__(self, llm: LLM, options: EmbeddingOptions):
        self.llm = llm
        self.options = options
        self.embedder: AsyncEmbedder | None = None
        self._room: asyncio.Semaphore | None = None  # made in the server's loop (start)

    def start(self) -> None:
        if self.llm.tasks & {"embed", "score"}:
            self.embedder = AsyncEmbedder(self.llm)
            self._room = asyncio.Semaphore(self.options.max_queued_requests)

    def stop(self) -> None:
        """Stop the embedder once its running call ends; requests still queued answer 503 ``aborted`` (``place``)."""
        if self.embedder is not None:
            self.embedder.shutdown()

    @contextlib.asynccontextmanager
    async def place(self) -> AsyncIterator[AsyncEmbedder]:
        """The embedder, once fewer than ``max_queued_requests`` requests use it; the 503 after ``queue_timeout_s``."""
        if self._room.locked():  # full, or others wait before this one: wait in line
            try:
                await asyncio.wait_for(self._room.acquire(), self.options.queue_timeout_s)
            except TimeoutError:
                raise APIError(503, f"the server is busy: {self.options.max_queued_requests} requests are waiting for the "
                                    f"embedder (--max-queued-requests) and none left in {self.options.queue_timeout_s:g} s "
                                    "(--queue-timeout); retry later", code="queue_full",
                               headers={"Retry-After": str(self.options.retry_after_s)}) from None
        else:
            await self._room.acquire()
        try:
            yield self.embedder
        except EmbedderShutDown:
            raise APIError(503, "the request was aborted: the server is shutting down", code="aborted") from None
        finally:
            self._room.release()


class EmbeddingRequest(StrictModel):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # bookkeeping

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: text, or token ids; an empty one is the 400."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise APIError(400, "input is empty; give a string, a list of strings, token ids or a list of them", param="input")
        for index, item in enumerate(given):
            if len(item) == 0:
                raise APIError(400, f"input{f' {index}' if len(given) > 1 else ''} is empty: there is nothing to embed",
                               param="input")
        return list(given)


class RerankDocument(StrictModel):
    text: str


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: list[str] | list[RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document, as vLLM reads 0
    return_documents: bool = True

    def texts(self) -> list[str]:
        if not self.documents:
            raise APIError(400, "documents is empty; give at least one document to rank", param="documents")
        return [document if isinstance(document, str) else document.text for document in self.documents]


class ScoreRequest(StrictModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) pairs as vLLM makes them: one ``text_1`` with every ``text_2``, or the i-th with the i-th."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        for name, texts in (("text_1", first), ("text_2", second)):
            if not texts:
                raise APIError(400, f"{name} is empty; give a text or a list of texts", param=name)
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: pair one text_1 with any number "
                                "(1:N) or as many as text_2 has, item by item (N:N)", param="text_2")
        return list(zip(first, second))


def add_embedding_routes(app: FastAPI, server: EmbeddingServer, service: EmbeddingService) -> None:
    """Register the routes of the tasks the model serves of embed and score, and the 400 on every route of a task it
    lacks (generation's too, on a model that does not generate)."""
    authorized = [Depends(server.check_api_key)]
    tasks = server.llm.tasks
    model_name = service.options.served_model_name

    for name, task in _TASKS.items():
        if name not in tasks:
            _add_refusals(app, tasks, name, task.routes, authorized)

    async def embeddings(body: EmbeddingRequest) -> Response:
        server.check_model(body.model)
        inputs = body.inputs()
        async with service.place() as embedder:
            answer = await embedder.embed(inputs, dimensions=body.dimensions)
        # a thousand vectors are megabytes of JSON: encoded off the event loop
        return Response(await asyncio.to_thread(_embeddings_body, answer, body.encoding_format, model_name),
                        media_type="application/json")

    async def rerank(body: RerankRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        texts = body.texts()
        async with service.place() as embedder:
            answer = await embedder.score(body.query, texts)
        ranked = sorted(range(len(texts)), key=answer.scores.__getitem__, reverse=True)[: body.top_n or None]
        results = [{"index": index, "relevance_score": answer.scores[index],
                    **({"document": {"text": texts[index]}} if body.return_documents else {})} for index in ranked]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model_name, "usage": {"total_tokens": sum(answer.num_tokens)},
                "results": results}

    async def score(body: ScoreRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        pairs = body.pairs()
        by_query: dict[str, list[int]] = {}  # one call a distinct text_1 (LLM.score takes one query)
        for index, (query, _) in enumerate(pairs):
            by_query.setdefault(query, []).append(index)
        async with service.place() as embedder:
            answers = await asyncio.gather(*(embedder.score(query, [pairs[i][1] for i in indices])
                                             for query, indices in by_query.items()), return_exceptions=True)
            for answer in answers:
                if isinstance(answer, InvalidRequestError) and getattr(answer, "param", None) == "documents":
                    answer.param = "text_2"  # what this body calls the documents
                if isinstance(answer, BaseException):
                    raise answer
        scores, tokens = [0.0] * len(pairs), 0
        for indices, answer in zip(by_query.values(), answers):
            for index, value in zip(indices, answer.scores):
                scores[index] = value
            tokens += sum(answer.num_tokens)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model_name,
                "data": [{"index": index, "object": "score", "score": value} for index, value in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    if "embed" in tasks:
        app.post("/v1/embeddings", dependencies=authorized)(embeddings)
    if "score" in tasks:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.post(path, dependencies=authorized)(rerank)
        for path in ("/v1/score", "/score"):
            app.post(path, dependencies=authorized)(score)


def _add_refusals(app: FastAPI, tasks: frozenset[str], task: str, paths: tuple[str, ...], authorized: list) -> None:
    message = unserved_task(tasks, task)

    async def refuse() -> None:
        raise APIError(400, message, code="unsupported_task")

    for path in paths:
        app.post(path, dependencies=authorized, include_in_schema=False)(refuse)


def _embeddings_body(answer, encoding_format: str, model: str) -> bytes:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
        rows = [base64.b64encode(row.numpy().astype("<f4", copy=False).tobytes()).decode("ascii") for row in answer.vectors]
    else:
        rows = answer.vectors.tolist()
    tokens = sum(answer.num_tokens)
    return json.dumps({"object": "list", "data": [{"object": "embedding", "index": index, "embedding": row}
                                                  for index, row in enumerate(rows)],
                       "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}).encode()
