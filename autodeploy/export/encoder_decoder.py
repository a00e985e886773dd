"""The two functions an encoder–decoder checkpoint is exported as (``models/encoder_decoder.py`` says which).

``EncoderCrossKV`` — the ``"encoder"`` graph: a request's input ids ``[B, S]`` in; every decoder layer's
cross-attention keys and values of the encoder's last hidden state out, ``[layers, B, S, heads, head_dim]`` each —
what each decoding step of Hugging Face's ``generate`` reads from its cross-attention cache, computed once.

``EncoderDecoderLogits`` — the ``"model"`` graph: the decoder's token ids and positions ``[B, T]`` and those keys
and values in; logits out. Each decoder layer's cross-attention takes its keys and values from the inputs instead
of projecting the encoder's output again; a decoder with learned positions (BART) looks them up at the positions
given (Hugging Face counts them from the cache it keeps; the served graph's tokens come from many sequences at once).
T5's decoder has none: its relative position bias is computed over the graph's own tokens, and the cache stage turns
it into a bias by distance that ``cached_attention`` reads (``transforms/insert_cached_attention.py``).

The cross-attention is the canonical ``bidirectional_attention`` from the start (the wrapper's code, not Hugging
Face's: nothing to match); the cache stage turns it into attention over each request's cross-KV cache.

Both hold the whole Hugging Face model as ``model``, so every parameter keeps its Hugging Face path and one
checkpoint fills both graphs. The substitutions are instance ``forward`` methods set only while a wrapper runs
(``_reading``): the Hugging Face modules are left as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import autodeploy.custom_ops  # noqa: F401  (registers torch.ops.autodeploy.bidirectional_attention)

from autodeploy.models.encoder_decoder import EncoderDecoderSpec, cross_attentions

ENCODER_INPUTS: tuple[str, ...] = ("input_ids",)
CROSS_KEYS, CROSS_VALUES = "cross_keys", "cross_values"
ENCODER_DECODER_INPUTS: tuple[str, ...] = ("input_ids", "position_ids", CROSS_KEYS, CROSS_VALUES)


class EncoderCrossKV(nn.Module):
    """The exported encoder function (see the module docstring)."""

    def __init__(self, model: nn.Module, spec: EncoderDecoderSpec):
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.model.get_encoder()(input_ids=input_ids).last_hidden_state
        heads = (-1, self.spec.head_dim)  # as many heads as the projections give: a tensor-parallel rank's own
        attentions = cross_attentions(self.model, self.spec)
        _, key, value, _ = self.spec.layout.projections
        keys = torch.stack([getattr(attention, key)(encoded).unflatten(-1, heads) for attention in attentions])
        values = torch.stack([getattr(attention, value)(encoded).unflatten(-1, heads) for attention in attentions])
        return keys, values


class EncoderDecoderLogits(nn.Module):
    """The exported decoder function (see the module docstring)."""

    def __init__(self, model: nn.Module, spec: EncoderDecoderSpec):
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cross_keys: torch.Tensor,
                cross_values: torch.Tensor) -> torch.Tensor:
        decoder = self.model.get_decoder()
        # The decoder only checks that an encoder output is given (its mask is None without an encoder mask): a view
        # of the keys stands for it, and no layer reads it.
        stand_in = cross_keys[0].flatten(2)
        with _reading(decoder, cross_attentions(self.model, self.spec), self.spec, position_ids, cross_keys, cross_values):
            hidden = decoder(input_ids=input_ids, encoder_hidden_states=stand_in, use_cache=False).last_hidden_state
        if self.spec.output_scale is not None:  # T5 v1.0: the tied head reads the hidden state scaled
            hidden = hidden * self.spec.output_scale
        logits = self.model.lm_head(hidden)
        bias = getattr(self.model, "final_logits_bias", None)  # BART's
        return logits if bias is None else logits + bias


@contextlib.contextmanager
def _reading(decoder: nn.Module, attentions: list[nn.Module], spec: EncoderDecoderSpec, position_ids: torch.Tensor,
             cross_keys: torch.Tensor, cross_values: torch.Tensor) -> Iterator[None]:
    """While it lasts, ``decoder``'s learned position embedding (where it has one) looks up ``position_ids`` and its
    layers' cross-attentions (``attentions``) read ``cross_keys`` / ``cross_values`` ``[layers, B, S, heads, head_dim]``."""
    query, _, _, output = spec.layout.projections
    patched = []
    positions = getattr(decoder, "embed_positions", None)
    if positions is not None:
        def embed_positions(*args, **kwargs):  # Hugging Face's arguments count positions from its cache: unused
            return F.embedding(position_ids + positions.offset, positions.weight)

        patched.append((positions, embed_positions))

    def cross_attention(attention: nn.Module, layer: int):
        def forward(hidden_states, *args, **kwargs):  # Hugging Face's other arguments: its mask, cache, bias (None)
            q = getattr(attention, query)(hidden_states).unflatten(-1, (-1, spec.head_dim))
            out = torch.ops.autodeploy.bidirectional_attention(q, cross_keys[layer], cross_values[layer], attention.scaling)
            return getattr(attention, output)(out.flatten(2)), *(None,) * (spec.layout.outputs - 1)

        return forward

    patched += [(a, cross_attention(a, layer)) for layer, a in enumerate(attentions)]
    try:
        for module, forward in patched:
            module.forward = forward
        yield
    finally:
        for module, _ in patched:
            del module.forward
