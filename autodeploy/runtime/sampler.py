"""Turn a batch of last-position logits into next tokens, each row with its own SamplingParams."""

from __future__ import annotations

import torch

from autodeploy.runtime.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and nucleus (top-p) filtering exclude; ``logits`` is 1-D."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the top token always stays).
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample_next_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """``logits``: [batch, vocab]. Greedy rows take the argmax; sampled rows draw from their own generator."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.temperature == 0:
            continue
        filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
        tokens[row] = int(torch.multinomial(filtered.softmax(-1), 1, generator=generator))
    return tokens
