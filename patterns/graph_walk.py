"""Helpers for rewrites that walk the graph (``register_rewrite``): reject a candidate with a reason."""

import torch
from torch.fx import Node


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
