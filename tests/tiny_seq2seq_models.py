"""Tiny random encoder–decoder models (BART, mBART, T5 v1.0 and v1.1, mT5) for the encoder–decoder tests and the coverage
sweep."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (BartConfig, BartForConditionalGeneration, MBartConfig, MBartForConditionalGeneration, MT5Config,
                          MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration)

TINY = dict(vocab_size=512, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2)
TINY_T5 = dict(vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0)
# T5 v1.1 (Flan-T5): gated GELU, no output scaling, a head of its own (transformers 5 builds it tied; ``tiny`` unties it,
# and its checkpoint then stores both, as Google's do).
TINY_T5_V1_1 = {**TINY_T5, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
KINDS = {"bart": (BartConfig, BartForConditionalGeneration, TINY), "mbart": (MBartConfig, MBartForConditionalGeneration, TINY),
         "t5": (T5Config, T5ForConditionalGeneration, TINY_T5), "t5_v1_1": (T5Config, T5ForConditionalGeneration, TINY_T5_V1_1),
         "mt5": (MT5Config, MT5ForConditionalGeneration, TINY_T5_V1_1)}  # mT5: v1.1's shape under its own model type
UNTIED_HEADS = {"t5_v1_1", "mt5"}


def tiny(kind: str, seed: int = 0):
    """The tiny model (float32, eval) with its norms, biases and logits bias perturbed (HF starts them at 1 and 0)."""
    torch.manual_seed(seed)
    config_class, model_class, sizes = KINDS[kind]
    model = model_class(config_class(**sizes)).eval()
    if kind in UNTIED_HEADS:
        model.lm_head.weight = nn.Parameter(torch.randn_like(model.lm_head.weight))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_()
    return model


def lively(kind: str, seed: int = 5):
    """``tiny`` with weights large enough that its greedy output changes token now and then (HF's initialisation
    repeats one token), and without the end-of-sequence token HF's ``generate`` forces at max_length
    (``forced_eos_token_id``, which the engine's requests do not ask for)."""
    model = tiny(kind, seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(8)
    model.config.forced_eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    return model


def hf_generate_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    """HF ``generate``'s greedy output tokens for encoder input ``prompt`` (without the decoder's start token), on the
    model's device."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, num_beams=1)
    return out[0, 1:].tolist()


def greedy_shortfall(model, prompt: list[int], token_ids: list[int]) -> float:
    """How far below HF's best logit the worst of ``token_ids`` falls, HF's decoder fed the tokens before each (teacher
    forcing): 0 for HF's greedy output, a little more where a near-tie went the other way in lower precision."""
    decoder_ids = torch.tensor([[model.config.decoder_start_token_id, *token_ids[:-1]]])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), decoder_input_ids=decoder_ids).logits[0].float()
    return float((logits.max(-1).values - logits[torch.arange(len(token_ids)), token_ids]).max())
