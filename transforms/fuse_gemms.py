"""``fuse_gemms`` (stage ``fuse``): linears that read the same input become one GEMM over concatenated weights.

The q, k and v projections of an attention layer (and any other group of canonical ``linear`` nodes with
one input, one weight dtype and, for all or none of them, a bias) read the same activations: one GEMM
over ``cat(weights)`` reads those activations once and launches once, and at decode batch sizes one wide
GEMM streams its weights closer to the card's bandwidth than three narrow ones. Its output is split back
(``aten.split_with_sizes``, views: no copy) into the values the old nodes gave, so nothing downstream
changes; the kernels downstream take strided q/k/v.

It runs after ``load_weights``: the concatenated weight replaces the originals in the module (they are
deleted, so no second copy is kept; the peak is one group's weights more). Weights read by any other node
(tied embeddings) are left alone. The graph then holds, per layer, ``linear(x, <...>.q_proj_k_proj_v_proj.weight)``;
the ``select`` stage and the autotuner treat it like any linear.

    # YAML: transforms: {fuse_gemms: {enabled: false}} keeps every projection separate
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx import GraphModule

from autodeploy.transforms.parameter_concatenation import concatenate_parameters
from autodeploy.transforms.registry import Transform, TransformConfig, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)

LINEAR = torch.ops.autodeploy.linear.default


@dataclass
class FuseGemmsConfig(TransformConfig):
    stage: str = "fuse"


def _own_parameter(node: fx.Node | None) -> bool:
    """A weight or bias this linear alone reads, straight from the module."""
    return node is not None and node.op == "get_attr" and len(node.users) == 1


def _groups(gm: GraphModule) -> list[list[fx.Node]]:
    """Linears to fuse: same input, weight dtype and input size, biases on all or none, weights their own."""
    by_input: dict[tuple, list[fx.Node]] = defaultdict(list)
    parameters = dict(gm.named_parameters(remove_duplicate=False))
    for node in gm.graph.find_nodes(op="call_function", target=LINEAR):
        x, weight, bias = node.args
        if not _own_parameter(weight) or (bias is not None and not (_own_parameter(bias) and bias.target in parameters)):
            continue
        tensor = parameters.get(weight.target)
        if tensor is None or tensor.dim() != 2:
            continue
        by_input[(x, tensor.dtype, tensor.shape[1], bias is None)].append(node)
    return [nodes for nodes in by_input.values() if len(nodes) > 1]


def _fuse(gm: GraphModule, nodes: list[fx.Node]) -> None:
    graph = gm.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    nodes = sorted(nodes, key=order.__getitem__)
    x = nodes[0].args[0]
    sizes = [gm.get_parameter(n.args[1].target).shape[0] for n in nodes]
    values = [n.meta.get("val") for n in nodes]
    weight_target, weight = concatenate_parameters(gm, [n.args[1].target for n in nodes])
    bias_target = bias = None
    if nodes[0].args[2] is not None:
        bias_target, bias = concatenate_parameters(gm, [n.args[2].target for n in nodes])
    with graph.inserting_before(nodes[0]):
        weight_node = graph.get_attr(weight_target)
        bias_node = graph.get_attr(bias_target) if bias_target else None
        fused = graph.call_function(LINEAR, (x, weight_node, bias_node))
        parts = graph.call_function(torch.ops.aten.split_with_sizes.default, (fused, sizes, -1))
        outputs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(nodes))]
    # Module stacks and the like (what verification names a diverging module by): each output keeps its
    # linear's; the fused GEMM and its split take the first one's.
    for new in (fused, parts):
        new.meta.update({k: v for k, v in nodes[0].meta.items() if k != "val"})
    for node, output in zip(nodes, outputs):
        output.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    fake_mode = detect_fake_mode([v for v in values if v is not None])
    if fake_mode is not None and all(v is not None for v in values):
        with fake_mode:
            fused.meta["val"] = torch.cat(values, dim=-1)
            parts.meta["val"] = list(torch.split(fused.meta["val"], sizes, dim=-1))
            weight_node.meta["val"] = fake_mode.from_tensor(weight)
            if bias_node is not None:
                bias_node.meta["val"] = fake_mode.from_tensor(bias)
        for output, value in zip(outputs, parts.meta["val"]):
            output.meta["val"] = value
    for node, output in zip(nodes, outputs):
        node.replace_all_uses_with(output)
        old_parameters = [a for a in node.args[1:] if a is not None]
        graph.erase_node(node)
        for parameter in old_parameters:
            graph.erase_node(parameter)


@register_transform("fuse_gemms")
class FuseGemms(Transform):
    config_class = FuseGemmsConfig

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        groups = _groups(module)
        for nodes in groups:
            _fuse(module, nodes)
        if groups:
            module.graph.lint()
            module.recompile()
        fused = sum(len(g) for g in groups)
        shapes = sorted({len(g) for g in groups})
        return TransformResult(
            matches=len(groups), changed=bool(groups),
            notes=f"{fused} linears → {len(groups)} GEMMs" if groups else "no linears share an input",
            details=[f"groups of {', '.join(map(str, shapes))} linears over one input, weights concatenated"] if groups else [],
        )
