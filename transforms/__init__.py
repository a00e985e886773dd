"""Graph transforms: one module per pass family, each registered by name.

Importing the package imports every module in it, so a new pass is one new file here: its
``@register_transform`` runs with the import, and no list of modules needs editing.
"""

import importlib
import pkgutil

from autodeploy.transforms.registry import (
    STAGES,
    Transform,
    TransformConfig,
    TransformContext,
    TransformResult,
    Upkeep,
    get_transform_class,
    register_transform,
    registered_transforms,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "STAGES",
    "Transform",
    "TransformConfig",
    "TransformContext",
    "TransformResult",
    "Upkeep",
    "get_transform_class",
    "register_transform",
    "registered_transforms",
]
