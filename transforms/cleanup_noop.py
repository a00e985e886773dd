"""``cleanup_noop``: remove ops that hand back their input unchanged, rewiring their users to the input.

Export leaves many behind: ``.to(torch.float32)`` on fp32 tensors, ``cos * attention_scaling`` with a scaling
of 1.0, ``x[..., :]`` slices, views to the shape a tensor already has. Each costs a launch or a copy, and
each hides the op sequence that the ``match`` stage's patterns look for.

Shapes and strides are compared symbolically with ``statically_known_true``: an op goes only when it is
the identity for *every* value of the dynamic dims, never because the example sizes happened to agree.

An op is removed in one of two cases.

* It returns its input or a view of all of it: ``view``/``reshape``/``_unsafe_view``/``expand`` to the
  same shape, a slice covering its whole dim, ``alias``, ``contiguous`` of a tensor that already is,
  ``to`` with nothing to convert (and ``copy=False``), ``dropout`` outside training or with ``p=0`` (ATen
  returns the input itself; Phi-3's export keeps one after each sublayer, between the projection and the
  residual add). The output already aliases the input, so replacing it by the input changes nothing, even
  around in-place ops.
* It returns a fresh copy equal to its input: ``clone``, ``_to_copy``, ``to(copy=True)``, ``x + 0``,
  ``x - 0``, ``x * 1``, ``x / 1`` (same dtype, device and strides, so later views still apply). Dropping
  the copy makes users share the input's memory. That is only invisible when no node writes in place
  and the copy is not a graph output (the caller owns outputs and may write into them), so copies are
  kept otherwise. ``x + 0`` also turns ``-0.0`` into ``0.0``; inference does not see the sign of zero.

``aten._assert_tensor_metadata`` nodes go too. Export inserts one before each ``.to()`` to re-check the
dtype/device it traced with; they return nothing, but as side-effecting nodes they survive dead-code
elimination, add a user to the tensor they check (breaking single-user pattern matches), and would fail
once the quantize or shard stages legitimately change a dtype or device. The metadata they assert is
already recorded in ``meta["val"]``.

``matches`` is the number of nodes removed.
"""

from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autodeploy.patterns.graph_walk import TO_CASTS, VIEWS, same_sizes
from autodeploy.transforms.registry import ALL_ROLES, Transform, TransformContext, TransformResult, register_transform

logger = logging.getLogger(__name__)

aten = torch.ops.aten
_INT64_MAX = torch.iinfo(torch.int64).max

_SHAPE_VIEWS = VIEWS | {aten.expand.default}
_COPIES = {aten.clone.default, aten._to_copy.default}
_IDENTITY_OPERAND = {
    aten.add.Tensor: 0,
    aten.add.Scalar: 0,
    aten.sub.Tensor: 0,
    aten.sub.Scalar: 0,
    aten.mul.Tensor: 1,
    aten.mul.Scalar: 1,
    aten.div.Tensor: 1,
    aten.div.Scalar: 1,
}
_CANDIDATES = {aten.slice.Tensor, aten.alias.default, aten.contiguous.default, aten.dropout.default}
_CANDIDATES |= _SHAPE_VIEWS | TO_CASTS | _COPIES
_CANDIDATES |= set(_IDENTITY_OPERAND)


def _fake_value(arg) -> FakeTensor | None:
    value = arg.meta.get("val") if isinstance(arg, Node) else None
    return value if isinstance(value, FakeTensor) else None


def _same_tensor_metadata(source: FakeTensor, result: FakeTensor) -> bool:
    """Same dtype, device, shape and strides for every value of the dynamic dims."""
    return (
        source.dtype == result.dtype
        and source.device == result.device
        and source.layout == result.layout
        and same_sizes(source.shape, result.shape)
        and same_sizes(source.stride(), result.stride())
    )


def _is_full_slice(arguments: dict, source: FakeTensor) -> bool:
    size = source.shape[arguments["dim"] % source.dim()]
    end = arguments["end"]
    end = end.meta.get("val") if isinstance(end, Node) else end
    if end is not None and not isinstance(end, (int, torch.SymInt)):
        return False
    # INT64_MAX is how export spells "to the end"; it needs no upper bound on the size to prove coverage.
    covers_end = end is None or (type(end) is int and end == _INT64_MAX) or statically_known_true(end >= size)
    return arguments["start"] in (None, 0) and arguments["step"] == 1 and covers_end


def _is_number(value, number: int) -> bool:
    return type(value) in (int, float) and value == number


def _returns_input_view(node: Node, arguments: dict, source: FakeTensor, result: FakeTensor) -> bool:
    if node.target in _SHAPE_VIEWS:
        return same_sizes(source.shape, result.shape)
    if node.target is aten.slice.Tensor:
        return _is_full_slice(arguments, source)
    if node.target is aten.alias.default:
        return True
    if node.target is aten.contiguous.default:
        return same_sizes(source.stride(), result.stride())
    if node.target is aten.dropout.default:
        return arguments["train"] is False or _is_number(arguments["p"], 0)
    if node.target in TO_CASTS:
        return not arguments["copy"] and _same_tensor_metadata(source, result)
    return False


def _returns_input_copy(node: Node, arguments: dict, source: FakeTensor, result: FakeTensor) -> bool:
    if node.target in TO_CASTS:
        copies = arguments["copy"]
    elif node.target in _IDENTITY_OPERAND:
        identity = _IDENTITY_OPERAND[node.target]
        copies = _is_number(arguments["other"], identity) and _is_number(arguments.get("alpha", 1), 1)
    else:
        copies = node.target in _COPIES
    return copies and _same_tensor_metadata(source, result)


def _writes_in_place(graph: torch.fx.Graph) -> bool:
    # detach_ is mutable in its schema but changes only autograd state (export emits it for every constant).
    return any(
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
        and node.target is not aten.detach_.default
        for node in graph.nodes
    )


@register_transform("cleanup_noop", stage="cleanup", roles=ALL_ROLES)
class CleanupNoop(Transform):
    """Replace identity views, casts, copies and arithmetic by their input; drop metadata assertions."""

    def apply(self, module: GraphModule, context: TransformContext) -> TransformResult:
        graph = module.graph
        copies_removable = not _writes_in_place(graph)
        removed = 0
        for node in [node for node in graph.nodes if node.op == "call_function"]:
            if node.target is aten._assert_tensor_metadata.default:
                graph.erase_node(node)
                removed += 1
                continue
            if node.target not in _CANDIDATES:
                continue
            source, result = _fake_value(node.args[0] if node.args else None), _fake_value(node)
            if source is None or result is None:
                continue
            normalized = node.normalized_arguments(module, normalize_to_only_use_kwargs=True)
            if normalized is None:
                continue
            arguments = normalized.kwargs
            is_output = any(user.op == "output" for user in node.users)
            if _returns_input_view(node, arguments, source, result) or (
                copies_removable and not is_output and _returns_input_copy(node, arguments, source, result)
            ):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                removed += 1
        logger.debug("cleanup_noop: removed %d nodes", removed)
        return TransformResult(matches=removed, changed=removed > 0, notes=f"removed {removed} no-op nodes")
