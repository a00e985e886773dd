"""The pipeline engine: runs the transforms named in the settings, in stage order, and records each run.

```python
from autodeploy.config import load_settings
from autodeploy.pipeline import Pipeline
pipeline = Pipeline.from_settings(load_settings())
print([t.name for t in pipeline.transforms])
```
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from torch import fx, nn

from autodeploy.build_report import BuildReport, TransformRecord
from autodeploy.config import transform_configs
from autodeploy.deployment import MODEL, Deployment
from autodeploy.errors import AutoDeployError, TransformError, error_summary
from autodeploy.transforms.registry import STAGES, Transform, TransformContext, TransformResult, registered_transforms
from autodeploy.transforms.shape_propagation import propagate_shapes

logger = logging.getLogger(__name__)


def op_name(node: fx.Node) -> str:
    """``aten.linear.default`` → ``aten.linear``; other callables by their name."""
    target = node.target
    if hasattr(target, "_schema"):  # an OpOverload
        namespace, _, rest = str(target).partition(".")
        return f"{namespace}.{rest.split('.')[0]}"
    return getattr(target, "__name__", str(target))


def op_histogram(module: nn.Module) -> dict[str, int]:
    if not isinstance(module, fx.GraphModule):
        return {}
    counts = Counter(op_name(n) for n in module.graph.nodes if n.op == "call_function")
    return dict(counts.most_common())


def node_count(module: nn.Module) -> int | None:
    return len(module.graph.nodes) if isinstance(module, fx.GraphModule) else None


def run_transform(transform: Transform, module: nn.Module, context: TransformContext) -> TransformResult:
    """Apply one transform, then, when it changed a graph, the upkeep it declared at registration (dead-code
    elimination, lint and recompile, shape propagation), so no pass ends with its own copy of that tail."""
    result = transform.apply(module, context)
    graph_module = result.module if result.module is not None else module
    if not (result.changed and isinstance(graph_module, fx.GraphModule)):
        return result
    upkeep = transform.upkeep
    if upkeep.dead_code:
        graph_module.graph.eliminate_dead_code()
    if upkeep.recompile:
        graph_module.graph.lint()
        graph_module.recompile()
    if upkeep.shapes == "all" or (upkeep.shapes == "missing" and any(
            "val" not in node.meta for node in graph_module.graph.nodes if node.op in ("call_function", "get_attr"))):
        propagate_shapes(graph_module)
    return result


class Pipeline:
    def __init__(self, transforms: list[Transform]):
        self.transforms = transforms
        self.records: list[TransformRecord] = []

    @classmethod
    def from_settings(cls, settings) -> Pipeline:
        """Instantiate the enabled transforms, ordered by stage and then by their order in the settings."""
        configs = transform_configs(settings)
        registry = registered_transforms()
        enabled = [(name, config) for name, config in configs.items() if config.enabled]
        ordered = sorted(enabled, key=lambda item: STAGES.index(item[1].stage))  # stable: keeps YAML order
        return cls([registry[name](config) for name, config in ordered])

    def validate(self, context: TransformContext) -> None:
        """Every transform's own checks of its options against the settings, before any of them runs."""
        for transform in self.transforms:
            transform.validate(context)

    def first_index_of_stage(self, stage: str) -> int:
        """Index of the first transform at or after ``stage`` (``len(transforms)`` when none)."""
        order = STAGES.index(stage)
        return next((i for i, t in enumerate(self.transforms) if STAGES.index(t.config.stage) >= order), len(self.transforms))

    def deployment(self, graph: fx.GraphModule, context: TransformContext, tokenizer=None, eos_token_ids=(),
                   verification=None, model_directory: str | None = None) -> Deployment:
        """What a run built, as the runtime, save and load take it: ``graph`` as the ``"model"`` role, the serving
        signature the cache and compile stages declared in ``context``, and this run's records."""
        return Deployment({MODEL: graph}, context.serving_signature(), context.settings, tokenizer, eos_token_ids,
                          BuildReport(self.records, verification), model_directory)

    def run(
        self,
        context: TransformContext,
        module: nn.Module | None = None,
        dump_dir: str | Path | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> nn.Module:
        """Run ``transforms[start:stop]`` on ``module``. A run from the start checks every transform's
        options first and starts a new record list; a run from ``start > 0`` continues the records."""
        if start == 0:
            self.records = []
            self.validate(context)
        stop = len(self.transforms) if stop is None else stop
        for index, transform in enumerate(self.transforms[start:stop], start):
            if context.role not in transform.roles:
                continue
            before = node_count(module) if module is not None else None
            if STAGES.index(transform.config.stage) > STAGES.index("export") and not isinstance(module, fx.GraphModule):
                raise TransformError(
                    f"transform {transform.name!r} (stage {transform.config.stage}) needs the exported graph, "
                    f"got {type(module).__name__}; is export_to_fx disabled?"
                )
            began = time.perf_counter()
            try:
                result = run_transform(transform, module, context)
            except AutoDeployError:
                raise
            except Exception as error:
                raise TransformError(
                    f"transform {transform.name!r} (stage {transform.config.stage}) failed: {type(error).__name__}: "
                    f"{error_summary(error)} — disable it with "
                    f"--set transforms.{transform.name}.enabled=false to check whether it is the cause"
                ) from error
            seconds = time.perf_counter() - began
            if result.module is not None:
                module = result.module
            record = TransformRecord(
                name=transform.name,
                stage=transform.config.stage,
                seconds=seconds,
                matches=result.matches,
                changed=result.changed,
                nodes_before=before,
                nodes_after=node_count(module),
                notes=result.notes,
                ops_after=op_histogram(module),
                details=list(result.details),
            )
            self.records.append(record)
            logger.info("%-20s %-12s %7.3fs matches=%d nodes %s→%s", record.name, record.stage, seconds,
                        record.matches, before, record.nodes_after)
            if dump_dir is not None and isinstance(module, fx.GraphModule):
                # numbered by the record's place: a transform skipped for this graph's role leaves no gap
                path = Path(dump_dir) / f"{len(self.records) - 1:02d}_{record.stage}_{record.name}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(str(module.graph))
        return module
