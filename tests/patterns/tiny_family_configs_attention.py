"""Tiny random configs for every architecture the attention/RoPE patterns are tested on.

Each config has 2 layers, vocab 512, hidden 64 and 4 query / 2 key-value heads where the architecture
allows it, and switches on the feature that makes the architecture's attention or RoPE different:
sliding windows shorter than the longest test sequence, soft-capping, QK-norm, partial or interleaved
rotary, attention sinks.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    StableLmConfig,
)

from tests.tiny_models import TINY_COMMON, VOCAB_SIZE

SLIDING_WINDOW = 6  # shorter than the longest test sequence, so the window really cuts

# 5× HF's default init, so attention logits are O(1) and a wrong scale, cap or mask shows in the logits.
_COMMON = dict(TINY_COMMON, initializer_range=0.1)

_ALTERNATING = ["sliding_attention", "full_attention"]


def _gemma2() -> PretrainedConfig:
    return Gemma2Config(
        **_COMMON,
        head_dim=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=_ALTERNATING,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=24,  # scale 24**-0.5, not head_dim**-0.5
    )


def _gemma3() -> PretrainedConfig:
    return Gemma3TextConfig(
        **_COMMON, head_dim=16, sliding_window=SLIDING_WINDOW, layer_types=_ALTERNATING, query_pre_attn_scalar=24
    )


def _gpt_neox() -> PretrainedConfig:
    common = {key: value for key, value in _COMMON.items() if key != "num_key_value_heads"}
    return GPTNeoXConfig(**common, rotary_pct=0.25)


def _gpt_oss() -> PretrainedConfig:
    return GptOssConfig(
        **_COMMON,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=_ALTERNATING,
        # GPT-OSS's YaRN scaling, rescaled to this config's 512 positions.
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
    )


TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=SLIDING_WINDOW),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "mixtral": lambda: MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": lambda: Phi3Config(**_COMMON, partial_rotary_factor=0.5),
    "gpt_neox": _gpt_neox,
    "gpt_oss": _gpt_oss,
    "cohere": lambda: CohereConfig(**_COMMON, use_qk_norm=True),
    "stablelm": lambda: StableLmConfig(**_COMMON, partial_rotary_factor=0.25, qk_layernorm=True),
}


# HF builds GPT-OSS with eager attention only (its sinks are not expressible through SDPA).
ATTENTION_IMPLEMENTATIONS = {arch: ("eager",) if arch == "gpt_oss" else ("sdpa", "eager") for arch in TINY_CONFIGS}


def tiny_family_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """An fp32 eval-mode HF causal LM with random weights, deterministic per (arch, seed)."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[arch]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()
