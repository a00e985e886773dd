"""Encoder–decoder checkpoints (BART, mBART): which ones autodeploy can export, and what it needs to know of them.

An encoder–decoder model reads its input once, with an encoder of bidirectional self-attention, and writes its
output with a decoder whose layers attend causally to the output so far and, through cross-attention, to the
encoder's output. Every decoding step of a request reads the same cross-attention keys and values: each decoder
layer's ``k_proj`` / ``v_proj`` of the encoder's last hidden state. autodeploy exports it as two functions
(``export/encoder_decoder.py``): ``"encoder"`` — input ids in, every decoder layer's cross keys and values out,
computed once a request — and ``"model"`` — the decoder, taking those keys and values as inputs beside its
tokens and positions. Everything model-specific about that split lives here; the export wrappers read only an
``EncoderDecoderSpec``.

    >>> spec = encoder_decoder_spec(config)   # None for a model that is not an encoder–decoder
    >>> spec.decoder_start_token_id, spec.num_layers

T5 (its relative position bias is an input of every attention, not a tensor the paged cache can hold) is the
next family (``notes/encoder_decoder.md``); asked for now, it is refused with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from autodeploy.errors import UnsupportedModelError

# The families served: model type → (the decoder's layers under the model, their cross-attention's attribute).
SERVED = {"bart": "encoder_attn", "mbart": "encoder_attn"}
NEXT = {"t5": "T5's relative position bias (an input of every attention kernel; notes/encoder_decoder.md)"}


@dataclass(frozen=True)
class EncoderDecoderSpec:
    """What the pipeline and the runtime need to know of an encoder–decoder checkpoint."""

    model_type: str
    decoder_start_token_id: int  # the decoder's first input token (HF ``generate`` starts every output with it)
    num_layers: int  # decoder layers: one cross-attention (its keys and values) each
    num_heads: int  # cross-attention heads (keys and values: as many; no GQA in these families)
    head_dim: int
    max_source_positions: int  # the encoder's learned position table: the longest input it embeds


def encoder_decoder_spec(config: PretrainedConfig, name: str = "the model") -> EncoderDecoderSpec | None:
    """The spec of an encoder–decoder ``config`` autodeploy can export; None for a model that is not one. Another
    encoder–decoder family is an ``UnsupportedModelError`` naming it and what it lacks."""
    if not getattr(config, "is_encoder_decoder", False) or getattr(config, "vision_config", None) is not None:
        return None
    model_type = config.model_type
    if model_type not in SERVED:
        reason = NEXT.get(model_type, "a family autodeploy does not export yet")
        raise UnsupportedModelError(
            f"{name}: {type(config).__name__} ({model_type}) is an encoder-decoder model; autodeploy exports "
            f"{', '.join(SERVED)} so far, not {model_type}: {reason}"
        )
    start = config.decoder_start_token_id
    if start is None:
        raise UnsupportedModelError(f"{name}: its config has no decoder_start_token_id: the decoder's first input is unknown")
    heads = config.decoder_attention_heads
    return EncoderDecoderSpec(
        model_type=model_type,
        decoder_start_token_id=int(start),
        num_layers=config.decoder_layers,
        num_heads=heads,
        head_dim=config.d_model // heads,
        max_source_positions=config.max_position_embeddings,
    )


def cross_attentions(model: nn.Module, spec: EncoderDecoderSpec) -> list[nn.Module]:
    """Each decoder layer's cross-attention module, in layer order (``…ForConditionalGeneration``)."""
    return [getattr(layer, SERVED[spec.model_type]) for layer in model.get_decoder().layers]
