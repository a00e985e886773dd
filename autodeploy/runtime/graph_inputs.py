"""Fill the executable graph's declared inputs from a batch of token sequences.

The graph declares its inputs by name (``TransformContext.graph_inputs``); the runtime fills those
and nothing else, so a later stage that changes the signature (the KV-cache stage adds sequence
metadata) changes this builder, never a transform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN_ID = 0


@dataclass
class GraphBatch:
    """Graph inputs for one forward, plus where each sequence's last token sits in the output."""

    inputs: dict[str, torch.Tensor]
    last_positions: torch.Tensor  # [batch]: index of each sequence's last token along seq


def build_graph_inputs(input_names: tuple[str, ...], sequences: list[list[int]], device: torch.device) -> GraphBatch:
    """Right-pad the sequences into ``[batch, max_len]``. Causal attention never lets a real token see
    the padding after it, so each sequence's logits are exactly those of running it alone."""
    lengths = torch.tensor([len(s) for s in sequences])
    width = int(lengths.max())
    input_ids = torch.full((len(sequences), width), PAD_TOKEN_ID, dtype=torch.long)
    for row, tokens in enumerate(sequences):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    available = {
        "input_ids": input_ids.to(device),
        "position_ids": torch.arange(width, device=device).expand(len(sequences), width),
    }
    unknown = [name for name in input_names if name not in available]
    if unknown:
        raise RuntimeError(f"this runtime cannot fill graph input(s) {unknown}; it fills {sorted(available)}")
    return GraphBatch({name: available[name] for name in input_names}, (lengths - 1).to(device))
