"""The two functions an encoder–decoder checkpoint is exported as (``export/encoder_decoder.py``), on tiny random
BART and mBART: the encoder's cross keys and values fed to the decoder give Hugging Face's logits, positions are
the ones given, both export with their dims dynamic, and other encoder–decoders are refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, GPT2Config, MBartConfig, MBartForConditionalGeneration, T5Config

from autodeploy.errors import UnsupportedModelError
from autodeploy.export.encoder_decoder import EncoderCrossKV, EncoderDecoderLogits
from autodeploy.export.export import export_to_graph_module
from autodeploy.models.encoder_decoder import encoder_decoder_spec

TINY = dict(vocab_size=512, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2)


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    config, model_class = (BartConfig, BartForConditionalGeneration) if kind == "bart" else (MBartConfig, MBartForConditionalGeneration)
    model = model_class(config(**TINY)).eval()
    with torch.no_grad():  # HF starts norms, biases and the logits bias at 1 and 0: perturb them so a misread one shows
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
        model.final_logits_bias.normal_()
    return model


@pytest.mark.parametrize("kind", ["bart", "mbart"])
def test_the_decoder_reading_the_encoders_cross_keys_and_values_gives_hugging_faces_logits(kind):
    model = tiny(kind)
    spec = encoder_decoder_spec(model.config)
    source = torch.randint(3, 512, (2, 11))
    target = torch.randint(3, 512, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=source, decoder_input_ids=target).logits
        keys, values = EncoderCrossKV(model, spec)(source)
        assert keys.shape == values.shape == (2, 2, 11, 4, 8)  # [layers, B, S, heads, head_dim]
        logits = EncoderDecoderLogits(model, spec)(target, torch.arange(7).expand(2, 7), keys, values)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert "forward" not in vars(model.get_decoder().embed_positions)  # the Hugging Face modules are left as they were


def test_the_decoders_positions_are_the_ones_given():
    """A decoder token at position 5 is embedded as position 5 though it is the graph's first token: the served graph
    takes many sequences' tokens in one row. Its logits are those of HF's sixth token when the five before it are
    masked out of its attention — here simply checked against the same token placed sixth with its own prefix."""
    model = tiny("bart", seed=1)
    spec = encoder_decoder_spec(model.config)
    source = torch.randint(3, 512, (1, 9))
    target = torch.randint(3, 512, (1, 6))
    with torch.no_grad():
        keys, values = EncoderCrossKV(model, spec)(source)
        logits = EncoderDecoderLogits(model, spec)
        at_start = logits(target[:, :1], torch.tensor([[0]]), keys, values)
        at_five = logits(target[:, :1], torch.tensor([[5]]), keys, values)
        expected = model(input_ids=source, decoder_input_ids=target[:, :1]).logits
    torch.testing.assert_close(at_start, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(at_five, at_start)


@pytest.mark.parametrize("kind", ["bart", "mbart"])
def test_both_functions_export_with_their_dims_dynamic(kind):
    model = tiny(kind)
    spec = encoder_decoder_spec(model.config)
    batch, length, tokens = (torch.export.Dim.DYNAMIC(min=1, max=64) for _ in range(3))
    encoder = export_to_graph_module(EncoderCrossKV(model, spec), (torch.randint(3, 512, (2, 5)),), ({0: batch, 1: length},))
    source = torch.randint(3, 512, (1, 13))
    keys, values = encoder(source)
    assert keys.shape == (2, 1, 13, 4, 8)
    ids, positions = torch.randint(3, 512, (2, 4)), torch.arange(4).expand(2, 4)
    decoder = export_to_graph_module(EncoderDecoderLogits(model, spec), (ids, positions, *EncoderCrossKV(model, spec)(torch.randint(3, 512, (2, 5)))),
                                     ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {1: batch, 2: length}, {1: batch, 2: length}))
    target = torch.randint(3, 512, (1, 3))
    with torch.no_grad():
        expected = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(decoder(target, torch.arange(3)[None], keys, values), expected, rtol=1e-5, atol=1e-5)


def test_which_configs_are_encoder_decoders_autodeploy_exports():
    spec = encoder_decoder_spec(BartConfig(**TINY))
    assert (spec.model_type, spec.decoder_start_token_id, spec.num_layers, spec.num_heads, spec.head_dim) == ("bart", 2, 2, 4, 8)
    assert encoder_decoder_spec(GPT2Config()) is None
    with pytest.raises(UnsupportedModelError, match=r"T5Config \(t5\) is an encoder-decoder model; .*relative position bias"):
        encoder_decoder_spec(T5Config(), "t5-small")
    with pytest.raises(UnsupportedModelError, match="no decoder_start_token_id"):
        encoder_decoder_spec(BartConfig(**{**TINY, "decoder_start_token_id": None}))
