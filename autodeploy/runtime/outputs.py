"""What generate() returns per prompt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string) or ``"length"`` (max_tokens)."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
