"""``AsyncLLM``: the engine behind an asyncio interface, for servers.

A worker thread steps the engine while it has unfinished requests (its own or any other front end's);
each request's outputs reach its coroutine through an ``asyncio.Queue`` that the engine feeds, from
whichever thread ran the step, with ``loop.call_soon_threadsafe``. The event loop never blocks on a
forward, requests from any number of coroutines share the same batches, and any number of
``AsyncLLM``s and synchronous calls can share one ``LLM``.

    async def main():
        async_llm = AsyncLLM(autodeploy())
        async for chunk in async_llm.stream("def add(a, b):", SamplingParams(max_tokens=16)):
            print(chunk.outputs[0].new_text, end="")
        print((await async_llm.generate("import os", SamplingParams(max_tokens=8))).text)
        async_llm.shutdown()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Mapping

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.engine import Prompt
from autodeploy.frontend.llm import LLM
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.runtime.request import Request
from autodeploy.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = llm.engine
        self._in_flight: dict[str, Request] = {}  # this front end's requests, which shutdown aborts
        self._lock = threading.Lock()  # shutdown against new requests
        self._stopped = False
        self._wake = threading.Event()
        self._worker = threading.Thread(target=self._run, name="autodeploy-engine", daemon=True)
        self._worker.start()

    def stream(self, prompt: Prompt | Request, params: SamplingParams | None = None, priority: int = 0,
               stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        """Yield the request's output whenever it gets new tokens; the last one has ``finished=True``.
        Cancelling the consumer aborts the request; ``abort(request_id)`` ends it with an "abort" output.
        ``prompt`` may be a request already made (and so validated) by ``engine.make_request``.
        ``stream_interval`` N > 1: after the first output, one every N new tokens (of a completion) and
        the last, each carrying the new text and tokens since the one before: fewer wake-ups of the loop
        and fewer messages to send, at longer gaps between them."""
        check_stream_interval(stream_interval)
        return self._outputs(prompt, params, priority, streaming=True, stream_interval=stream_interval)

    async def generate(self, prompt: Prompt | Request, params: SamplingParams | None = None, priority: int = 0) -> RequestOutput:
        """The finished output of one request (``finish_reason`` "abort" if it was aborted)."""
        (final,) = [output async for output in self._outputs(prompt, params, priority, streaming=False)]
        return final

    def abort(self, request_id: str) -> None:
        """Cancel a request; its coroutine gets a final output with ``finish_reason`` "abort"."""
        self.engine.abort(request_id)

    def shutdown(self) -> None:
        """Abort this front end's requests still running (their coroutines end with "abort") and stop the
        worker; later ``stream`` / ``generate`` calls raise ``InvalidRequestError``."""
        with self._lock:
            self._stopped = True
            in_flight = list(self._in_flight)
        for request_id in in_flight:
            self.engine.abort(request_id)
        self._wake.set()
        self._worker.join()

    async def _outputs(self, prompt: Prompt | Request, params: SamplingParams | None, priority: int, streaming: bool,
                       stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        if isinstance(prompt, Request):
            request = prompt
        elif isinstance(prompt, Mapping):  # images: loaded (URLs fetched) and preprocessed off the event loop
            request = await asyncio.to_thread(self.engine.make_request, prompt, params, priority=priority)
        else:
            request = self.engine.make_request(prompt, params, priority=priority)  # bad input raises here
        queue: asyncio.Queue = asyncio.Queue()
        request.sink = _AsyncSink(asyncio.get_running_loop(), queue, streaming, stream_interval)
        with self._lock:
            if self._stopped:
                raise InvalidRequestError("this AsyncLLM was shut down; create a new AsyncLLM(llm) to submit requests")
            self.engine.submit(request)
            self._in_flight[request.request_id] = request
        self._wake.set()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._in_flight.pop(request.request_id, None)
            if not request.finished:
                self.engine.abort(request.request_id)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before the check, so a request submitted after it sets the event again
            if not self.engine.has_unfinished():
                self._wake.wait()
                continue
            try:
                self.engine.step_or_wait()
            except Exception:  # the engine handed the error to the failed batch's requests; keep serving the rest
                logger.exception("engine step failed")


def check_stream_interval(value) -> None:
    """``InvalidRequestError`` unless ``value`` is a stream interval: a positive integer (tokens an output)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"stream_interval must be a positive integer (tokens an output), got {value!r}")


class _AsyncSink:
    """Hands a request's outputs (or the error of a failed step) to its coroutine's queue, on its loop.

    A streaming output that arrives while the previous one still waits for the loop is merged into it
    (the new text and token ids of both): a loop that falls behind the engine wakes once for several
    steps, not once a step and request. With a stream interval N > 1, outputs after the first are also
    held back and merged until a completion has N new tokens, or the request finishes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, streaming: bool, interval: int = 1):
        self.streaming = streaming
        self.interval = interval
        self._loop = loop
        self._queue = queue
        self._lock = threading.Lock()
        self._waiting: RequestOutput | None = None  # a streaming output the loop has not taken yet
        self._handing_over = False  # a hand-over of _waiting is scheduled on the loop
        self._started = False  # the first output went out

    def put(self, output: RequestOutput) -> None:
        if not self.streaming:
            self._send(self._queue.put_nowait, output)
            return
        with self._lock:
            self._waiting = output if self._waiting is None else _merged_outputs(self._waiting, output)
            if self._handing_over or not (output.finished or self._due(self._waiting)):
                return
            self._handing_over = self._started = True
        self._send(self._hand_over)

    def _due(self, output: RequestOutput) -> bool:
        return self.interval == 1 or not self._started or max(len(c.new_token_ids) for c in output.outputs) >= self.interval

    def fail(self, error: BaseException) -> None:
        self._send(self._queue.put_nowait, error)

    def _hand_over(self) -> None:
        with self._lock:
            output, self._waiting, self._handing_over = self._waiting, None, False
        self._queue.put_nowait(output)

    def _send(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: no coroutine is left to read it
            pass


def _merged_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` (the request's state now) with each completion's new text and tokens since ``earlier``'s."""
    before = {c.index: c for c in earlier.outputs}
    completions = []
    for completion in later.outputs:
        previous = before.get(completion.index)
        if previous is not None:
            completion = dataclasses.replace(completion, new_text=previous.new_text + completion.new_text,
                                             new_token_ids=previous.new_token_ids + completion.new_token_ids)
        completions.append(completion)
    return dataclasses.replace(later, outputs=completions)
