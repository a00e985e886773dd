"""Rank 0's engine mirrored on the workers of a deployment over several ranks.

Every rank runs the same engine over its own slices and must plan the same steps, so that their
collectives pair up. Rank 0's engine queues the submits and aborts it is given (``RankMirror.queue``); at
the start of each step it sends them to the workers with the order to step, then applies them itself
(``send_step``), and each worker applies them in the same order (``Engine.apply_commands``), with rank 0's
request ids, seeds and arrival times. A failed collective is reported as the dead or stuck worker behind it.

    mirror = RankMirror(workers)
    mirror.queue("submit", request)
    for kind, payload in mirror.send_step():   # the workers got them first
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from autodeploy.runtime.request import Request

Command = tuple[str, "Request | str"]  # ("submit", request) or ("abort", request id)


class Peers(Protocol):
    """Rank 0's handle on the worker processes of a deployment over several ranks (``Workers`` in
    ``autodeploy/distributed.py``). Every rank runs this engine over its own slices; rank 0 tells the others
    what to run, in the order it runs it, so their collectives pair up."""

    def step(self, commands: list[tuple]) -> None:
        """Workers: apply ``commands`` (``Engine.apply_commands``), then ``Engine.step``."""

    def prompt_logits(self, token_ids: list[int]) -> None:
        """Workers: ``Engine.prompt_logits(token_ids)``."""

    def failure(self, error: Exception) -> Exception:
        """The error to report for a failed step: the dead or stuck worker behind it, if one is."""


class RankMirror:
    """Rank 0's queue of submits and aborts for the next step, and its ``peers`` (see the module docstring)."""

    def __init__(self, peers: Peers):
        self.peers = peers
        self._queued: list[Command] = []

    def queue(self, kind: str, payload: Request | str) -> None:
        self._queued.append((kind, payload))

    def queued_submits(self) -> list[Request]:
        return [payload for kind, payload in self._queued if kind == "submit"]

    def send_step(self) -> list[Command]:
        """Send the queued commands to the workers with the order to step; the commands, for rank 0 to apply
        in the same order."""
        commands, self._queued = self._queued, []
        self.peers.step([("submit", request_fields(c)) if kind == "submit" else (kind, c) for kind, c in commands])
        return commands

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """A failed collective raises the error naming the worker behind it."""
        try:
            yield
        except Exception as error:
            failure = self.peers.failure(error)
            if failure is error:
                raise
            raise failure from error


def request_fields(request: Request) -> tuple:
    """What a worker needs to build rank 0's request again (``Request``'s arguments)."""
    return (request.request_id, request.prompt, request.prompt_token_ids, request.params, request.stop_token_ids,
            request.seed, request.priority, request.arrival_time, request.side_inputs, request.encoder_input_ids)
