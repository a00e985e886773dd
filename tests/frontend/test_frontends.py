"""Front ends sharing one engine: sync streams, generate calls and AsyncLLMs, from any threads, each get
all of their outputs (the final chunk included) whoever steps; abort, shutdown and a failed forward end
awaiting calls promptly. Every test runs under a timeout, so a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable

import pytest

from autodeploy import AsyncLLM, SamplingParams, autodeploy
from autodeploy.errors import InvalidRequestError

GREEDY = dict(temperature=0, ignore_eos=True)
TIMEOUT = 120  # seconds; generous for a loaded 2-core runner, and still a failure rather than a hang
PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20, 21, 22]]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    """A tiny Llama of this module's own, so a failing test cannot leave requests in the shared one."""
    return autodeploy(str(tiny_checkpoint("llama")), device="cpu")


def run_async(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=TIMEOUT))


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """Start ``target`` in a thread; the dict gets its ``result`` or its ``error``."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = target()
        except BaseException as error:  # handed to the test thread, which re-raises or checks it
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def joined(thread: threading.Thread, outcome: dict):
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the call hung"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def within_timeout(target: Callable[[], object]):
    return joined(*in_thread(target))


def expected_tokens(llm, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def assert_idle(llm) -> None:
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_used_blocks == 0


# ---- AsyncLLM: abort and shutdown -------------------------------------------------------------------------


def test_abort_ends_an_awaiting_async_stream_with_the_abort_output(llm):
    async def main():
        async_llm = AsyncLLM(llm)
        try:
            stream = async_llm.stream([5] * 10, SamplingParams(max_tokens=400, **GREEDY))
            first = await stream.__anext__()
            asyncio.get_running_loop().call_later(0.05, async_llm.abort, first.request_id)
            return [first] + [chunk async for chunk in stream]  # awaits while the abort arrives
        finally:
            async_llm.shutdown()

    chunks = run_async(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"
    assert len(chunks[-1].token_ids) < 400 and not any(c.finished for c in chunks[:-1])
    assert_idle(llm)


def test_shutdown_ends_every_in_flight_coroutine(llm):
    async def main():
        async_llm = AsyncLLM(llm)
        params = SamplingParams(max_tokens=400, **GREEDY)
        tasks = [asyncio.create_task(async_llm.generate([5 + i] * 8, params)) for i in range(5)]
        while sum(bool(r.token_times) for r in list(llm.engine.requests.values())) < 5:
            await asyncio.sleep(0.01)
        async_llm.shutdown()
        outputs = await asyncio.gather(*tasks)
        with pytest.raises(InvalidRequestError, match="shut down"):
            await async_llm.generate([5], params)
        return outputs

    outputs = run_async(main())
    assert len(outputs) == 5
    assert all(o.finished and o.finish_reason == "abort" and len(o.token_ids) < 400 for o in outputs)
    assert_idle(llm)


def test_abort_of_a_request_that_has_not_forked_its_samples_ends_it(tiny_checkpoint):
    """One seat: the n=3 request waits behind a long one, so it is aborted while still one sequence."""
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", max_batch_size=1)
    engine = llm.engine
    queued = engine.add_request([6] * 8, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=0))
    engine.abort(queued.request_id)
    assert queued.finished and [c.finish_reason for c in queued.output(llm.tokenizer).outputs] == ["abort"]

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            blocker = async_llm.stream([5] * 8, SamplingParams(max_tokens=400, **GREEDY))
            await blocker.__anext__()  # it holds the only seat now
            task = asyncio.create_task(async_llm.generate([6] * 8, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=0)))
            while len(engine.requests) < 2:
                await asyncio.sleep(0.01)
            waiting = next(r for r in list(engine.requests.values()) if r.params.n == 3)
            assert len(waiting.sequences) == 1
            async_llm.abort(waiting.request_id)
            output = await task
            await blocker.aclose()
            return output
        finally:
            async_llm.shutdown()

    output = run_async(main())
    assert output.finished and [c.finish_reason for c in output.outputs] == ["abort"]
    assert_idle(llm)


# ---- several front ends on one LLM ------------------------------------------------------------------------


def test_two_async_llms_on_one_llm_complete_every_request(llm):
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = expected_tokens(llm, PROMPTS, params)

    async def collect_stream(front, prompt):
        chunks = [chunk async for chunk in front.stream(prompt, params)]
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        return [t for c in chunks for t in c.outputs[0].new_token_ids]

    async def main():
        first, second = AsyncLLM(llm), AsyncLLM(llm)
        try:
            generated = asyncio.gather(first.generate(PROMPTS[0], params), second.generate(PROMPTS[1], params))
            streamed = asyncio.gather(collect_stream(first, PROMPTS[2]), collect_stream(second, PROMPTS[3]))
            outputs, streams = await asyncio.gather(generated, streamed)
            return [o.token_ids for o in outputs] + streams
        finally:
            first.shutdown()
            second.shutdown()

    assert run_async(main()) == expected
    assert_idle(llm)


def test_sync_generate_beside_async_requests_completes_both(llm):
    params = SamplingParams(max_tokens=16, **GREEDY)
    expected = expected_tokens(llm, PROMPTS, params)

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            tasks = [asyncio.create_task(async_llm.generate(p, params)) for p in PROMPTS[:2]]
            await asyncio.sleep(0)  # the async requests are in before the sync call starts
            thread, outcome = in_thread(lambda: llm.generate(PROMPTS[2:], params))
            outputs = await asyncio.gather(*tasks)
            while thread.is_alive():
                await asyncio.sleep(0.01)
            return [o.token_ids for o in outputs], joined(thread, outcome)
        finally:
            async_llm.shutdown()

    async_outputs, sync_outputs = run_async(main())
    assert async_outputs + [o.token_ids for o in sync_outputs] == expected
    assert all(o.finished and o.finish_reason == "length" for o in sync_outputs)
    assert_idle(llm)


def test_two_sync_streams_iterated_side_by_side_get_every_token(llm):
    params = SamplingParams(max_tokens=8, **GREEDY)
    expected = expected_tokens(llm, PROMPTS[:2], params)

    def side_by_side():
        chunks: tuple[list, list] = ([], [])
        for pair in itertools.zip_longest(llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)):
            for collected, chunk in zip(chunks, pair):
                if chunk is not None:
                    collected.append(chunk)
        return chunks

    for chunks, tokens in zip(within_timeout(side_by_side), expected):
        assert [t for c in chunks for t in c.outputs[0].new_token_ids] == tokens
        assert chunks[-1].finished and chunks[-1].token_ids == tokens and not any(c.finished for c in chunks[:-1])
    assert_idle(llm)


def test_a_stream_paused_while_generate_runs_still_gets_every_token(llm):
    params = SamplingParams(max_tokens=20, **GREEDY)
    (expected,) = expected_tokens(llm, PROMPTS[:1], params)

    def paused_stream():
        stream = llm.stream(PROMPTS[0], params)
        chunks = [next(stream)]
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=30, **GREEDY))  # finishes the stream's request too
        return chunks + list(stream)

    chunks = within_timeout(paused_stream)
    assert [t for c in chunks for t in c.outputs[0].new_token_ids] == expected
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert_idle(llm)


def test_sync_streams_in_threads_each_get_every_token(llm):
    params = SamplingParams(max_tokens=10, **GREEDY)
    expected = expected_tokens(llm, PROMPTS, params)
    started = [in_thread(lambda p=p: list(llm.stream(p, params))) for p in PROMPTS]
    for (thread, outcome), tokens in zip(started, expected):
        chunks = joined(thread, outcome)
        assert [t for c in chunks for t in c.outputs[0].new_token_ids] == tokens and chunks[-1].finished
    assert_idle(llm)


# ---- failures ---------------------------------------------------------------------------------------------


def test_a_failed_forward_reaches_every_waiting_front_end(llm, monkeypatch):
    engine = llm.engine
    working_graph = engine.graph
    forwards = itertools.count()

    def breaks_after_three_forwards(*inputs):
        if next(forwards) >= 3:
            raise RuntimeError("forward broke")
        return working_graph(*inputs)

    monkeypatch.setattr(engine, "graph", breaks_after_three_forwards)
    params = SamplingParams(max_tokens=50, **GREEDY)

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            task = asyncio.gather(async_llm.generate(PROMPTS[0], params), return_exceptions=True)
            thread, outcome = in_thread(lambda: llm.generate([PROMPTS[1]], params))
            (async_result,) = await task
            while thread.is_alive():
                await asyncio.sleep(0.01)
            thread.join()
            return async_result, outcome
        finally:
            async_llm.shutdown()

    async_result, sync_outcome = run_async(main())
    assert isinstance(async_result, RuntimeError) and "forward broke" in str(async_result)
    assert isinstance(sync_outcome.get("error"), RuntimeError) and "forward broke" in str(sync_outcome["error"])
    assert_idle(llm)
    monkeypatch.setattr(engine, "graph", working_graph)
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, **GREEDY))[0].finish_reason == "length"


def test_stream_outputs_waiting_for_a_busy_loop_are_merged():
    """Outputs put while the loop has not yet taken the last one reach the coroutine as one output with the
    new text and tokens of all of them (and the latest state), so a loop behind the engine wakes less often."""
    from autodeploy.frontend.async_llm import _AsyncSink

    async def main() -> list:
        queue: asyncio.Queue = asyncio.Queue()
        sink = _AsyncSink(asyncio.get_running_loop(), queue, streaming=True)
        sink.put(stream_output([4], [4]))
        sink.put(stream_output([4, 5], [5]))       # the loop has not run: merged into the first
        sink.put(stream_output([4, 5, 6], [6]))
        first = await queue.get()
        sink.put(stream_output([4, 5, 6, 7], [7], finished=True))
        return [first, await queue.get()]

    first, last = run_async(main())
    assert (first.outputs[0].new_token_ids, first.outputs[0].new_text, first.outputs[0].token_ids) == ([4, 5, 6], "456", [4, 5, 6])
    assert (last.outputs[0].new_token_ids, last.finished, last.outputs[0].finish_reason) == ([7], True, "length")


def test_a_sink_with_a_stream_interval_holds_outputs_back_until_n_new_tokens():
    from autodeploy.frontend.async_llm import _AsyncSink

    async def main() -> list[list[int]]:
        queue: asyncio.Queue = asyncio.Queue()
        sink, delivered = _AsyncSink(asyncio.get_running_loop(), queue, streaming=True, interval=3), []
        for token in range(1, 8):
            sink.put(stream_output(list(range(1, token + 1)), [token], finished=token == 7))
            await asyncio.sleep(0)  # the loop takes what was handed over
            while not queue.empty():
                delivered.append(queue.get_nowait().outputs[0].new_token_ids)
        return delivered

    assert run_async(main()) == [[1], [2, 3, 4], [5, 6, 7]]  # the first at once, then 3 a time; the last ends it


def stream_output(tokens: list[int], new: list[int], finished: bool = False):
    from autodeploy.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput

    completion = CompletionOutput(0, "".join(map(str, tokens)), tokens, "length" if finished else None,
                                  new_token_ids=new, new_text="".join(map(str, new)))
    return RequestOutput("r", None, [1], [completion], finished, RequestMetrics())


def test_stream_interval_sends_the_first_output_then_every_n_tokens(llm):
    """``stream_interval=3`` over 8 tokens: the first output at once, then one per 3 new tokens (more when the
    loop fell behind and outputs merged) and the last, whose new tokens and text add up to the whole completion."""
    async_llm = AsyncLLM(llm)

    async def main() -> list:
        return [output async for output in async_llm.stream(PROMPTS[0], SamplingParams(max_tokens=8, **GREEDY), stream_interval=3)]

    whole = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    try:
        outputs = run_async(main())
    finally:
        async_llm.shutdown()
    sizes = [len(o.outputs[0].new_token_ids) for o in outputs]
    assert all(size >= 3 for size in sizes[1:-1]) and len(outputs) <= 4 and outputs[-1].finished, sizes
    assert sum((o.outputs[0].new_token_ids for o in outputs), []) == whole.token_ids
    assert "".join(o.outputs[0].new_text for o in outputs) == whole.text
    for bad in (0, 1.5, True):
        with pytest.raises(InvalidRequestError, match="stream_interval must be a positive integer"):
            AsyncLLM.stream(None, PROMPTS[0], stream_interval=bad)
