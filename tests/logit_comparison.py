"""Compare a graph's logits with its HF model's, over shapes that exercise the dynamic dims."""

import torch
from torch import nn

# (batch, seq, first position): seq 1, a short batch, and positions that do not start at 0.
DEFAULT_SHAPES = ((1, 1, 0), (2, 7, 0), (3, 16, 5))


def max_logit_diff(model: nn.Module, gm, shapes=DEFAULT_SHAPES) -> float:
    """Largest |graph − HF| logit over ``shapes``; asserts the shapes agree."""
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for batch, seq, first_position in shapes:
        input_ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)
        position_ids = torch.arange(first_position, first_position + seq).expand(batch, seq)
        with torch.no_grad():
            expected = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            logits = gm(input_ids, position_ids)
        assert logits.shape == expected.shape
        worst = max(worst, (logits.float() - expected.float()).abs().max().item())
    return worst


def deployed_max_logit_diff(model: nn.Module, llm, shapes=DEFAULT_SHAPES) -> float:
    """Largest |deployed − HF| logit over ``shapes`` (first position 0: the deployed model computes every
    prompt from the start of its KV cache), through the serving engine's paged cache."""
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for batch, seq, _ in shapes:
        input_ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)
        with torch.no_grad():
            expected = model(input_ids=input_ids, use_cache=False).logits
        logits = torch.stack(llm.logits(input_ids.tolist()))
        assert logits.shape == expected.shape
        worst = max(worst, (logits.float() - expected.float()).abs().max().item())
    return worst
