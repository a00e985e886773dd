"""When drafting pays: step costs measured at set-up, and the number of tokens to draft a step.

Verifying ``k`` drafted tokens a sequence costs a forward over ``k + 1`` tokens a sequence (and, on a GPU, the
piecewise graphs instead of a replayed decode graph, and no overlapped loop); it gains the tokens the model
accepts. ``measure_step_costs`` times both kinds of step on the engine's own runner and pool at a few batch
sizes; ``best_num_tokens`` picks, for a step's decoding sequences and each one's acceptance so far, the ``k``
(0 … K) with the most expected tokens per second — 0 turns speculation off for that step. With per-token
acceptance ``a``, a draft of ``k`` tokens yields ``1 + a + a² + … + aᵏ`` tokens in expectation.

A forward timed at set-up is not all a step costs: decoding steps overlap their host work (planning, staging,
sampling, applying tokens) with the device's, a drafting step cannot (the next draft starts from its tokens), and
the drafter takes its own time. So the engine reports each step's wall time as it ran (``ObservedSteps``):
what decoding steps take, and how much longer drafting steps take than their forward and drafting predict; the
choice uses both once seen.

    costs = measure_step_costs(runner, batch_sizes=[1, 8, 32], num_tokens=4)
    k = best_num_tokens(costs, acceptances=[0.7, 0.4], num_tokens=4)
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from autodeploy.runtime.scheduler import ScheduledChunk

# A draft must promise this much more throughput than decoding alone: measurement noise must not flip it on.
MARGIN = 1.05


@dataclass(frozen=True)
class StepCosts:
    """Seconds per forward at ``batch_sizes``: ``decode[i]`` one token a sequence, ``verify[i]`` ``num_tokens + 1``."""

    batch_sizes: tuple[int, ...]
    decode: tuple[float, ...]
    verify: tuple[float, ...]
    num_tokens: int

    def seconds(self, batch: int, k: int) -> float:
        """A step of ``batch`` sequences each verifying ``k`` drafted tokens: linear between the measured batch
        sizes (proportional past the largest), and in ``k`` between decoding and a whole draft."""
        decode, verify = self._at(batch, self.decode), self._at(batch, self.verify)
        return decode + (verify - decode) * k / self.num_tokens

    def threshold(self, batch: int) -> float | None:
        """The per-token acceptance above which drafting ``num_tokens`` beats decoding at ``batch`` (None: never)."""
        return breakeven_acceptance(MARGIN * self.seconds(batch, self.num_tokens) / self.seconds(batch, 0), self.num_tokens)

    def _at(self, batch: int, values: tuple[float, ...]) -> float:
        sizes = self.batch_sizes
        if batch >= sizes[-1]:
            return values[-1] * batch / sizes[-1]
        i = bisect.bisect_left(sizes, batch)
        if sizes[i] == batch or i == 0:
            return values[i]
        share = (batch - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return values[i - 1] + (values[i] - values[i - 1]) * share


def breakeven_acceptance(needed: float, k: int) -> float | None:
    """The per-token acceptance at which a draft of ``k`` tokens yields ``needed`` tokens a row in expectation (None:
    not even a whole draft accepted does)."""
    if needed > k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, k) < needed else (low, middle)
    return high


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a row yields in expectation when each of ``k`` drafted tokens is accepted with ``acceptance``,
    the first rejection ending the row, plus the model's own token."""
    return float(k + 1) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def best_num_tokens(costs: StepCosts, acceptances: list[float], num_tokens: int, drafting: float = 0.0,
                    overhead: float = 0.0, decoding: float | None = None) -> int:
    """The tokens to draft a sequence this step (0: none) for sequences with these acceptances so far, when drafting
    takes ``drafting`` seconds per drafted position for this batch (a draft model's forward, say), a drafting step
    ``overhead`` seconds more than its forward and drafting, and a decoding step ``decoding`` seconds (None: its
    forward's cost)."""
    batch = len(acceptances)
    if batch == 0:
        return 0
    best, best_rate = 0, batch / (decoding or costs.seconds(batch, 0))
    # expected_tokens(a, k) = 1 + a + … + a^k for every sequence and k at once (one step of host work, vectorised)
    powers = np.asarray(acceptances, dtype=np.float64)[:, None] ** np.arange(1, num_tokens + 1)
    totals = batch + powers.cumsum(axis=1).sum(axis=0)
    for k in range(1, num_tokens + 1):
        rate = float(totals[k - 1]) / (costs.seconds(batch, k) + drafting * k + overhead)
        if rate > best_rate * MARGIN:
            best, best_rate = k, rate
    return best


class DraftingTimes:
    """Seconds the drafter takes per drafted position, by batch size (the nearest power of two), as observed: an
    exponential average of its calls, so a slow drafter (a draft model's forwards) counts against its drafts."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self._seconds: dict[int, float] = {}

    def observe(self, batch: int, positions: int, seconds: float, replace: bool = False) -> None:
        """A call drafted ``positions`` for ``batch`` sequences in ``seconds``; ``replace``: it stands for the bucket
        alone (a revisit after steps that did not draft: the old average may be one slow first call's)."""
        if positions > 0:
            _average(self._seconds, batch, seconds / positions, 1.0 if replace else self.weight)

    def per_position(self, batch: int) -> float:
        """The observed seconds per drafted position at the bucket nearest ``batch`` (0 before any call)."""
        return _nearest(self._seconds, batch, 0.0)


class ObservedSteps:
    """Whole engine steps of decoding sequences alone, as they ran, by batch size (the nearest power of two):
    the wall seconds of a decoding step, and how many more a drafting step took than its forward (``StepCosts``)
    and its drafting predict (host work a drafting step cannot hide). Exponential averages."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.decoding: dict[int, float] = {}
        self.overhead: dict[int, float] = {}

    def observe(self, batch: int, drafted: bool, seconds: float, predicted: float, replace: bool = False) -> None:
        """A step of ``batch`` decoding sequences took ``seconds``; ``predicted``: a drafting step's forward and drafting;
        ``replace``: a drafting step's overhead stands for the bucket alone (``DraftingTimes.observe``)."""
        if drafted:
            _average(self.overhead, batch, max(seconds - predicted, 0.0), 1.0 if replace else self.weight)
        else:
            _average(self.decoding, batch, seconds, self.weight)

    def decoding_seconds(self, batch: int) -> float | None:
        return _nearest(self.decoding, batch, None)

    def overhead_seconds(self, batch: int) -> float:
        return _nearest(self.overhead, batch, 0.0)


class StepTally:
    """Every step of decoding sequences alone as it ran, by batch size (the nearest power of two) and kind —
    ``decoding`` (no draft), ``drafting``, ``revisit`` (``auto`` drafting to measure again): how many, and their
    wall seconds. What ``auto`` chose and what each choice cost, for the bench's report."""

    KINDS = ("decoding", "drafting", "revisit")

    def __init__(self):
        self.steps: dict[tuple[int, str], list] = {}  # (bucket, kind) -> [steps, seconds]

    def add(self, batch: int, kind: str, seconds: float) -> None:
        counted = self.steps.setdefault((_bucket(batch), kind), [0, 0.0])
        counted[0] += 1
        counted[1] += seconds

    def since(self, earlier: dict[tuple[int, str], list]) -> dict[str, dict[str, float]]:
        """What was added after ``earlier`` (a ``copy()``): ``{kind: {"steps", "mean_ms"}}`` over every bucket."""
        totals = {kind: [0, 0.0] for kind in self.KINDS}
        for (_, kind), (steps, seconds) in self.steps.items():
            then = earlier.get((_, kind), (0, 0.0))
            totals[kind][0] += steps - then[0]
            totals[kind][1] += seconds - then[1]
        return {kind: {"steps": steps, "mean_ms": 1e3 * seconds / steps if steps else None} for kind, (steps, seconds) in totals.items()}

    def copy(self) -> dict[tuple[int, str], list]:
        return {key: list(value) for key, value in self.steps.items()}


def _bucket(batch: int) -> int:
    return 1 << max(batch - 1, 0).bit_length()


def _average(averages: dict[int, float], batch: int, value: float, weight: float) -> None:
    bucket = _bucket(batch)
    known = averages.get(bucket)
    averages[bucket] = value if known is None else known + weight * (value - known)


def _nearest(averages: dict[int, float], batch: int, default):
    """The average at the bucket nearest ``batch``'s (``default`` while there is none)."""
    if not averages:
        return default
    bucket = _bucket(batch)
    return averages[min(averages, key=lambda b: abs(b.bit_length() - bucket.bit_length()))]


def measure_step_costs(runner, batch_sizes: list[int], num_tokens: int, context: int = 64, repeats: int = 3,
                       width: int = 1) -> StepCosts:
    """Time a decode step and a verification step of ``num_tokens`` at each batch size, on ``runner`` (set up: its
    pool and graphs) with throwaway sequences of ``context`` tokens whose blocks go back to the pool after. Tree
    drafts ``width`` wide verify ``num_tokens × width`` tokens for ``num_tokens`` positions: the cost of ``k``
    positions is then that of ``k × width`` tokens (``StepCosts.seconds``, linear in ``k``); their expected tokens
    are counted as a chain's, which a tree only raises."""
    decode, verify = [], []
    for batch in batch_sizes:
        decode.append(_time_step(runner, batch, context, 0, repeats))
        verify.append(_time_step(runner, batch, context, num_tokens * width, repeats))
    return StepCosts(tuple(batch_sizes), tuple(decode), tuple(verify), num_tokens)


def timed_batch_sizes(max_batch_size: int, max_num_tokens: int, pool_tokens: int, num_tokens: int, context: int) -> list[int]:
    """Batch sizes to time: 1, 4, 16, 64, 256 and ``max_batch_size``, as far as the token budget and the pool hold them."""
    fits = min(max_batch_size, max_num_tokens // (num_tokens + 1), pool_tokens // (context + 1 + num_tokens))
    return sorted({size for size in (1, 4, 16, 64, 256, max_batch_size) if size <= fits} or {1})


class _Timed:
    """A stand-in sequence: ``context`` computed tokens and a newest one (no request)."""

    _ids = itertools.count(-(2**50), -1)
    request = None

    def __init__(self, context: int):
        self.seq_id = next(self._ids)
        self.token_ids = [1] * (context + 1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _time_step(runner, batch: int, context: int, k: int, repeats: int) -> float:
    sequences = [_Timed(context) for _ in range(batch)]
    pool = runner.pool
    try:
        for sequence in sequences:
            if not pool.reserve(sequence.seq_id, context + 1 + k):
                raise RuntimeError(f"the KV pool cannot hold {batch} sequences of {context + 1 + k} tokens to time a step")
        chunks = [ScheduledChunk(s, context, 1 + k, draft=[1] * k) for s in sequences]
        seconds = []
        for _ in range(repeats + 1):  # the first is a warm-up
            _synchronize(runner.device)
            began = time.perf_counter()
            run, _ = runner.stage(chunks)
            run()
            _synchronize(runner.device)
            seconds.append(time.perf_counter() - began)
        return sorted(seconds[1:])[len(seconds[1:]) // 2]
    finally:
        for sequence in sequences:
            pool.free(sequence.seq_id)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
