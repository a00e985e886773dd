"""``AsyncLLM``: the engine behind an asyncio interface, for servers.

One worker thread steps the engine while any request is in flight; each request's outputs reach its
coroutine through an ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``. The event loop never
blocks on a forward, and requests from any number of coroutines share the same batches.

    async def main():
        async_llm = AsyncLLM(autodeploy())
        async for chunk in async_llm.stream("def add(a, b):", SamplingParams(max_tokens=16)):
            print(chunk.outputs[0].new_text, end="")
        print((await async_llm.generate("import os", SamplingParams(max_tokens=8))).text)
        async_llm.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from autodeploy.runtime.engine import Prompt
from autodeploy.runtime.llm import LLM
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = llm.engine
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="autodeploy-engine", daemon=True)
        self._worker.start()

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's output whenever it gets new tokens; cancelling the consumer aborts it."""
        if self._stopped:
            raise RuntimeError("this AsyncLLM was shut down; create a new one")
        request = self.engine.make_request(prompt, params, priority=priority)  # bad input raises here
        queue: asyncio.Queue = asyncio.Queue()
        self._listeners[request.request_id] = (asyncio.get_running_loop(), queue)
        self.engine.submit(request)
        self._wake.set()
        try:
            while True:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            self._listeners.pop(request.request_id, None)
            if not request.finished:
                self.engine.abort(request.request_id)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0) -> RequestOutput:
        """The finished output of one request."""
        final = None
        async for output in self.stream(prompt, params, priority):
            final = output
        return final

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def shutdown(self) -> None:
        """Stop the worker; requests still running are aborted."""
        self._stopped = True
        self._wake.set()
        self._worker.join()
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)

    def _run(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step_outputs(streaming=True)
            except BaseException as error:  # a failed forward must reach the waiting coroutines, not vanish
                logger.exception("engine step failed")
                self._fail_all(error)
                continue
            for output in outputs:
                listener = self._listeners.get(output.request_id)
                if listener is not None:
                    loop, queue = listener
                    loop.call_soon_threadsafe(queue.put_nowait, output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, (loop, queue) in list(self._listeners.items()):
            self.engine.abort(request_id)
            loop.call_soon_threadsafe(queue.put_nowait, error)
