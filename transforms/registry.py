"""The transform registry: a transform is a named class with a typed config dataclass.

```python
from dataclasses import dataclass
from autodeploy.transforms import Transform, TransformConfig, TransformResult, register_transform

@dataclass
class ScaleConfig(TransformConfig):
    stage: str = "fuse"
    factor: float = 1.0

@register_transform("my_scale")
class MyScale(Transform):
    config_class = ScaleConfig

    def apply(self, module, context):
        ...  # rewrite module.graph
        return TransformResult(matches=0)
```
Enable it from YAML with ``transforms: {my_scale: {factor: 2.0}}``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

STAGES: tuple[str, ...] = (
    "factory",
    "export",
    "cleanup",
    "match",
    "shard",
    "quantize",
    "load_weights",
    "fuse",
    "cache",
    "select",
    "compile",
)


@dataclass
class TransformConfig:
    """Options every transform has; subclass it to add typed options."""

    enabled: bool = True
    stage: str = "cleanup"


@dataclass
class TransformResult:
    """What one transform run did. ``module`` replaces the pipeline's module when set."""

    matches: int = 0
    changed: bool = False
    notes: str = ""
    module: nn.Module | None = None
    details: list[str] = field(default_factory=list)  # extra lines for the build report


@dataclass
class TransformContext:
    """What a transform may read besides the graph.

    ``settings`` are the resolved deployment settings (device, dtype, max_seq_len, ...);
    ``model_factory`` is opaque to graph passes (only factory/export/load_weights use it);
    ``graph_inputs`` names the executable graph's inputs, in order, as the runtime fills them;
    ``kv_caches`` lists the KV cache pairs among them (``KVCacheSpec``), declared by the cache stage;
    ``decode_graph_batch_sizes``: the batch sizes whose decode steps the runtime captures as CUDA graphs,
    declared by the compile stage (empty: always eager); ``prefill_graph_token_sizes``: the token counts at
    which prefill and mixed steps replay piecewise CUDA graphs (all but attention), likewise;
    ``kv_cache_scales``: per attention module path (``model.layers.0.self_attn``), the ``(k_scale, v_scale)``
    of an fp8 KV cache, calibrated by ``load_weights`` for the cache stage (absent: 1).
    """

    settings: Any
    model_factory: Any = None
    graph_inputs: tuple[str, ...] = ()
    kv_caches: tuple[Any, ...] = ()
    kv_cache_scales: dict[str, tuple[float, float]] = field(default_factory=dict)
    decode_graph_batch_sizes: tuple[int, ...] = ()
    prefill_graph_token_sizes: tuple[int, ...] = ()
    state: dict[str, Any] = field(default_factory=dict)


class Transform(ABC):
    """A pipeline pass. Subclasses set ``config_class`` and implement ``apply``."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[TransformConfig]] = TransformConfig

    def __init__(self, config: TransformConfig):
        self.config = config

    def validate(self, context: TransformContext) -> None:
        """Check this transform's options against the resolved settings before any transform runs (a
        choice that cannot apply is a ``ConfigError`` at build, not a failure halfway through it)."""

    @abstractmethod
    def apply(self, module: nn.Module, context: TransformContext) -> TransformResult:
        """Rewrite ``module`` in place or return a new one. Transforms of stages after ``export`` always
        receive a ``torch.fx.GraphModule`` (the pipeline checks)."""


_REGISTRY: dict[str, type[Transform]] = {}


def register_transform(name: str):
    """Class decorator registering a ``Transform`` subclass under ``name``."""

    def decorate(cls: type[Transform]) -> type[Transform]:
        if not (isinstance(cls, type) and issubclass(cls, Transform)):
            raise TypeError(f"@register_transform({name!r}) must decorate a Transform subclass, got {cls!r}")
        config_class = cls.config_class
        if not (dataclasses.is_dataclass(config_class) and issubclass(config_class, TransformConfig)):
            raise TypeError(f"{cls.__name__}.config_class must be a dataclass subclassing TransformConfig")
        stage = config_class().stage
        if stage not in STAGES:
            raise ValueError(f"transform {name!r} has default stage {stage!r}; stages are {', '.join(STAGES)}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"a transform named {name!r} is already registered ({existing.__qualname__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def get_transform_class(name: str) -> type[Transform] | None:
    return _REGISTRY.get(name)


def registered_transforms() -> dict[str, type[Transform]]:
    return dict(_REGISTRY)
