"""Tiny random configs for every architecture the MoE pattern is tested on.

Each config has 2 layers, vocab 512, hidden 64, 4 experts with top-2 routing and small intermediate
sizes, and switches on what makes the architecture's MoE block different: Mixtral always renormalises
the top-k weights; Qwen2-MoE does not and adds a shared expert behind a sigmoid gate; Qwen3-MoE
renormalises and has a dense MLP in its first layer; OLMoE does not renormalise. GPT-OSS (expert
biases, interleaved clamped SwiGLU) is outside the ``moe`` op's contract and must stay unmatched.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from tests.tiny_models import TINY_COMMON, VOCAB_SIZE

NUM_EXPERTS = 4
TOP_K = 2

_COMMON = {key: value for key, value in TINY_COMMON.items() if key != "intermediate_size"}  # experts size their own


def _gpt_oss() -> PretrainedConfig:
    # GPT-OSS's YaRN defaults, with the original context scaled down as much as max_position_embeddings
    # is (512 = 32 × 16), so transformers does not warn about an inconsistent factor.
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    rope |= {"original_max_position_embeddings": 16, "rope_theta": 150000.0}
    return GptOssConfig(
        **_COMMON,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        rope_parameters=rope,
    )


TINY_CONFIGS = {
    "mixtral": lambda: MixtralConfig(
        **_COMMON, intermediate_size=32, num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "olmoe": lambda: OlmoeConfig(
        **_COMMON, intermediate_size=32, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False
    ),
    "gpt_oss": _gpt_oss,
}

# GPT-OSS has no SDPA path in transformers 5.17.
_ATTENTION = {"gpt_oss": "eager"}


def tiny_moe_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An eval-mode HF causal LM with random weights, deterministic per (arch, seed)."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[arch]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=_ATTENTION.get(arch, "sdpa"), dtype=dtype)
    return model.eval()


def moe_layer_count(model: torch.nn.Module) -> int:
    """How many decoder layers route through experts (dense-MLP layers do not)."""
    return sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
