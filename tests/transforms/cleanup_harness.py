"""Shared by the cleanup-pass tests: export a small module with dynamic dims, run a pass, count ops."""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule

from autodeploy.export.export import export_to_graph_module
from autodeploy import pipeline
from autodeploy.transforms import TransformContext, TransformResult, get_transform_class

CLEANUP_PASSES = ("cleanup_noop", "cleanup_transposes", "cleanup_dead_code")


def export_dynamic(
    module: torch.nn.Module, *args: torch.Tensor, dynamic_dims: dict[int, str], min_size: int = 2
) -> GraphModule:
    """Export ``module`` with the listed dims of every input dynamic, e.g. ``{0: "batch", 1: "seq"}``.

    Dynamic dims range over ``[min_size, 64]``; examples must lie inside and avoid 0 and 1, which export specialises.
    """
    dims = {index: torch.export.Dim(name, min=min_size, max=64) for index, name in dynamic_dims.items()}
    return export_to_graph_module(module.eval(), args, dynamic_shapes=tuple(dims for _ in args))


def run_transform(name: str, gm: GraphModule) -> TransformResult:
    transform_class = get_transform_class(name)
    return pipeline.run_transform(transform_class(transform_class.config_class()), gm, TransformContext(settings=None))


def call_targets(gm: GraphModule) -> Counter:
    """How many ``call_function`` nodes each op has, keyed by the op's name (``aten.view.default``); a
    canonical op's backend (``autodeploy.moe_torch.default`` after select) counts as the canonical op."""
    from autodeploy.custom_ops import op_by_target

    def name(target) -> str:
        found = op_by_target(target)
        return str(found[0].op) if found is not None else str(target)

    return Counter(name(node.target) for node in gm.graph.nodes if node.op == "call_function")
