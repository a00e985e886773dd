"""Resolve ``auto`` settings from the model config and the hardware; ``config show`` prints the result (``--explain``:
with the reasons, ``planning/explain.py``).

- ``device: auto``: CUDA when a GPU is visible.
- ``dtype: auto``: float32 on a CPU; on a GPU the checkpoint's, but float16 for a bfloat16 checkpoint on a GPU without
  bfloat16 tensor cores (compute capability < 8.0).
- ``max_seq_len`` unset: the model's ``max_position_embeddings``.
- ``quantize.default: auto`` (opt-in): the planner's choice for this model on this device (``planning/planner.py``):
  FP8 where the GPU has FP8 tensor cores, else none, then int8 and INT4 as memory demands.
- ``auto.batch`` / ``auto.token_budget`` / ``auto.tensor_parallel`` (opt-in): the planner's ``max_batch_size``,
  ``scheduler.max_num_tokens`` and tensor-parallel size for ``auto.concurrency`` sequences of ``max_seq_len`` tokens.
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
    auto = resolved["auto"]
    if resolved["quantize"]["default"] == "auto" or auto["batch"] or auto["token_budget"] or auto["tensor_parallel"]:
        _planned(resolved, shape)
    return OmegaConf.create(resolved)


def _planned(resolved: dict, shape: Callable[[], object] | None) -> None:
    """The planner's choices for what is ``auto`` (``quantize.default``, the ``auto`` switches), each logged with its
    reason (``config show --explain`` prints them)."""
    from autodeploy.planning import PlanRequest, current_profile, plan

    asked = [name for name, on in (("quantize.default: auto", resolved["quantize"]["default"] == "auto"),
                                   *((f"auto.{key}", resolved["auto"][key]) for key in ("batch", "token_budget", "tensor_parallel")))
             if on]
    device = torch.device(resolved["device"])
    if shape is None or device.type == "meta":
        raise ConfigError(f"{', '.join(asked)}: the planner picks for the device a model deploys on; on meta (or without the "
                          f"model) give the values instead")
    profile, _ = current_profile(device)
    auto = resolved["auto"]
    if auto["tensor_parallel"] and device.type == "cuda":
        profile = profile.with_count(torch.cuda.device_count())
    quantize = resolved["quantize"]
    request = PlanRequest(context=resolved["max_seq_len"], concurrency=auto["concurrency"], quantize=quantize["default"],
                          weights=resolved["weights"], dtype=resolved["dtype"],
                          memory_fraction=resolved["kv_cache"]["memory_fraction"], cpu_bytes=resolved["kv_cache"]["cpu_bytes"])
    chosen = plan(shape(), profile, request)
    picks = []
    if quantize["default"] == "auto":
        quantize["default"] = chosen.value("quantize.default")
        for key in ("experts", "embedding"):
            if any(c.setting == f"quantize.{key}" for c in chosen.choices) and quantize[key] == "none":
                quantize[key] = chosen.value(f"quantize.{key}")
        picks.append("quantize.default")
    for key, setting in (("batch", "max_batch_size"), ("token_budget", "scheduler.max_num_tokens"),
                         ("tensor_parallel", "distributed.tensor_parallel")):
        if auto[key]:
            *path, name = setting.split(".")
            node = resolved
            for part in path:
                node = node[part]
            node[name] = chosen.value(setting)
            picks.append(setting)
    for choice in chosen.choices:
        if choice.setting in picks:
            logger.info("%s auto: %s (%s)", choice.setting, choice.value, choice.reason)
