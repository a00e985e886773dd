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

Quantized projections of one scheme fuse alike, where every tensor the op takes after ``x`` holds a row per
output feature (each scheme names those ops: ``QuantMethod.row_wise_ops``): ``int8_wo_linear`` (int8 rows, a
scale each), ``int4_wo_linear`` (packed rows, their group scales and zero points; one group size),
``fp8_linear`` with a scale per channel and ``int8_w8a8_linear`` whose smoothing ``fold_smoothing`` moved into
the norm before it. Each of those tensors
is concatenated along its rows, so every output feature is computed exactly as before. Under quantization
the gate and up projections are separate nodes over one input, so they fuse here too. Schemes that hold a
tensor per input column (``int4_awq``'s and ``smoothquant``'s smoothing) or one scale per layer (static
fp8, per-tensor fp8) stay apart. Where each projection's rows went is kept in
``context.concatenated_parameters`` (old target → new target, first row, rows): verification reads a quantized
weight's stored tensors by the names the quantize stage gave them.

    # YAML: transforms: {fuse_gemms: {enabled: false}} keeps every projection separate
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx import GraphModule

from autodeploy.custom_ops.quantized_linear import row_wise_ops
from autodeploy.transforms.parameter_concatenation import concatenate_parameters
from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)

LINEAR = torch.ops.autodeploy.linear.default


def _own_parameter(node: fx.Node | None) -> bool:
    """A weight or bias this linear alone reads, straight from the module."""
    return node is not None and node.op == "get_attr" and len(node.users) == 1


def _row_tensors(node: fx.Node, parameters: dict) -> list[torch.Tensor | None] | None:
    """The tensors ``node`` takes after ``x`` (None for a missing bias), when each is a parameter of its own
    with a row per output feature (the weight's rows); else None."""
    tensors = []
    for argument in node.args[1:]:
        if argument is None:
            tensors.append(None)
            continue
        if not _own_parameter(argument) or argument.target not in parameters:
            return None
        tensors.append(parameters[argument.target])
    weight = tensors[0]
    if weight is None or weight.dim() != 2 or any(t is not None and t.shape[0] != weight.shape[0] for t in tensors):
        return None
    return tensors


def _groups(gm: GraphModule) -> list[list[fx.Node]]:
    """Projections to fuse: one op and input, the same dtypes and per-row shapes of every tensor (so the
    same input size and, for int4, group size), biases on all or none, tensors their own."""
    by_input: dict[tuple, list[fx.Node]] = defaultdict(list)
    parameters = dict(gm.named_parameters(remove_duplicate=False))
    # Ops whose every argument after x is a row-per-output-feature tensor (the bias last, or None), but for the
    # per-input-column arguments each quantization scheme names (which must then be None).
    for target, columns in {LINEAR: (), **row_wise_ops()}.items():
        for node in gm.graph.find_nodes(op="call_function", target=target):
            if any(node.args[index] is not None for index in columns):  # e.g. smoothquant's smoothing [K]
                continue
            tensors = _row_tensors(node, parameters)
            if tensors is None:
                continue
            layout = tuple(None if t is None else (t.dtype, tuple(t.shape[1:])) for t in tensors)
            by_input[(target, node.args[0], layout)].append(node)
    return [nodes for nodes in by_input.values() if len(nodes) > 1]


def _fuse(gm: GraphModule, nodes: list[fx.Node]) -> dict[str, tuple[str, int, int]]:
    """Fuse ``nodes``; returns where each concatenated tensor's rows went (old target → new, first row, rows)."""
    graph = gm.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    nodes = sorted(nodes, key=order.__getitem__)
    x, op = nodes[0].args[0], nodes[0].target
    sizes = [gm.get_parameter(n.args[1].target).shape[0] for n in nodes]
    values = [n.meta.get("val") for n in nodes]
    concatenated = [None if nodes[0].args[i] is None else concatenate_parameters(gm, [n.args[i].target for n in nodes])
                    for i in range(1, len(nodes[0].args))]
    firsts = [sum(sizes[:j]) for j in range(len(nodes))]  # each projection's first row in a concatenation
    moved = {node.args[i].target: (found[0], first, rows)
             for i, found in enumerate(concatenated, start=1) if found is not None
             for node, first, rows in zip(nodes, firsts, sizes)}
    with graph.inserting_before(nodes[0]):
        tensor_nodes = [None if c is None else graph.get_attr(c[0]) for c in concatenated]
        fused = graph.call_function(op, (x, *tensor_nodes))
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
            for tensor_node, found in zip(tensor_nodes, concatenated):
                if tensor_node is not None:
                    tensor_node.meta["val"] = fake_mode.from_tensor(found[1])
        for output, value in zip(outputs, parts.meta["val"]):
            output.meta["val"] = value
    for node, output in zip(nodes, outputs):
        node.replace_all_uses_with(output)
        old_parameters = [a for a in node.args[1:] if a is not None]
        graph.erase_node(node)
        for parameter in old_parameters:
            graph.erase_node(parameter)
    return moved


@register_transform("fuse_gemms", stage="fuse", roles=ALL_ROLES)
class FuseGemms(Transform):
    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        groups = _groups(module)
        moved = context.concatenated_parameters
        for nodes in groups:
            moved.update(_fuse(module, nodes))
        fused = sum(len(g) for g in groups)
        shapes = sorted({len(g) for g in groups})
        ops = sorted({str(g[0].target).removeprefix("autodeploy.").removesuffix(".default") for g in groups})
        return TransformResult(
            matches=len(groups), changed=bool(groups),
            notes=f"{fused} linears → {len(groups)} GEMMs" if groups else "no linears share an input",
            details=[f"groups of {', '.join(map(str, shapes))} projections over one input ({', '.join(ops)}), "
                     f"their tensors concatenated"] if groups else [],
        )
