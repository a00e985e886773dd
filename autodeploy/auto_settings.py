"""Resolve ``auto`` settings from the model config and the hardware; ``config show`` prints the result."""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import PretrainedConfig

from autodeploy.errors import ConfigError
from autodeploy.models.factory import config_dtype

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048


def resolve_auto_settings(settings: DictConfig, hf_config: PretrainedConfig) -> DictConfig:
    """A copy of ``settings`` with every ``auto``/unset value made concrete (and why, in the log)."""
    resolved = OmegaConf.to_container(settings, resolve=True)
    if resolved["device"] == "auto":
        resolved["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    elif str(resolved["device"]).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device is {resolved['device']!r} but no CUDA GPU is visible; use --set device=cpu")
    if resolved["dtype"] == "auto":
        # CPUs run bf16/fp16 matmuls slowly and the correctness oracle is fp32, so CPU runs in fp32.
        checkpoint_dtype = config_dtype(hf_config)
        resolved["dtype"] = "float32" if resolved["device"] == "cpu" else str(checkpoint_dtype).removeprefix("torch.")
    model_max = getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
    if resolved["max_seq_len"] is None:
        resolved["max_seq_len"] = int(model_max)
    elif resolved["max_seq_len"] > model_max:
        logger.warning("max_seq_len %d exceeds the model's max_position_embeddings %d", resolved["max_seq_len"], model_max)
    return OmegaConf.create(resolved)
