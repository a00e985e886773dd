"""Encoder–decoder checkpoints (BART, mBART, T5): which ones autodeploy can export, and what it needs to know of them.

An encoder–decoder model reads its input once, with an encoder of bidirectional self-attention, and writes its
output with a decoder whose layers attend causally to the output so far and, through cross-attention, to the
encoder's output. Every decoding step of a request reads the same cross-attention keys and values: each decoder
layer's key / value projections of the encoder's last hidden state. autodeploy exports it as two functions
(``export/encoder_decoder.py``): ``"encoder"`` — input ids in, every decoder layer's cross keys and values out,
computed once a request — and ``"model"`` — the decoder, taking those keys and values as inputs beside its
tokens and positions. Everything model-specific about that split lives here; the export wrappers read only an
``EncoderDecoderSpec``.

    >>> spec = encoder_decoder_spec(config)   # None for a model that is not an encoder–decoder
    >>> spec.decoder_start_token_id, spec.num_layers

T5 (v1.0 and v1.1 / Flan-T5, and mT5) has no position embeddings: its relative position bias is matched into the attention
ops (``patterns/relative_position_bias.py``), its decoder output is scaled by ``d_model ** -0.5`` before a tied head
(``scale_decoder_outputs``). T5-shaped variants with other position schemes (UMT5's bias in every layer, LongT5's
local attention) are other model types, refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from autodeploy.errors import UnsupportedModelError


@dataclass(frozen=True)
class CrossAttentionLayout:
    """Where a family keeps its decoder layers' cross-attention and what its projections are called."""

    layers: str  # the decoder's list of layers
    attention: str  # a layer's cross-attention module, dotted
    projections: tuple[str, str, str, str]  # its query, key, value and output linears
    outputs: int  # how many values its forward returns (the attention's output first)


_BART = CrossAttentionLayout("layers", "encoder_attn", ("q_proj", "k_proj", "v_proj", "out_proj"), outputs=2)
_T5 = CrossAttentionLayout("block", "layer.1.EncDecAttention", ("q", "k", "v", "o"), outputs=3)
# The families served: model type → the layout of its decoder's cross-attention. mT5 is T5 v1.1 under its own model
# type (gated GELU, a head of its own, and in transformers 5 no output scaling whatever its ties).
SERVED = {"bart": _BART, "mbart": _BART, "t5": _T5, "mt5": _T5}
NEXT = {
    "umt5": "UMT5's relative position bias (a table in every layer, not one shared by the stack)",
    "longt5": "LongT5's local and transient-global attention",
}


@dataclass(frozen=True)
class EncoderDecoderSpec:
    """What the pipeline and the runtime need to know of an encoder–decoder checkpoint."""

    model_type: str
    decoder_start_token_id: int  # the decoder's first input token (HF ``generate`` starts every output with it)
    num_layers: int  # decoder layers: one cross-attention (its keys and values) each
    num_heads: int  # cross-attention heads (keys and values: as many; no GQA in these families)
    head_dim: int
    max_source_positions: int | None  # the encoder's learned position table (BART): the longest input; None: any (T5)
    layout: CrossAttentionLayout
    output_scale: float | None = None  # what the decoder's last hidden state is multiplied by before the head (T5 v1.0)


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
    start = getattr(config, "decoder_start_token_id", None)  # T5's config class has no default for it
    if start is None:
        raise UnsupportedModelError(f"{name}: its config has no decoder_start_token_id: the decoder's first input is unknown")
    if SERVED[model_type] is _T5:
        return EncoderDecoderSpec(
            model_type=model_type, decoder_start_token_id=int(start), num_layers=config.num_decoder_layers,
            num_heads=config.num_heads, head_dim=config.d_kv, max_source_positions=None, layout=SERVED[model_type],
            output_scale=config.d_model**-0.5 if getattr(config, "scale_decoder_outputs", False) else None,
        )
    heads = config.decoder_attention_heads
    return EncoderDecoderSpec(
        model_type=model_type,
        decoder_start_token_id=int(start),
        num_layers=config.decoder_layers,
        num_heads=heads,
        head_dim=config.d_model // heads,
        max_source_positions=config.max_position_embeddings,
        layout=SERVED[model_type],
    )


def cross_attentions(model: nn.Module, spec: EncoderDecoderSpec) -> list[nn.Module]:
    """Each decoder layer's cross-attention module, in layer order (``…ForConditionalGeneration``)."""
    layers = getattr(model.get_decoder(), spec.layout.layers)
    return [layer.get_submodule(spec.layout.attention) for layer in layers]
