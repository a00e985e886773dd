"""``Admission``: how many requests the server lets wait for a seat in the batch, and what happens to the rest.

A request is *queued* from its admission until a step schedules it; the queue is full while
``max_queued_requests`` queued requests find no free seat (``max_batch_size`` less the sequences running). A
request that finds the queue full waits in a lobby, first come first served, until a request leaves the queue
or ``queue_timeout_s`` passes; only then is it refused, with a 503 and ``Retry-After``.

Why a lobby rather than refusing at once: the server's event loop and its engine share one interpreter lock.
Clients that retry a refusal at once (many do) turn every refusal into another request to parse and refuse:
at 512 such clients the loop refused 884 requests a second and the engine, starved of the lock, produced a
fifth of its output (notes/serving.md). A waiting request costs nothing until there is room for it.
``queue_timeout_s=0`` refuses at once, as a fixed-size queue does.

A request that gets in holds a promised place (a ``Place``) while its prompt is tokenized, so the next in
the lobby is called only for a place nobody was promised. Everything here runs on the event loop's thread, so
the counts and the lobby need no lock.

    async with admission.place(deadline) as place:   # waits in the lobby, or raises the 503
        requests = make_requests(...)                  # 400s here give the place back
        admission.enter(requests, place)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator

from autodeploy.runtime.request import Request
from autodeploy.serve.openai_errors import APIError


class Place:
    """A place in the queue promised to one HTTP request, until its engine requests enter or it gives up."""

    held = True


class Admission:
    def __init__(self, scheduler, max_queued_requests: int, queue_timeout_s: float, retry_after_s: int, on_refusal):
        self.scheduler = scheduler  # its running list and seats: read only
        self.max_queued_requests = max_queued_requests
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.on_refusal = on_refusal
        self._queued: dict[Request, None] = {}  # in the order admitted, which is about the order scheduled
        self._pruned_at = 0.0
        self._promised = 0  # places held by requests still tokenizing
        self._lobby: collections.deque[asyncio.Future] = collections.deque()
        self._watch: asyncio.Task | None = None

    def num_waiting(self) -> int:
        """Queued requests that no step has scheduled yet and places promised to requests still tokenizing, less the
        seats free for them (a promised place takes a free seat first, as its requests will). Cheap, as it is asked
        at every admission: those scheduled leave from the front; the rest is swept ten times a second at most."""
        while self._queued and _left_queue(next(iter(self._queued))):
            del self._queued[next(iter(self._queued))]
        free_seats = self.scheduler.max_num_seqs - len(self.scheduler.running)
        now = time.monotonic()
        if len(self._queued) + self._promised - free_seats >= self.max_queued_requests and now - self._pruned_at > 0.1:
            self._queued = {r: None for r in self._queued if not _left_queue(r)}  # priorities schedule out of order
            self._pruned_at = now
        return max(0, len(self._queued) + self._promised - free_seats)

    @property
    def lobby_size(self) -> int:
        return len(self._lobby)

    @contextlib.asynccontextmanager
    async def place(self, deadline: float) -> AsyncIterator[Place]:
        """A place in the queue, once there is one and those who came first have theirs; the 503 at ``deadline``
        (a ``loop.time()``). A place not used by ``enter`` is given back on exit."""
        await self._wait_for_room(deadline)
        place = Place()
        try:
            yield place
        finally:
            if place.held:
                self._give_back(place)

    def enter(self, requests: list[Request], place: Place) -> None:
        """Queue ``requests`` (made and validated) in their promised place."""
        self._queued.update(dict.fromkeys(requests))
        self._give_back(place)

    def leave(self, requests: list[Request]) -> None:
        """``requests`` are answered (or their client left): the next in the lobby is called for each place that frees."""
        for request in requests:
            self._queued.pop(request, None)
        self._call_next()

    def _room(self) -> int:
        return self.max_queued_requests - self.num_waiting()

    async def _wait_for_room(self, deadline: float) -> None:
        if not self._lobby and self._room() > 0:
            self._promised += 1
            return
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._lobby.append(turn)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._watch_lobby())
        try:
            await asyncio.wait_for(turn, max(0.0, deadline - loop.time()))  # _call_next promised it a place
        except asyncio.TimeoutError:
            self._refuse()
        except BaseException:  # the handler was cancelled; a place it had been called for goes to the next
            if turn.done() and not turn.cancelled():
                self._promised -= 1
                self._call_next()
            raise
        finally:
            if turn in self._lobby:
                self._lobby.remove(turn)

    def _give_back(self, place: Place) -> None:
        place.held = False
        self._promised -= 1
        self._call_next()

    def _call_next(self) -> None:
        """Call those first in the lobby while there is room nobody was promised."""
        room = self._room()
        while self._lobby and room > 0:
            turn = self._lobby.popleft()
            if not turn.done():
                turn.set_result(None)
                self._promised += 1
                room -= 1

    async def _watch_lobby(self) -> None:
        """While anyone waits, look for room once a second: a seat that frees without an answer here (another
        front end's request ending) calls nobody."""
        while self._lobby:
            await asyncio.sleep(1.0)
            self._call_next()

    def _refuse(self) -> None:
        self.on_refusal()
        raise APIError(503, f"the server is busy: {self.num_waiting()} requests are waiting for a seat (--max-queued-requests "
                            f"{self.max_queued_requests}) and none left in {self.queue_timeout_s:g} s (--queue-timeout); "
                            "retry later", code="queue_full", headers={"Retry-After": str(self.retry_after_s)})


def _left_queue(request: Request) -> bool:
    return request.first_scheduled_time is not None or request.aborted or request.finish_time is not None
