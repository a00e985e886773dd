"""The engine's lock is not held while a forward computes: requests are added and aborted during a step,
an ``AsyncLLM``'s event loop stays responsive under load, and outputs stay what they were."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from autodeploy import AsyncLLM, SamplingParams, autodeploy
from tests.frontend.test_frontends import GREEDY, TIMEOUT, expected_tokens, in_thread, joined

FORWARD_S = 0.5


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return autodeploy(str(tiny_checkpoint("llama")), device="cpu")


class SlowGraph:
    """The engine's graph, made to take ``FORWARD_S`` per forward; ``started`` is set once one runs."""

    def __init__(self, graph):
        self.graph, self.started = graph, threading.Event()

    def __call__(self, *inputs):
        self.started.set()
        time.sleep(FORWARD_S)
        return self.graph(*inputs)


def test_submit_and_abort_do_not_wait_for_a_running_forward(llm, monkeypatch):
    engine = llm.engine
    slow = SlowGraph(engine.graph)
    monkeypatch.setattr(engine, "graph", slow)
    running = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=1, **GREEDY))
    victim = engine.add_request([9, 10, 11], SamplingParams(max_tokens=1, **GREEDY))
    thread, outcome = in_thread(engine.step)
    assert slow.started.wait(TIMEOUT)
    began = time.perf_counter()
    late = engine.add_request([12, 13], SamplingParams(max_tokens=1, **GREEDY))
    engine.abort(victim.request_id)
    waited = time.perf_counter() - began
    assert waited < FORWARD_S / 5, f"add_request + abort waited {waited:.3f} s behind a {FORWARD_S} s forward"
    assert victim.finished and victim.output(llm.tokenizer).finish_reason == "abort"
    assert not engine.pool.block_table(victim.sequences[0].seq_id)  # its blocks went back at once
    changed = joined(thread, outcome)
    assert running in changed and victim not in changed  # the aborted request got nothing from the step
    monkeypatch.setattr(engine, "graph", slow.graph)
    while engine.has_unfinished():
        engine.step()
    assert late.finished and len(late.output(llm.tokenizer).token_ids) == 1
    assert engine.pool.num_used_blocks == 0


def test_64_coroutines_complete_while_the_event_loop_stays_responsive(llm, monkeypatch):
    """The loop thread only tokenizes and queues; every step (the forwards) runs in the engine's own thread, so
    the loop keeps turning while the batch decodes. Checked by where steps run and by the loop's ticks landing
    between steps, not by how late they are (that depends on the machine)."""
    prompts = [[3 + i, 4 + i, 5 + (i * 7) % 50] for i in range(64)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = expected_tokens(llm, prompts, params)
    events: list[str] = []  # "step" and "tick", in the order they happened
    step_threads: set[int] = set()
    step = llm.engine.step

    def recorded_step():
        step_threads.add(threading.get_ident())
        finished = step()
        events.append("step")
        return finished

    monkeypatch.setattr(llm.engine, "step", recorded_step)

    async def main():
        async_llm = AsyncLLM(llm)
        done = asyncio.Event()

        async def timer():
            while not done.is_set():
                await asyncio.sleep(0.001)
                events.append("tick")

        ticking = asyncio.create_task(timer())
        outputs = await asyncio.gather(*(async_llm.generate(p, params) for p in prompts))
        done.set()
        await ticking
        async_llm.shutdown()
        return outputs, threading.get_ident()

    outputs, loop_thread = asyncio.run(asyncio.wait_for(main(), timeout=TIMEOUT))
    assert [o.token_ids for o in outputs] == expected
    assert step_threads and loop_thread not in step_threads
    first, last = events.index("step"), len(events) - 1 - events[::-1].index("step")
    assert "tick" in events[first:last]  # the loop turned while steps were running
