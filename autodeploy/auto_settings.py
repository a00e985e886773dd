"""Resolve ``auto`` settings from the model config and the hardware; ``config show`` prints the result (``--explain``:
with the reasons, ``planning/explain.py``).

- ``device: auto``: CUDA when a GPU is visible.
- ``dtype: auto``: float32 on a CPU; on a GPU the checkpoint's, but float16 for a bfloat16 checkpoint on a GPU without
  bfloat16 tensor cores (compute capability < 8.0).
- ``max_seq_len`` unset: the model's ``max_position_embeddings``.
- ``quantize.default: auto`` (opt-in): the planner's choice for this model on this device (``planning/planner.py``):
  FP8 where the GPU has FP8 tensor cores, else none, then int8 and INT4 as memory demands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import PretrainedConfig

from autodeploy.errors import ConfigError
from autodeploy.models.factory import config_dtype

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048


def resolve_auto_settings(settings: DictConfig, hf_config: PretrainedConfig, shape: Callable[[], object] | None = None) -> DictConfig:
    """A copy of ``settings`` with every ``auto``/unset value made concrete (and why, in the log). ``shape``: the model's
    ``ModelShape``, asked for only when a choice needs it (``quantize.default: auto``)."""
    resolved = OmegaConf.to_container(settings, resolve=True)
    if resolved["device"] == "auto":
        resolved["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    elif str(resolved["device"]).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device is {resolved['device']!r} but no CUDA GPU is visible; use --set device=cpu")
    if resolved["dtype"] == "auto":
        # CPUs run bf16/fp16 matmuls slowly and the correctness oracle is fp32, so CPU runs in fp32.
        checkpoint_dtype = str(config_dtype(hf_config)).removeprefix("torch.")
        resolved["dtype"] = "float32" if resolved["device"] == "cpu" else checkpoint_dtype
        if resolved["dtype"] == "bfloat16" and str(resolved["device"]).startswith("cuda") and \
                torch.cuda.get_device_capability(torch.device(resolved["device"])) < (8, 0):
            resolved["dtype"] = "float16"
            logger.info("dtype auto: float16 (this GPU has no bfloat16 tensor cores)")
    model_max = getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
    if resolved["max_seq_len"] is None:
        resolved["max_seq_len"] = int(model_max)
    elif resolved["max_seq_len"] > model_max:
        logger.warning("max_seq_len %d exceeds the model's max_position_embeddings %d", resolved["max_seq_len"], model_max)
    if resolved["quantize"]["default"] == "auto":
        _resolve_quantize(resolved, shape)
    return OmegaConf.create(resolved)


def _resolve_quantize(resolved: dict, shape: Callable[[], object] | None) -> None:
    from autodeploy.planning import PlanRequest, current_profile, plan

    if shape is None:
        raise ConfigError("quantize.default: auto needs the model's shape; set a scheme (fp8, int8_wo, int4_awq, …) or none")
    device = torch.device(resolved["device"])
    if device.type == "meta":
        raise ConfigError("quantize.default: auto picks a scheme for the device it deploys on; on meta, name a scheme or none")
    profile, _ = current_profile(device)
    request = PlanRequest(context=resolved["max_seq_len"], concurrency=resolved["max_batch_size"], quantize="auto",
                          weights=resolved["weights"], dtype=resolved["dtype"])
    chosen = plan(shape(), profile, request)
    quantize = resolved["quantize"]
    quantize["default"] = chosen.value("quantize.default")
    for key in ("experts", "embedding"):
        if any(c.setting == f"quantize.{key}" for c in chosen.choices) and quantize[key] == "none":
            quantize[key] = chosen.value(f"quantize.{key}")
    reason = next(c.reason for c in chosen.choices if c.setting == "quantize.default")
    logger.info("quantize.default auto: %s (%s)", quantize["default"], reason)
