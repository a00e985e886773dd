"""Helpers for rewrites that walk the graph (``register_rewrite``): reject a candidate with a reason; and the
tables of aten ops that walks step through, in one place for every pattern and pass that reads them."""

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten

# ``Tensor.to`` as a model writes it: a cast that may change nothing (cleanup_noop and traced searches drop those).
TO_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten.to.device})
# Ops that change a tensor's dtype and nothing else it holds: HF's upcasts around softmax and the MoE router,
# which the attention and MoE walks step through.
DTYPE_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default})
# Reshapes of a whole tensor (no expand: that one repeats values).
VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


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


def same_size(a, b) -> bool:
    """Equal sizes for every value of the dynamic dims (symbolic sizes compared without adding guards)."""
    return statically_known_true(a == b)


def same_sizes(a, b) -> bool:
    """Equal-length size lists (shapes, strides) equal position by position, as ``same_size`` compares them."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes for every value of the dynamic dims."""
    return same_sizes(a.shape, b.shape)


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


class Walk:
    """Steps backwards through one candidate subgraph, recording every node it steps over (``nodes``: what a
    replacement removes). Pattern walks subclass it with the steps their family needs."""

    def __init__(self):
        self.nodes: set[Node] = set()

    def step(self, node, targets, what: str) -> dict:
        """Check ``node`` calls one of ``targets``, record it, return its arguments by name (defaults filled)."""
        arguments = call_arguments(node, targets, what)
        self.nodes.add(node)
        return arguments
