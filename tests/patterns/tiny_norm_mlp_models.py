"""Tiny random HF models for the norm/MLP pattern tests: ``tests/tiny_models.py``'s four plus five more.

Each extra architecture brings a norm or MLP spelling the others lack: Gemma (RMSNorm with ``1 + weight``,
GeLU-tanh gated MLP), Gemma-2 (four norms per layer), Phi-3 (fused ``gate_up_proj`` + ``chunk``),
GPT-NeoX (``nn.LayerNorm``, plain GeLU MLP with biases) and Qwen3 (per-head q/k RMSNorms).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GemmaConfig, GPTNeoXConfig, PretrainedConfig, Phi3Config, Qwen3Config

from tests.tiny_models import ARCHITECTURES, TINY_COMMON, tiny_config

_NO_GQA = {key: value for key, value in TINY_COMMON.items() if key != "num_key_value_heads"}

EXTRA_CONFIGS = {
    "gemma": lambda: GemmaConfig(**TINY_COMMON, head_dim=16),
    "gemma2": lambda: Gemma2Config(**TINY_COMMON, head_dim=16, sliding_window=16),
    "phi3": lambda: Phi3Config(**TINY_COMMON),
    "gpt_neox": lambda: GPTNeoXConfig(**_NO_GQA),
    "qwen3": lambda: Qwen3Config(**TINY_COMMON, head_dim=16),
}

ALL_ARCHITECTURES = (*ARCHITECTURES, *EXTRA_CONFIGS)


def config_for(arch: str) -> PretrainedConfig:
    return EXTRA_CONFIGS[arch]() if arch in EXTRA_CONFIGS else tiny_config(arch)


def model_for(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """An eval-mode HF causal LM with random weights (deterministic per seed), 2 layers."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_for(arch), attn_implementation="sdpa", dtype=dtype).eval()
