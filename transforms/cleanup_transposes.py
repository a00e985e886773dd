"""``cleanup_transposes``: fold chains of ``transpose``/``permute`` and drop the ones that undo each other.

HF attention code moves heads in and out of dim 1 with ``transpose(1, 2)``; after export, and after other
passes rewire the graph, two such moves often meet. Every ``transpose``/``permute`` is read as a
permutation (negative dims normalised), and a node applied to another one is composed with it:

* ``transpose(transpose(x, a, b), a, b)``, ``transpose(transpose(x, a, b), b, a)``, or any pair of
  permutations composing to the identity → ``x``;
* a composition that is not the identity → one ``permute(x, composed)``, when the inner node has no
  other user (otherwise both would be kept and the graph would grow);
* a single ``transpose(x, a, a)`` or identity ``permute`` → ``x``.

Nodes are visited in graph order, so a longer chain folds step by step into one permute. These ops are
views, so rewiring never changes values, strides or aliasing. ``matches`` is the number of rewrites.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule, Node

from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)

aten = torch.ops.aten


def permutation(node) -> list[int] | None:
    """The input dims ``node`` picks, in order, if it is a transpose/permute (negative dims normalised)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target is aten.permute.default:
        rank = len(node.args[1])
        return [dim % rank for dim in node.args[1]]
    if node.target is not aten.transpose.int:
        return None
    # A transpose names two dims; its rank comes from its value.
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    rank = value.dim()
    first, second = (dim % rank for dim in node.args[1:3])
    dims = list(range(rank))
    dims[first], dims[second] = dims[second], dims[first]
    return dims


def _is_identity(dims: list[int]) -> bool:
    return dims == list(range(len(dims)))


@register_transform("cleanup_transposes", stage="cleanup", roles=ALL_ROLES)
class CleanupTransposes(Transform):
    """Remove transpose/permute pairs that cancel and fold the others into a single permute."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        graph = module.graph
        rewrites = folded = 0
        for node in [node for node in graph.nodes if node.op == "call_function"]:
            dims = permutation(node)
            if dims is None:
                continue
            inner = node.args[0]
            inner_dims = permutation(inner)
            if inner_dims is not None:
                # node picks dim dims[i] of inner, which is dim inner_dims[dims[i]] of inner's input.
                dims = [inner_dims[dim] for dim in dims]
                source = inner.args[0]
            else:
                source = inner
            if _is_identity(dims):
                node.replace_all_uses_with(source)
            elif inner_dims is not None and len(inner.users) == 1:
                with graph.inserting_before(node):
                    permute = graph.call_function(aten.permute.default, (source, dims))
                # The composed permute computes exactly the value of the node it replaces (a view of the
                # same source in the same order), so it takes that node's metadata, value included.
                permute.meta.update(node.meta)
                node.replace_all_uses_with(permute)
                folded += 1
            else:
                continue
            graph.erase_node(node)
            if inner_dims is not None and not inner.users:
                graph.erase_node(inner)
            rewrites += 1
        logger.debug("cleanup_transposes: %d rewrites (%d folded into one permute)", rewrites, folded)
        notes = f"{rewrites} rewrites, {folded} folded into one permute"
        return TransformResult(matches=rewrites, changed=rewrites > 0, notes=notes)


@register_transform("refold_transposes", stage="cache", roles=ALL_ROLES)
class RefoldTransposes(CleanupTransposes):
    """``cleanup_transposes`` once more, after the cache stage (YAML: ``refold_transposes: {stage: cache}``).

    ``insert_cached_attention`` hands its op q, k and v as ``[1, T, H, D]`` and its output back in HF's
    ``[B, H, S, D]``, so each attention layer meets HF's own head transposes back to back: eight per layer
    of Llama that undo each other. Views cost nothing on a GPU inside a CUDA graph, but each is a few
    microseconds of dispatch in an eager CPU step.
    """
