"""The transform registry: a transform is a named class, registered with its stage, that may have a typed config.

```python
from dataclasses import dataclass
from autodeploy.transforms import Transform, TransformConfig, TransformResult, register_transform

@dataclass
class ScaleConfig(TransformConfig):
    factor: float = 1.0

@register_transform("my_scale", stage="fuse", dead_code=True)
class MyScale(Transform):
    config_class = ScaleConfig

    def apply(self, module, context):
        ...  # rewrite module.graph; the pipeline lints, recompiles and (dead_code) prunes it after
        return TransformResult(matches=1, changed=True)
```
Enable it from YAML with ``transforms: {my_scale: {factor: 2.0}}``. A built-in pass is one module of
``transforms/``: the package imports every module in it, so adding one needs no other edit.
"""

from __future__ import annotations

import dataclasses
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from torch import nn

from autodeploy.custom_ops.serving_signature import ServingSignature
from autodeploy.deployment import MODEL, ROLES

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
SHAPES = ("none", "missing", "all")
ALL_ROLES = ROLES  # a pass that rewrites every graph of a deployment registers with roles=ALL_ROLES


@dataclass
class TransformConfig:
    """Options every transform has; subclass it to add typed options. ``stage``: where the pass runs; unset,
    the stage it was registered with (YAML may move a pass, e.g. ``refold_transposes: {stage: cache}``)."""

    enabled: bool = True
    stage: Optional[str] = None


@dataclass(frozen=True)
class Upkeep:
    """What the pipeline does to the graph after a pass reports a change (``TransformResult.changed``), in this
    order, so no pass repeats the tail: ``dead_code``: ``Graph.eliminate_dead_code()``; ``recompile``: lint the
    graph and regenerate the module's forward from it; ``shapes``: ``propagate_shapes`` over the whole graph
    (``all``), only when some node has no value (``missing``: a rewrite that traced its values keeps them), or
    never (``none``: the pass set its new nodes' values itself)."""

    dead_code: bool = False
    recompile: bool = True
    shapes: str = "none"


@dataclass
class TransformResult:
    """What one transform run did. ``module`` replaces the pipeline's module when set. ``changed``: the graph
    was rewritten, so the pipeline does the pass's declared ``Upkeep``."""

    matches: int = 0
    changed: bool = False
    notes: str = ""
    module: nn.Module | None = None
    details: list[str] = field(default_factory=list)  # extra lines for the build report


@dataclass
class TransformContext:
    """What a transform may read besides the graph, and what passes hand on to later passes and the runtime.

    ``settings`` are the resolved deployment settings (device, dtype, max_seq_len, ...);
    ``model_factory`` is opaque to graph passes (only factory/export/load_weights use it);
    ``graph_inputs`` names the executable graph's inputs, in order, as the runtime fills them;
    ``kv_caches`` lists the KV cache pairs among them (``KVCacheSpec``), declared by the cache stage;
    ``decode_graph_batch_sizes``: the batch sizes whose decode steps the runtime captures as CUDA graphs,
    declared by the compile stage (empty: always eager); ``prefill_graph_token_sizes``: the token counts at
    which prefill and mixed steps replay piecewise CUDA graphs (all but attention), likewise;
    ``kv_cache_scales``: per attention module path (``model.layers.0.self_attn``), the ``(k_scale, v_scale)``
    of an fp8 KV cache, calibrated by ``load_weights`` for the cache stage (absent: 1).

    The quantize stage hands ``load_weights`` (and verification, quantized checkpoints) ``quantized_weights``:
    each quantized parameter's record by its graph target; ``smoothing_groups``: smoothquant projections over
    one input, which share one smoothing; ``head_smoothing``: smoothquant projections over attention's output
    (path, kv_heads, group, head_dim); ``calibration_graph``: the graph as quantize found it, what calibration
    runs (``load_weights`` drops it: its float weights are the model's size). The fuse stage hands
    verification what it changed in the weights: ``concatenated_parameters`` (``fuse_gemms``: old target →
    new target, first row, rows) and ``folded_smoothing`` (``fold_smoothing``: parameter name → the tensor
    with the smoothing folded in).
    """

    settings: Any
    model_factory: Any = None
    graph_inputs: tuple[str, ...] = ()
    kv_caches: tuple[Any, ...] = ()
    cross_kv_caches: tuple[Any, ...] = ()  # an encoder–decoder's cross-attention caches, declared by the cache stage
    kv_cache_scales: dict[str, tuple[float, float]] = field(default_factory=dict)
    decode_graph_batch_sizes: tuple[int, ...] = ()
    prefill_graph_token_sizes: tuple[int, ...] = ()
    quantized_weights: dict[str, Any] = field(default_factory=dict)
    smoothing_groups: list[Any] = field(default_factory=list)
    head_smoothing: list[Any] = field(default_factory=list)
    calibration_graph: Optional[nn.Module] = None
    concatenated_parameters: dict[str, Any] = field(default_factory=dict)
    folded_smoothing: dict[str, Any] = field(default_factory=dict)
    role: str = MODEL  # which graph of the deployment this run builds; passes not serving it are skipped

    def serving_signature(self) -> ServingSignature:
        """How the runtime serves the built graph, as the cache and compile stages declared it."""
        return ServingSignature(self.graph_inputs, self.kv_caches, self.decode_graph_batch_sizes, self.prefill_graph_token_sizes,
                                self.cross_kv_caches)


class Transform(ABC):
    """A pipeline pass. Subclasses implement ``apply`` (and set ``config_class`` for options of their own);
    ``register_transform`` gives them their ``name``, ``stage`` and ``upkeep``."""

    name: ClassVar[str] = ""
    stage: ClassVar[str] = ""
    upkeep: ClassVar[Upkeep] = Upkeep()
    roles: ClassVar[tuple[str, ...]] = (MODEL,)  # the graphs of a deployment it rewrites (TransformContext.role)
    config_class: ClassVar[type[TransformConfig]] = TransformConfig

    def __init__(self, config: TransformConfig):
        self.config = config if config.stage is not None else dataclasses.replace(config, stage=self.stage)

    def validate(self, context: TransformContext) -> None:
        """Check this transform's options against the resolved settings before any transform runs (a
        choice that cannot apply is a ``ConfigError`` at build, not a failure halfway through it)."""

    @abstractmethod
    def apply(self, module: nn.Module, context: TransformContext) -> TransformResult:
        """Rewrite ``module`` in place or return a new one. Transforms of stages after ``export`` always
        receive a ``torch.fx.GraphModule`` (the pipeline checks)."""


_REGISTRY: dict[str, type[Transform]] = {}


def register_transform(name: str, stage: str | None = None, *, dead_code: bool = False, recompile: bool = True,
                       shapes: str = "none", roles: tuple[str, ...] = (MODEL,)):
    """Class decorator registering a ``Transform`` subclass under ``name``, to run at ``stage`` (one of
    ``STAGES``), followed by the ``Upkeep`` that ``dead_code``, ``recompile`` and ``shapes`` declare, on the
    graphs of the ``roles`` named (``"model"``: the language model; ``"vision"``: a vision tower).

    The stage is required. A pass written before it was (``register_transform(name)`` with the stage as its
    config's default) still registers, with a ``DeprecationWarning``.
    """

    def decorate(cls: type[Transform]) -> type[Transform]:
        if not (isinstance(cls, type) and issubclass(cls, Transform)):
            raise TypeError(f"@register_transform({name!r}) must decorate a Transform subclass, got {cls!r}")
        config_class = cls.config_class
        if not (dataclasses.is_dataclass(config_class) and issubclass(config_class, TransformConfig)):
            raise TypeError(f"{cls.__name__}.config_class must be a dataclass subclassing TransformConfig")
        declared = stage
        if declared is None:
            declared = config_class().stage
            if declared is None:
                raise TypeError(f"@register_transform({name!r}) needs the pass's stage, e.g. "
                                f"@register_transform({name!r}, stage='fuse'); stages are {', '.join(STAGES)}")
            warnings.warn(f"transform {name!r} takes its stage from {config_class.__name__}.stage; pass it at "
                          f"registration instead: @register_transform({name!r}, stage={declared!r})",
                          DeprecationWarning, stacklevel=2)
        if declared not in STAGES:
            raise ValueError(f"transform {name!r} has stage {declared!r}; stages are {', '.join(STAGES)}")
        if shapes not in SHAPES:
            raise ValueError(f"transform {name!r}: shapes is {shapes!r}; use one of {', '.join(SHAPES)}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"a transform named {name!r} is already registered ({existing.__qualname__})")
        cls.name = name
        cls.stage = declared
        cls.upkeep = Upkeep(dead_code=dead_code, recompile=recompile, shapes=shapes)
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(f"transform {name!r} has roles {sorted(unknown)}; roles are {', '.join(ROLES)}")
        cls.roles = tuple(roles)
        _REGISTRY[name] = cls
        return cls

    return decorate


def get_transform_class(name: str) -> type[Transform] | None:
    return _REGISTRY.get(name)


def registered_transforms() -> dict[str, type[Transform]]:
    return dict(_REGISTRY)
