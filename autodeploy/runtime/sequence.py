"""One request's state while it generates: tokens so far, its sampler generator, stop checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autodeploy.runtime.outputs import RequestOutput
from autodeploy.runtime.sampling_params import SamplingParams


@dataclass
class Sequence:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: set[int]
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append(self, token: int, tokenizer) -> None:
        """Add a sampled token and decide whether the request is finished."""
        self.output_token_ids.append(token)
        if self.params.stop and tokenizer is not None and self._cut_at_stop_string(tokenizer):
            self.finish_reason = "stop"
            return  # self.text is already cut
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and tokenizer is not None:
            self.text = tokenizer.decode(self.output_token_ids, skip_special_tokens=True)

    def _cut_at_stop_string(self, tokenizer) -> bool:
        """Only requests with stop strings decode every step; the others decode once, when finished."""
        text = tokenizer.decode(self.output_token_ids, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in self.params.stop if stop in text]
        if not cuts:
            return False
        self.text = text[: min(cuts)]
        return True

    def output(self) -> RequestOutput:
        return RequestOutput(self.prompt, self.prompt_token_ids, self.text, list(self.output_token_ids), self.finish_reason)
