"""Per-request sampling parameters."""

from __future__ import annotations

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
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer ≥ 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
