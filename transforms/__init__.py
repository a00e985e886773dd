"""Graph transforms: one module per pass family, each registered by name."""

from autodeploy.transforms.registry import (
    STAGES,
    Transform,
    TransformConfig,
    TransformContext,
    TransformResult,
    get_transform_class,
    register_transform,
    registered_transforms,
)
from autodeploy.transforms import cleanup_dead_code, cleanup_noop, cleanup_transposes  # noqa: F401  (registers the cleanup passes)
from autodeploy.transforms import match_patterns, match_report  # noqa: F401  (registers the match-stage passes)
from autodeploy.transforms import shard_expert_parallel, shard_pipeline_parallel, shard_tensor_parallel  # noqa: F401  (register the shard-stage passes)
from autodeploy.transforms import quantize_linear  # noqa: F401  (registers the quantize-stage pass)
from autodeploy.transforms import fold_smoothing, fuse_add_rms_norm, fuse_fp8_quantization, fuse_gate_up, fuse_gemms  # noqa: F401  (register the fuse-stage passes)
from autodeploy.transforms import compile_model, fuse_rope_into_cached_attention, insert_cached_attention, select_kernels  # noqa: F401  (register the cache, select and compile passes)

__all__ = [
    "STAGES",
    "Transform",
    "TransformConfig",
    "TransformContext",
    "TransformResult",
    "get_transform_class",
    "register_transform",
    "registered_transforms",
]
