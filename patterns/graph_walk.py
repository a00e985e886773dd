"""Helpers for rewrites that walk the graph (``register_rewrite``): reject a candidate with a reason."""

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function


class NoMatch(Exception):
    """The subgraph under inspection is not what the rewrite expresses; the message says why."""


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise NoMatch(reason)


def node_value(node) -> torch.Tensor:
    """The fake tensor a node carries; ``NoMatch`` when it has none."""
    value = node.meta.get("val") if isinstance(node, Node) else None
    require(isinstance(value, torch.Tensor), f"{node} carries no tensor value")
    return value


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes for every value of the dynamic dims (symbolic sizes compared without adding guards)."""
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def is_call(node, targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def call_arguments(node, targets, what: str) -> dict:
    """Check ``node`` calls one of ``targets`` and return its arguments by name (defaults filled)."""
    require(is_call(node, targets), f"{node} is not {what}")
    if not isinstance(node.target, torch._ops.OpOverload):
        return {}
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    require(normalized is not None, f"cannot read the arguments of {node}")
    return normalized.kwargs
