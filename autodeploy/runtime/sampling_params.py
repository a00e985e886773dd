"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autodeploy.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature=0`` is greedy decoding. ``top_k=0`` and ``top_p=1`` disable those filters.
    ``seed`` makes a sampled request reproducible. Generation stops at ``max_tokens``, at any of
    ``stop_token_ids`` (plus the model's EOS unless ``ignore_eos``), or when the text contains one
    of the ``stop`` strings (which is cut from the returned text).

    >>> SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=1)
    SamplingParams(max_tokens=32, temperature=0.7, top_k=0, top_p=0.9, seed=1, stop=[], stop_token_ids=[], ignore_eos=False)
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first invalid field."""

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_real(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not is_real(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number ≥ 0 (0 = greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer ≥ 0 (0 = off), got {self.top_k!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
