"""The functions an encoder-only checkpoint is exported as (``models/embedding.py`` says which): the ``"embed"`` graph.

``EncoderHiddenStates`` (``task="embed"``): the token ids, positions and token types of many texts packed into one
row ``[1, T]`` with no padding, and where each text starts (``seq_start``, ``[N + 1]``) in; the last hidden state
``[1, T, H]`` out. Pooling (a text's first row, its mean, its last) is the runtime's: it is a few rows a text.

``SequenceScores`` (``task="score"``): the same inputs; the classifier's logit of each text's first row out,
``[N, 1]`` — a ``…ForSequenceClassification`` head reads the ``[CLS]`` row (BERT through its pooler, RoBERTa
through its classification head).

The Hugging Face model reads the positions it is given, counted from 0 within each text (the wrapper adds the
offset RoBERTa-style embeddings count from: ``padding_idx + 1``), so a packed row is what Hugging Face computes for
each text alone — once attention keeps the texts apart. It does not yet: ``seq_start`` reaches no attention
until the cache stage's ``pack_bidirectional_attention`` hands it to every ``bidirectional_attention`` (the match
stage's canonical form of the encoder's SDPA calls). Both hold the Hugging Face model as ``model``, so every
parameter keeps its Hugging Face path.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

EMBED_INPUTS: tuple[str, ...] = ("input_ids", "position_ids", "token_type_ids", "seq_start")
SEQ_START = "seq_start"


def position_offset(model: nn.Module) -> int:
    """The position id of a text's first token: RoBERTa-style embeddings number positions after the padding id."""
    embeddings = getattr(_base(model), "embeddings", None)
    padding = getattr(embeddings, "padding_idx", None)
    return int(padding) + 1 if padding is not None else 0


def max_text_tokens(model: nn.Module) -> int:
    """The longest text the position embeddings cover."""
    config = model.config
    return int(config.max_position_embeddings) - position_offset(model)


def _base(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix, model) if hasattr(model, "base_model_prefix") else model


def takes_token_types(module: nn.Module) -> bool:
    """Whether ``module``'s forward reads token types (BERT's segments; a decoder's does not)."""
    return "token_type_ids" in inspect.signature(module.forward).parameters


class EncoderHiddenStates(nn.Module):
    """The exported embedder (see the module docstring)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.offset = position_offset(model)
        self.token_types = takes_token_types(model)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                seq_start: torch.Tensor) -> torch.Tensor:
        types = {"token_type_ids": token_type_ids} if self.token_types else {}
        return self.model(input_ids=input_ids, position_ids=position_ids + self.offset, **types).last_hidden_state


class SequenceScores(nn.Module):
    """The exported cross-encoder (see the module docstring)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        base = _base(model)
        self.offset = position_offset(model)
        self.token_types = takes_token_types(base)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor,
                seq_start: torch.Tensor) -> torch.Tensor:
        base = _base(self.model)
        types = {"token_type_ids": token_type_ids} if self.token_types else {}
        hidden = base(input_ids=input_ids, position_ids=position_ids + self.offset, **types).last_hidden_state
        first = hidden[0, seq_start[:-1]].unsqueeze(1)  # [N, 1, H]: each text's [CLS] row as a batch of one-row texts
        pooler = getattr(base, "pooler", None)
        if pooler is not None:  # BERT: classifier(dropout(pooler(hidden)))
            return self.model.classifier(pooler(first))
        return self.model.classifier(first)  # RoBERTa's head reads features[:, 0] itself
