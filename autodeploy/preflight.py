"""Checks that run before anything is exported or materialised, so a deploy that cannot work fails in
seconds with the numbers and the fix, not minutes later with a raw traceback.

- ``check_position_table``: a model with a learned position table (GPT-2, OPT, GPT-Neo, …) cannot
  embed positions past it, so ``max_seq_len`` may not exceed it.
- ``check_memory``: the weights plus the KV cache of one ``max_seq_len`` sequence must fit in the
  device's free memory (the GPU's, or the host's available memory for the CPU).

```python
from autodeploy.preflight import check_deployment
check_deployment(settings, factory.hf_config, meta_model)   # raises ConfigError
```
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from autodeploy.errors import ConfigError

logger = logging.getLogger(__name__)

_GIB = 2**30


def position_table_size(model: nn.Module, config: PretrainedConfig) -> int | None:
    """The number of positions a learned absolute position table holds; None for models without one
    (RoPE, ALiBi, …). A table is an ``nn.Embedding`` named for positions (``wpe``, ``embed_positions``,
    ``position_embeddings``)."""
    tables = [m for name, m in model.named_modules() if isinstance(m, nn.Embedding)
              and ("pos" in name.rsplit(".", 1)[-1] or name.endswith("wpe"))]
    if not tables:
        return None
    text = config.get_text_config()
    return int(getattr(text, "max_position_embeddings", None) or min(t.num_embeddings for t in tables))


def check_position_table(settings, model: nn.Module, config: PretrainedConfig) -> None:
    table = position_table_size(model, config)
    if table is not None and settings.max_seq_len > table:
        raise ConfigError(
            f"max_seq_len={settings.max_seq_len} is beyond this model's learned position table ({table} positions: "
            f"it cannot embed later positions); set max_seq_len to at most {table} (--set max_seq_len={table})"
        )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct parameters (tied weights once) in their dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """An estimate from the config: K and V of every layer, for its key-value heads."""
    text = config.get_text_config()
    heads = _setting(text, "num_attention_heads") or 1
    kv_heads = _setting(text, "num_key_value_heads") or heads
    head_dim = _setting(text, "head_dim") or ((_setting(text, "hidden_size") or 0) // heads)
    layers = _setting(text, "num_hidden_layers") or 0
    return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def _setting(config: PretrainedConfig, name: str):
    """A config value, or None where it is missing or not one value (transformers raises for settings
    that differ per layer, e.g. Gemma-4's head_dim)."""
    try:
        value = getattr(config, name, None)
    except Exception:
        return None
    return value if isinstance(value, int) else None


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes free, what) for ``device``; None when it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{torch.cuda.get_device_name(device)} has"
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine has"
        except OSError:
            return None
    return None


def check_memory(settings, model: nn.Module, config: PretrainedConfig) -> None:
    device = torch.device(settings.device)
    if device.type == "meta":
        return
    available = available_memory(device)
    if available is None:
        return
    free, owner = available
    dtype = getattr(torch, settings.dtype)
    weights = weight_bytes(model)
    kv = kv_bytes_per_token(config, dtype) * settings.max_seq_len
    if weights + kv <= free:
        return
    fixes = []
    if dtype == torch.float32:
        fixes.append(f"dtype=bfloat16 (weights {weights / 2 / _GIB:.1f} GiB)")
    if kv > weights / 4:
        fixes.append("a smaller max_seq_len")
    fixes.append("device=meta with weights=random to inspect the pipeline without memory")
    fixes.append("a device with more memory")
    raise ConfigError(
        f"this model does not fit on {device}: its weights take {weights / _GIB:.1f} GiB in {settings.dtype} and one "
        f"{settings.max_seq_len}-token sequence's KV cache {kv / _GIB:.1f} GiB, but {owner} {free / _GIB:.1f} GiB free; "
        f"use {', or '.join(fixes)}"
    )


def check_deployment(settings, config: PretrainedConfig, model: nn.Module) -> None:
    """Every preflight check; ``model`` is the HF model on the meta device in the deploy dtype."""
    check_position_table(settings, model, config)
    check_memory(settings, model, config)
