"""``Admission`` on its own: places promised to requests still tokenizing take free seats first, then the queue."""

from __future__ import annotations

import asyncio
import contextlib
import types

import pytest

from autodeploy.serve.admission import Admission
from autodeploy.serve.openai_errors import APIError


def admission(seats: int, max_queued: int) -> tuple[Admission, list]:
    refusals = []
    scheduler = types.SimpleNamespace(max_num_seqs=seats, running=[])
    return Admission(scheduler, max_queued, queue_timeout_s=0, retry_after_s=1, on_refusal=lambda: refusals.append(1)), refusals


def test_requests_still_tokenizing_take_the_free_seats_before_the_queue():
    """4 seats and 1 queue place: 5 requests hold places at once while their prompts are tokenized; the 6th is
    refused. (Before the fix a promised place counted against the queue alone, so a request arriving while another
    was tokenizing was refused with 4 seats free: CI's flaky burst test.)"""
    gate, refusals = admission(seats=4, max_queued=1)

    async def burst():
        async with contextlib.AsyncExitStack() as held:
            for _ in range(5):
                await held.enter_async_context(gate.place(deadline=0.0))
            with pytest.raises(APIError) as refused:
                await held.enter_async_context(gate.place(deadline=0.0))
            return refused.value

    refused = asyncio.run(burst())
    assert refused.status == 503 and refusals == [1]
    assert "1 requests are waiting for a seat" in refused.message
    assert gate.num_waiting() == 0  # every place given back


def test_a_place_given_back_calls_the_next_in_the_lobby():
    gate, refusals = admission(seats=0, max_queued=1)
    gate.queue_timeout_s = 5

    async def two():
        order = []

        async def one(name, hold):
            async with gate.place(deadline=asyncio.get_running_loop().time() + 5):
                order.append(name)
                await asyncio.sleep(hold)

        await asyncio.gather(one("first", 0.05), one("second", 0))
        return order

    assert asyncio.run(two()) == ["first", "second"] and refusals == []
