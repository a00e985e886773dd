"""The ``replay`` drafter, for benchmarks only: speculative decoding's cost and gain at a set acceptance.

With random weights no drafter can guess honestly, yet the cost of verifying K tokens and the speed-up at a
given acceptance length are what a deployment needs to know. ``replay`` proposes the model's own greedy
continuation of each prompt, recorded by the benchmark's run without speculation, and sets how many of each
draft's tokens are kept (``benchmark_acceptance``: the first ``acceptance_length - 1``, whatever the model
samples): every verification row keeps exactly ``acceptance_length`` tokens. Matching the recording cannot
do that: random weights give near-equal logits, so a forward of K + 1 tokens and one of a single token, which
round differently in bfloat16, soon pick different greedy tokens (on an H100 the recording matched 2 of 486
drafted tokens). The work of each step (drafting, the verification forward, sampling every row, rolling back
the rejected tokens' KV entries) is the work of a real acceptance of that length; the tokens kept are the
drafted ones, so the output is not the model's — a benchmark's, labelled as such in its report. It is
registered when ``autodeploy bench`` loads; a deployment outside the benchmark does not know the name.

    autodeploy bench llama-3-8b --set weights=random --speculative-method replay --speculative-num-tokens 4 \\
        --set speculative.options.acceptance_length=3
"""

from __future__ import annotations

from autodeploy.errors import ConfigError
from autodeploy.runtime.speculative import register_drafter


class Replay:
    """Recorded continuations (prompt token ids → greedy output), proposed with ``right`` tokens right."""

    def __init__(self, num_tokens: int, acceptance_length: int, vocab_size: int):
        self.right = acceptance_length - 1
        self.vocab_size = vocab_size
        self.continuations: dict[tuple[int, ...], list[int]] = {}

    def remember(self, continuations: list[tuple[list[int], list[int]]]) -> None:
        for prompt, output in continuations:
            self.continuations[tuple(prompt)] = list(output)

    def __call__(self, sequences: list, limits: list[int]) -> list[list[int]]:
        drafts = []
        for sequence, limit in zip(sequences, limits):
            recorded = self.continuations.get(tuple(sequence.request.prompt_token_ids), [])
            done = len(sequence.output_token_ids)
            upcoming = recorded[done : done + limit]
            upcoming += [sequence.token_ids[-1]] * (limit - len(upcoming))  # past the recording: any tokens do
            drafts.append(upcoming)
        return drafts

    def benchmark_acceptance(self, draft: list[int], sampled: list[int]) -> int:
        """Draft tokens kept: the set number, whatever the model sampled."""
        return min(len(draft), self.right)


@register_drafter("replay")
def replay_drafter(deployment, settings) -> Replay:
    length = settings.options.get("acceptance_length")
    if not isinstance(length, int) or not 1 <= length <= settings.num_tokens + 1:
        raise ConfigError(f"the replay drafter needs speculative.options.acceptance_length, an integer in 1 … num_tokens + 1 "
                          f"= {settings.num_tokens + 1} (tokens each verification row keeps), got {length!r}")
    return Replay(settings.num_tokens, length, deployment.vocab_size)
