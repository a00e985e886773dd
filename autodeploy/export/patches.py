"""Export patches: context managers active while ``torch.export`` traces a model.

A patch makes model code that does not export as is (cache objects, attention backends that
call into custom kernels, data-dependent branches) take an exportable path. Patches are
registered by name and enabled with ``transforms.export_to_fx.patches`` in YAML.

```python
import contextlib
from autodeploy.export import register_export_patch

@register_export_patch("my_model_no_dropout")
@contextlib.contextmanager
def no_dropout(model):
    old = model.config.attention_dropout
    model.config.attention_dropout = 0.0
    try:
        yield
    finally:
        model.config.attention_dropout = old
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ContextManager

import torch
from torch import nn

from autodeploy.errors import ConfigError

ExportPatch = Callable[[nn.Module], ContextManager[None]]

_PATCHES: dict[str, ExportPatch] = {}


def register_export_patch(name: str) -> Callable[[ExportPatch], ExportPatch]:
    """Register ``patch(model) -> context manager`` under ``name``."""

    def decorate(patch: ExportPatch) -> ExportPatch:
        _PATCHES[name] = patch
        return patch

    return decorate


def registered_export_patches() -> list[str]:
    return sorted(_PATCHES)


@contextlib.contextmanager
def apply_export_patches(model: nn.Module, names: list[str]) -> Iterator[None]:
    unknown = [name for name in names if name not in _PATCHES]
    if unknown:
        raise ConfigError(
            f"unknown export patch(es) {', '.join(unknown)}; registered patches: {', '.join(registered_export_patches())}"
        )
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(_PATCHES[name](model))
        yield


def _hf_configs(model: nn.Module) -> list:
    """Every distinct Hugging Face config object reachable from the model's modules."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")}
    return list(configs.values())


@contextlib.contextmanager
def _override_config_attribute(model: nn.Module, attribute: str, value) -> Iterator[None]:
    saved = [(config, getattr(config, attribute)) for config in _hf_configs(model) if hasattr(config, attribute)]
    for config, _ in saved:
        setattr(config, attribute, value)
    try:
        yield
    finally:
        for config, old in saved:
            setattr(config, attribute, old)


@register_export_patch("hf_no_kv_cache")
def hf_no_kv_cache(model: nn.Module) -> ContextManager[None]:
    """HF models build ``DynamicCache`` objects when ``config.use_cache`` is set, also in code paths
    that ignore the ``use_cache`` argument; cache objects are Python state export cannot return."""
    return _override_config_attribute(model, "use_cache", False)


@register_export_patch("hf_sdpa_attention")
def hf_sdpa_attention(model: nn.Module) -> ContextManager[None]:
    """flash-attention and flex-attention backends call opaque kernels; SDPA exports to one aten op
    that the pattern library understands. Eager attention is kept (it exports as plain matmuls)."""
    configs = _hf_configs(model)
    if all(getattr(c, "_attn_implementation", None) in (None, "eager", "sdpa") for c in configs):
        return contextlib.nullcontext()
    return _override_config_attribute(model, "_attn_implementation", "sdpa")


@register_export_patch("hf_moe_batched_experts")
def hf_moe_batched_experts(model: nn.Module) -> ContextManager[None]:
    """HF's default grouped-GEMM experts pick ops by the device they are traced on (``histc`` on int
    inputs works on CUDA, not CPU), so a graph exported on meta would fail on CPU. The batched path
    gathers each token's expert weights with plain indexing: one graph for every device."""
    if not any(type(m).__name__.endswith("Experts") for m in model.modules()):
        return contextlib.nullcontext()
    return _override_config_attribute(model, "_experts_implementation", "batched_mm")


@register_export_patch("scalar_constants_on_cpu")
@contextlib.contextmanager
def scalar_constants_on_cpu(model: nn.Module) -> Iterator[None]:
    """Model code that builds scalar constants with ``torch.tensor(0.0, device=x.device)`` (HF's eager
    attention masks do) would bake a value-less meta tensor into a graph exported on meta. A 0-dim
    CPU tensor keeps its value and mixes with tensors on any device, so scalars are made on the CPU."""
    make_tensor = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "meta" and isinstance(data, (bool, int, float)):
            device = "cpu"
        return make_tensor(data, *args, device=device, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = make_tensor


def _without_index_lists(index):
    """``[i]`` → ``slice(i, i + 1)`` (the same values, kept as a dimension); longer int lists → CPU index tensors."""
    if isinstance(index, list) and index and all(type(i) is int for i in index):
        if len(index) == 1:
            i = index[0]
            return slice(i, i + 1 if i != -1 else None)
        return torch.tensor(index, device="cpu")
    if isinstance(index, tuple):
        return tuple(_without_index_lists(i) for i in index)
    return index


@register_export_patch("list_indices_as_slices")
@contextlib.contextmanager
def list_indices_as_slices(model: nn.Module) -> Iterator[None]:
    """Indexing with a Python list (Falcon's ``qkv[..., [-2], :]``) makes torch build an index tensor on
    the indexed tensor's device; on meta it is captured without a value, and the graph would index with
    garbage. A one-element list is a one-wide slice; longer lists become index tensors on the CPU."""
    getitem = torch.Tensor.__getitem__

    def patched(self, index):
        return getitem(self, _without_index_lists(index))

    torch.Tensor.__getitem__ = patched
    try:
        yield
    finally:
        torch.Tensor.__getitem__ = getitem
