"""``AsyncEmbedder``: ``LLM.embed`` and ``LLM.score`` behind an asyncio interface, for servers.

Those calls are synchronous, not thread-safe, and much faster on many inputs at once (the inputs are packed into
one forward), so one worker thread owns them and merges what concurrent requests queued:

- every embed request queued with the same ``pooling``, ``normalize`` and ``dimensions`` shares one ``llm.embed``
  call over the union of their inputs. Those are passed through rather than applied here to raw vectors, because
  ``normalize=None`` means the model's own choice, which only the LLM knows; clients of one deployment mostly send the
  same three (none), so they still merge;
- every score request queued with the same query shares one ``llm.score`` call over their documents (the call
  takes one query, so requests with different queries take a call each);
- a call takes about ``settings.scheduler.max_num_tokens`` input tokens (estimated from the text's length, as
  tokenizing twice would cost as much as the forward saves), so a request of ten thousand inputs runs a call at a
  time, and a request that came after it goes in the next call rather than after all of it: a request whose
  inputs did not all fit goes to the back of the queue with the rest;
- a merged call that raises ``InvalidRequestError`` runs again one request at a time, so only the request at
  fault fails.

``shutdown()`` fails every request still queued with ``EmbedderShutDown`` at once, lets the call running finish,
and stops the thread; an awaiting coroutine never hangs. A cancelled coroutine's request leaves the queue.

    async def main():
        embedder = AsyncEmbedder(llm)
        vectors = (await embedder.embed(["a query", "a document"], dimensions=256)).vectors  # [2, 256]
        relevance = (await embedder.score("a query", ["doc one", "doc two"])).scores
        embedder.shutdown()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from autodeploy.errors import AutoDeployError, InvalidRequestError

if TYPE_CHECKING:
    from autodeploy.frontend.llm import LLM, Embeddings, Scores

logger = logging.getLogger(__name__)

# Text is budgeted at about four UTF-8 bytes a token (English under BPE and WordPiece); text that tokenizes
# denser makes a call larger than its budget, which the LLM splits further itself.
_BYTES_PER_TOKEN = 4
_SPECIAL_TOKENS = 2  # [CLS] … [SEP], <s> … </s>


class EmbedderShutDown(AutoDeployError):
    """An embed or score request was still queued when its ``AsyncEmbedder`` shut down, or came after."""


def _with_param(error: InvalidRequestError, param: str) -> InvalidRequestError:
    error.param = param  # the request field it is about, for the server's 400 (serve/openai_errors.py)
    return error


@dataclass(eq=False)
class _Job:
    """One request: its inputs (texts or token ids; a score request's documents) and the answers of the calls that
    took them so far."""

    key: tuple  # ("embed", pooling, normalize, dimensions) or ("score", query): requests with the same key share a call
    inputs: list
    estimates: list[int]  # tokens of each input, estimated
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    done: int = 0  # inputs answered
    parts: list = field(default_factory=list)  # Embeddings or Scores of inputs[: done], a slice per call
    cancelled: bool = False  # its coroutine stopped waiting

    @property
    def kind(self) -> str:
        return self.key[0]

    def resolve(self, answer) -> None:
        self._send(self.future.set_result, answer)

    def fail(self, error: BaseException) -> None:
        self._send(self.future.set_exception, error)

    def _send(self, setter, value) -> None:
        def settle() -> None:
            if not self.future.done():  # cancelled meanwhile
                setter(value)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass


class AsyncEmbedder:
    """The one caller of ``llm.embed`` and ``llm.score`` (module docstring); any number of coroutines await it."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.max_tokens_per_call = int(llm.settings.scheduler.max_num_tokens)
        self._queue: deque[_Job] = deque()
        self._changed = threading.Condition()  # guards the queue and _stopped
        self._stopped = False
        self._worker = threading.Thread(target=self._run, name="autodeploy-embedder", daemon=True)
        self._worker.start()

    async def embed(self, inputs: str | Sequence[str | Sequence[int]], *, pooling: str | None = None,
                    normalize: bool | None = None, dimensions: int | None = None) -> Embeddings:
        """``llm.embed(inputs, pooling=…, normalize=…, dimensions=…)`` (None: the model's own pooling and normalization,
        every dimension), in a call shared with other requests. One text or token id list is one input, as there."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        inputs = list(inputs)
        if not inputs:
            raise _with_param(InvalidRequestError("no input to embed; give a string, a list of strings or token ids"), "input")
        estimates = [self._estimated_tokens(item) for item in inputs]
        return await self._submit(("embed", pooling, normalize, dimensions), inputs, estimates)

    async def score(self, query: str, documents: Sequence[str]) -> Scores:
        """``llm.score(query, documents)``, in a call shared with other requests for the same query."""
        documents = list(documents)
        if not documents:
            raise _with_param(InvalidRequestError("no documents to score; give at least one"), "documents")
        query_tokens = self._estimated_tokens(query)
        estimates = [query_tokens + self._estimated_tokens(document) for document in documents]
        return await self._submit(("score", query), documents, estimates)

    def shutdown(self) -> None:
        """Fail the requests still queued (``EmbedderShutDown``), let the call running finish and stop the worker;
        later ``embed`` / ``score`` calls raise ``EmbedderShutDown``."""
        with self._changed:
            self._stopped = True
            self._fail_queued()
            self._changed.notify()
        self._worker.join()

    async def _submit(self, key: tuple, inputs: list, estimates: list[int]):
        loop = asyncio.get_running_loop()
        job = _Job(key, inputs, estimates, loop, loop.create_future())
        with self._changed:
            if self._stopped:
                raise EmbedderShutDown("this AsyncEmbedder was shut down; create a new AsyncEmbedder(llm) to submit requests")
            self._queue.append(job)
            self._changed.notify()
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancelled = True  # the worker drops it from the queue, or its answer
            raise

    def _estimated_tokens(self, item: str | Sequence[int]) -> int:
        count = len(item.encode()) // _BYTES_PER_TOKEN + _SPECIAL_TOKENS if isinstance(item, str) else len(item)
        return max(1, min(count, self.llm.max_seq_len))

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._stopped and not self._queue:
                    self._changed.wait()
                if self._stopped:
                    return
                taken = self._next_call()
            if taken:
                self._answer(taken)
            with self._changed:  # requests with inputs left go to the back of the queue
                self._queue.extend(job for job, _, _ in taken if job.done < len(job.inputs) and not job.cancelled)
                if self._stopped:
                    self._fail_queued()

    def _next_call(self) -> list[tuple[_Job, int, int]]:
        """``(job, start, stop)`` slices of the next call's inputs: the first request's, then those of the requests
        after it with the same key, in queue order, until the call's token budget is spent (one input at least)."""
        for job in [job for job in self._queue if job.cancelled]:
            self._queue.remove(job)
        if not self._queue:
            return []
        key = self._queue[0].key
        taken, spent = [], 0
        for job in [job for job in self._queue if job.key == key]:
            stop = job.done
            while stop < len(job.inputs) and (spent == 0 or spent + job.estimates[stop] <= self.max_tokens_per_call):
                spent += job.estimates[stop]
                stop += 1
            if stop > job.done:
                taken.append((job, job.done, stop))
                self._queue.remove(job)
            if stop < len(job.inputs):
                break
        return taken

    def _answer(self, taken: list[tuple[_Job, int, int]]) -> None:
        """One call over the slices' inputs; each job gets its rows. A refusal of the merged call runs each job alone."""
        kind, *what = taken[0][0].key
        inputs = [item for job, start, stop in taken for item in job.inputs[start:stop]]
        try:
            if kind == "embed":
                pooling, normalize, dimensions = what
                answer = self.llm.embed(inputs, pooling=pooling, normalize=normalize, dimensions=dimensions)
            else:
                answer = self.llm.score(what[0], inputs)
        except InvalidRequestError as error:
            if len(taken) > 1:
                for one in taken:
                    self._answer([one])
                return
            job, start, stop = taken[0]
            param = getattr(error, "param", None) or _param_of(kind, error)
            if (start, stop) != (0, len(job.inputs)):  # the LLM numbered this call's inputs, not the request's
                error = InvalidRequestError(f"inputs {start} … {stop - 1} of this request: {error}")
            job.fail(_with_param(error, param))
            job.done = len(job.inputs)
            return
        except Exception as error:  # a failed forward: the requests in it fail, the worker serves the rest
            logger.exception("%s call over %d inputs failed", kind, len(inputs))
            for job, _, _ in taken:
                job.fail(error)
                job.done = len(job.inputs)
            return
        row = 0
        for job, start, stop in taken:
            job.parts.append(_rows(answer, kind, row, row + stop - start))
            row += stop - start
            job.done = stop
            if job.done == len(job.inputs):
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        num_tokens = [n for part in job.parts for n in part.num_tokens]
        if job.kind == "score":
            rows = {"scores": [score for part in job.parts for score in part.scores]}
        else:
            rows = {"vectors": torch.cat([part.vectors for part in job.parts])}
        job.resolve(dataclasses.replace(job.parts[0], num_tokens=num_tokens, **rows))

    def _fail_queued(self) -> None:
        while self._queue:
            self._queue.popleft().fail(EmbedderShutDown("the request was still queued when the embedder shut down "
                                                        "(the server is stopping); send it again"))


def _param_of(kind: str, error: InvalidRequestError) -> str:
    """The request field an LLM's refusal is about: its message starts with the field's name when it is a parameter."""
    if kind == "embed":
        return "dimensions" if str(error).startswith("dimensions") else "input"
    return "documents"


def _rows(answer: Embeddings | Scores, kind: str, start: int, stop: int) -> Embeddings | Scores:
    """The answer for inputs ``start`` … ``stop - 1`` of a call."""
    if kind == "embed":
        return dataclasses.replace(answer, vectors=answer.vectors[start:stop], num_tokens=answer.num_tokens[start:stop])
    return dataclasses.replace(answer, scores=answer.scores[start:stop], num_tokens=answer.num_tokens[start:stop])
