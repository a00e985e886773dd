"""``build_model`` (stage ``factory``): the Hugging Face config becomes the Hugging Face model on the meta device,
in the deployment's dtype (``autodeploy/models/factory.py`` builds it); export then traces it."""

from __future__ import annotations

import torch

from autodeploy.models.factory import ModelFactory
from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformResult, register_transform


@register_transform("build_model", stage="factory", recompile=False, roles=ALL_ROLES)
class BuildModel(Transform):
    """HF config → HF model on the meta device, in the deployment dtype."""

    def apply(self, module, context) -> TransformResult:
        factory: ModelFactory = context.model_factory
        model = factory.build_meta_model(getattr(torch, context.settings.dtype))
        n_params = sum(p.numel() for p in model.parameters())
        return TransformResult(
            changed=True, module=model, notes=f"{type(model).__name__}, {n_params / 1e9:.3g}B params, {context.settings.dtype}"
        )
