"""``fuse_add_rms_norm`` (stage ``fuse``): a residual add and the RMSNorm of its sum become one ``add_rms_norm``.

A pre-norm decoder layer ends each sublayer with ``h = residual + out`` and normalises ``h`` for the next
sublayer (or for the LM head), while ``h`` itself feeds the next residual add. Unfused, the add writes
``h`` and the norm reads it back; ``autodeploy.add_rms_norm`` reads both operands once and writes the
norm and the sum. Per decoder layer two adds fuse: the one before the post-attention norm and the one
before the next layer's input norm (the last layer's: before the final norm).

Matched: an ``autodeploy.rms_norm`` whose input is ``aten.add.Tensor(a, b)`` with ``alpha=1`` and ``a``,
``b`` and the sum of one shape and dtype (either operand order). The sum may have other users; they read
the fused op's second output. Not matched, and named in the report: an add that broadcasts or promotes
dtypes, scales by ``alpha``, or adds a constant. A cast between the add and the norm (a model that
normalises an upcast sum) is not a residual add feeding the norm, so that norm is left as it is.

    # YAML: transforms: {fuse_add_rms_norm: {enabled: false}} keeps the adds and norms separate
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx import GraphModule

from autodeploy.custom_ops.add_rms_norm import add_rms_norm_fake
from autodeploy.patterns.graph_walk import NoMatch, call_arguments, is_call, node_value, require, same_shape
from autodeploy.transforms.registry import Transform, TransformContext, TransformResult, register_transform

ADD = torch.ops.aten.add.Tensor
RMS_NORM = torch.ops.autodeploy.rms_norm.default
ADD_RMS_NORM = torch.ops.autodeploy.add_rms_norm.default


def _residual_operands(norm: fx.Node, add: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The two tensors ``add`` sums for ``norm``, when the pair can become one ``add_rms_norm``; else ``NoMatch``."""
    arguments = call_arguments(add, {ADD}, "an add")
    require(arguments["alpha"] == 1, f"{add.name} scales its second operand (alpha={arguments['alpha']})")
    operands = arguments["input"], arguments["other"]
    require(all(isinstance(o, fx.Node) for o in operands), f"{add.name} adds a constant")
    total = node_value(add)
    for operand in map(node_value, operands):
        require(operand.dtype == total.dtype and same_shape(operand, total),
                f"{add.name} broadcasts or promotes its operands ({tuple(operand.shape)} {operand.dtype} "
                f"to {tuple(total.shape)} {total.dtype})")
    # The fused op takes the norm's place: every other reader of the sum must come after it.
    node = add.next
    while node is not norm:
        require(node not in add.users, f"{node.name} reads {add.name} before {norm.name} does")
        node = node.next
    return operands


def _fuse(graph: fx.Graph, norm: fx.Node, norm_arguments: dict, x: fx.Node, residual: fx.Node) -> None:
    add, weight, eps, weight_offset = (norm_arguments[k] for k in ("x", "weight", "eps", "weight_offset"))
    with graph.inserting_before(norm):
        fused = graph.call_function(ADD_RMS_NORM, (x, residual, weight, eps, weight_offset))
        normed = graph.call_function(operator.getitem, (fused, 0))
        # The last layer's sum feeds only the final norm: no output node for it.
        total = graph.call_function(operator.getitem, (fused, 1)) if len(add.users) > 1 else None
    # Module stacks (what the match report and verification read): the fused op and its norm output are
    # the norm module's, the sum is the decoder layer's, as the nodes they replace.
    for new, old in ((fused, norm), (normed, norm), (total, add)):
        if new is not None:
            new.meta.update({key: value for key, value in old.meta.items() if key != "val"})
    x_value, residual_value = node_value(x), node_value(residual)
    with detect_fake_mode([x_value]) or contextlib.nullcontext():
        fused.meta["val"] = add_rms_norm_fake(x_value, residual_value, weight.meta.get("val"), eps, weight_offset)
    normed.meta["val"] = fused.meta["val"][0]
    norm.replace_all_uses_with(normed)
    graph.erase_node(norm)
    if total is not None:
        total.meta["val"] = fused.meta["val"][1]
        add.replace_all_uses_with(total)
    graph.erase_node(add)


@register_transform("fuse_add_rms_norm", stage="fuse")
class FuseAddRmsNorm(Transform):
    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        graph = module.graph
        fused, kept_apart = 0, []
        for norm in list(graph.find_nodes(op="call_function", target=RMS_NORM)):
            arguments = call_arguments(norm, {RMS_NORM}, "rms_norm")
            if not is_call(arguments["x"], {ADD}):
                continue
            try:
                x, residual = _residual_operands(norm, arguments["x"])
            except NoMatch as reason:
                kept_apart.append(f"{norm.name} kept apart from its add: {reason}")
                continue
            _fuse(graph, norm, arguments, x, residual)
            fused += 1
        notes = f"{fused} residual adds + rms_norm → add_rms_norm" if fused else "no residual add fused into an rms_norm"
        if kept_apart:
            notes += f" ({len(kept_apart)} kept apart, see details)"
        return TransformResult(matches=fused, changed=bool(fused), notes=notes, details=kept_apart)
