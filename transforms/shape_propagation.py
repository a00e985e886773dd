"""Recompute every node's ``meta["val"]`` (a fake tensor, sizes symbolic) after a graph rewrite.

Passes read shapes, dtypes and strides from ``node.meta["val"]``. A transform that adds nodes calls
``propagate_shapes`` so the new nodes, and everything downstream of them, carry correct values again.
The graph runs once on fake tensors: the placeholders' existing values are the inputs, and their
``FakeTensorMode`` (with its ``ShapeEnv``) is reused, so the ``batch``/``seq`` dims stay the same symbols
instead of being re-specialised to example sizes.

```python
import torch
from autodeploy.export.export import export_to_graph_module
from autodeploy.transforms.shape_propagation import propagate_shapes

gm = export_to_graph_module(
    torch.nn.Linear(4, 8), (torch.randn(3, 4),), dynamic_shapes=({0: torch.export.Dim("batch")},)
)
linear = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
del linear.meta["val"]
propagate_shapes(gm)
print(linear.meta["val"].shape)  # torch.Size([s31, 8]): the batch dim is still a symbol
```
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule
from torch.fx import Interpreter

from autodeploy.errors import TransformError


class _FakeValuePropagation(Interpreter):
    """Run the graph on fake tensors in the graph's own mode and store each node's result as its value.

    Placeholders keep the fake values they already carry (their symbols are the graph's dynamic
    dims). Parameters and other ``get_attr`` tensors are faked with static shapes. Written on the
    plain ``Interpreter`` because ``FakeTensorProp`` re-snapshots placeholder values, which on torch
    2.11 replaced the symbolic sizes by the example sizes.
    """

    def __init__(self, gm: GraphModule, mode: FakeTensorMode):
        super().__init__(gm)
        self._mode = mode

    def run_node(self, node):
        # export's input-guard module computes no value; it only checks eager calls' inputs.
        if node.op == "call_module" and node.target == "_guards_fn":
            return None
        if node.op == "placeholder":
            super().run_node(node)  # consumes the positional input
            return node.meta["val"]
        with self._mode:
            result = super().run_node(node)
        if node.op != "output":
            node.meta["val"] = result
        return result

    def get_attr(self, target: str, args: tuple, kwargs: dict) -> Any:
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            value = self._mode.from_tensor(value, static_shapes=True)
        return value


def propagate_shapes(gm: GraphModule) -> GraphModule:
    """Set ``node.meta["val"]`` of every node of ``gm`` from its placeholders' fake values; returns ``gm``.

    Raises ``TransformError`` when a placeholder has no ``meta["val"]`` (the graph did not come from
    ``torch.export`` or a pass dropped it), since there is then no shape environment to reuse.
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    missing = [node.name for node in placeholders if "val" not in node.meta]
    if missing:
        raise TransformError(
            f"cannot propagate shapes: placeholder(s) {', '.join(missing)} carry no meta['val']; "
            "export the model with autodeploy.export (torch.export) so inputs have fake values"
        )
    inputs = [node.meta["val"] for node in placeholders]
    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None:
        raise TransformError(
            "cannot propagate shapes: no placeholder holds a fake tensor, so there is no FakeTensorMode to reuse"
        )
    # Guards evaluated while propagating must not narrow the graph's dims: on torch 2.11 they
    # specialised batch/seq to the example sizes. The graph's own guards were settled at export.
    shape_env = fake_mode.shape_env
    with shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext():
        _FakeValuePropagation(gm, fake_mode).run(*inputs)
    return gm


def infer_values(gm: GraphModule, nodes: list) -> None:
    """Set ``meta["val"]`` of just ``nodes`` (in graph order, each after its inputs) from their inputs'
    values, for a pass that inserted them where the nodes around keep their values. Unlike a whole-graph
    :func:`propagate_shapes` this never recomputes a value the export produced: on torch 2.11 re-running
    the rotary angles specialised their dims to the example sizes."""
    values = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder") if "val" in n.meta]
    fake_mode = detect_fake_mode(values)
    if fake_mode is None:
        raise TransformError("cannot infer values: no placeholder holds a fake tensor, so there is no FakeTensorMode")
    shape_env = fake_mode.shape_env
    with shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext():
        for node in nodes:
            if node.op == "get_attr":
                value = operator.attrgetter(node.target)(gm)
                node.meta["val"] = fake_mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value
                continue
            if node.op != "call_function":
                raise TransformError(f"cannot infer the value of {node.op} node {node.name}")
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta["val"])
            with fake_mode:
                node.meta["val"] = node.target(*args, **kwargs)
