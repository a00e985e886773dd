"""The autotuner: which supported backend of a canonical op is fastest, per token-count bucket.

For one *problem* (an op with fixed weights, shapes and options; the token count left open) and each
bucket, every candidate first runs on fresh random inputs and is checked against the op's reference
(``‖out − ref‖ / ‖ref‖`` within the accuracy contract: 1e-5 in float32, 1e-2 in half precision); a
candidate that is wrong or raises is excluded, with the reason logged and recorded. The survivors
are timed (``timing.median_seconds``, or an injected timer) and the fastest wins (by more than
``MARGIN`` over the default, the first in registration order). Decisions are cached
in memory and on disk (``decision_cache.py``), so the same problem is profiled once per environment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .decision_cache import Decision, DecisionCache, environment, problem_key
from .timing import Timer, median_seconds

logger = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-7}
HALF_PRECISION_TOLERANCE = 1e-2
ROTATIONS = 3  # input sets a timing cycles through, at least
MAX_ROTATIONS = 16
# A candidate must beat the first in registration order (the default) by more than this to replace it:
# timings of host-bound calls differ by a few percent from run to run, and flip-flopping between
# near-equal kernels across buckets would only add dispatches (seen on the H200: rope 1–8 torch,
# 16 triton, 32+ torch, all within 8%).
MARGIN = 0.03


def relative_error(got: Any, want: Any) -> float:
    """``‖got − want‖ / ‖want‖`` over every tensor output (float64 norms); inf for a structural mismatch."""
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return float("inf")
    worst = 0.0
    for have, expected in zip(got_leaves, want_leaves):
        if not isinstance(expected, torch.Tensor):
            continue
        if not isinstance(have, torch.Tensor) or have.shape != expected.shape or have.dtype != expected.dtype:
            return float("inf")
        difference = (have.double() - expected.double()).norm().item()
        scale = expected.double().norm().item()
        worst = max(worst, difference / scale if scale > 0 else difference)
    return worst


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)


class Autotuner:
    """Times candidates per bucket and remembers the winners.

    ``timer(backend, run, input_sets, device) -> seconds`` replaces the real clock (tests inject a fake one);
    ``graphed``: time the kernels inside CUDA graphs (see ``timing.py``), for deploys that replay them.
    """

    def __init__(
        self,
        device: torch.device,
        cache_dir: str | None = None,
        *,
        warmup: int = 3,
        repeats: int = 15,
        timer: Timer | None = None,
        graphed: bool = False,
    ):
        self.device = torch.device(device)
        self.cache = DecisionCache(cache_dir, environment(self.device, graphed))
        self.warmup, self.repeats, self.graphed = warmup, repeats, graphed
        self.timer = timer or self._median_seconds
        self.profiled = 0  # (problem, bucket) pairs timed in this process
        self.reused = 0  # (problem, bucket) pairs read from the cache

    def decide(
        self,
        op_name: str,
        signature: Any,
        candidates: Sequence[Any],
        reference: Callable[..., Any],
        make_inputs: Callable[[int], list[Any]],
        buckets: Sequence[int],
        dtype: torch.dtype,
    ) -> dict[int, Decision]:
        """The decision for every bucket; ``make_inputs(num_tokens)`` builds one fresh argument list."""
        names = [c.name for c in candidates]
        decisions = {}
        for bucket in buckets:
            key = problem_key(op_name, signature, names, bucket)
            decision = self.cache.get(key)
            if decision is None or decision.backend not in names:
                decision = self._profile(op_name, candidates, reference, make_inputs, bucket, dtype)
                self.cache.put(key, decision)
                self.profiled += 1
            else:
                self.reused += 1
            decisions[bucket] = decision
        return decisions

    def save(self) -> None:
        self.cache.save()

    def _profile(self, op_name, candidates, reference, make_inputs, bucket, dtype) -> Decision:
        with torch.no_grad():
            probe = make_inputs(bucket)
            expected = reference(*probe)
            seconds, excluded = {}, {}
            input_sets = None  # built for the first candidate that runs correctly, then shared
            for candidate in candidates:
                try:
                    error = relative_error(candidate.op(*_fresh(probe)), expected)
                except Exception as failure:  # a crashing or non-compiling kernel simply does not compete
                    excluded[candidate.name] = f"raised {type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
                    continue
                if not error <= tolerance(dtype):
                    excluded[candidate.name] = f"relative error {error:.2e} > {tolerance(dtype):.0e} against the reference"
                    continue
                if input_sets is None:
                    input_sets = rotated_input_sets(probe, lambda: make_inputs(bucket), _cache_bytes(self.device))
                try:
                    seconds[candidate.name] = self.timer(candidate, lambda args, op=candidate.op: op(*args), input_sets, self.device)
                except Exception as failure:
                    excluded[candidate.name] = f"raised {type(failure).__name__} while timed"
        for name, reason in excluded.items():
            logger.warning("autotuner: %s backend %r excluded at %d tokens: %s", op_name, name, bucket, reason)
        if not seconds:
            raise RuntimeError(f"no candidate of {op_name} ran correctly at {bucket} tokens: {excluded}")
        fastest = min(seconds, key=seconds.get)
        default = next(c.name for c in candidates if c.name in seconds)
        winner = default if seconds[default] <= seconds[fastest] * (1 + MARGIN) else fastest
        return Decision(winner, seconds, excluded)

    def _median_seconds(self, backend, run, input_sets, device) -> float:
        return median_seconds(backend, run, input_sets, device, warmup=self.warmup, repeats=self.repeats,
                              graphed=self.graphed)


def rotated_input_sets(probe: list[Any], make_inputs: Callable[[], list[Any]], cache_bytes: int) -> list[list[Any]]:
    """The argument lists a timing cycles through: ``probe``, then fresh ones, at least ``ROTATIONS`` and
    more (up to ``MAX_ROTATIONS``) until together they hold over twice ``cache_bytes``.

    Arguments that every list shares (the node's weights: the same tensor each time) are cloned for the
    later lists. A served step reads a weight after the rest of its layer's weights have passed through
    the cache; timed over one weight that fits in the cache (a 4096 × 4096 projection is 34 MB, an H200's
    L2 50 MB), a kernel would be timed reading it from there (measured at 32 rows: cuBLAS 10.3 µs so,
    13.0 µs streaming from memory, where the few-row kernel took 11.4).
    """
    probe_leaves = pytree.tree_leaves(probe)
    sets, held = [probe], _tensor_bytes(probe_leaves)
    clone = held <= 2 * cache_bytes  # a weight larger than that streams from memory anyway (an LM head)
    while len(sets) < ROTATIONS or (held <= 2 * cache_bytes and len(sets) < MAX_ROTATIONS):
        leaves, spec = pytree.tree_flatten(make_inputs())
        if clone:
            leaves = [leaf.clone() if isinstance(leaf, torch.Tensor) and any(leaf is old for old in probe_leaves)
                      else leaf for leaf in leaves]
        sets.append(pytree.tree_unflatten(leaves, spec))
        held += _tensor_bytes(leaves)
    return sets


def _tensor_bytes(leaves: list[Any]) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in leaves if isinstance(leaf, torch.Tensor))


def _cache_bytes(device: torch.device) -> int:
    """The last-level cache a kernel's operands may sit in between two timed calls (0: none to defeat)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)


def _fresh(args: list[Any]) -> list[Any]:
    """Copies of the tensor arguments a candidate may write to (none of the tuned ops do; cheap insurance)."""
    return [a.clone() if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) and a.numel() < (1 << 24) else a for a in args]
