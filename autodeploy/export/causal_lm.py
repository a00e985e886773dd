"""The function a causal LM is exported as: token ids and positions in, logits out.

Its own module, importing nothing of the pipeline, because graph passes, weight loading and verification all
name parameters by the path the wrapper gives them (``model.`` + the Hugging Face name), and they must be able
to import that without importing the export stage.
"""

from __future__ import annotations

import torch
from torch import nn

CAUSAL_LM_INPUTS: tuple[str, ...] = ("input_ids", "position_ids")
GRAPH_PREFIX = "model."  # CausalLMLogits holds the HF model as attribute ``model``: graph names start so


class CausalLMLogits(nn.Module):
    """The exported function: token ids and positions in, logits out (no HF output objects, no cache)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
