"""propagate_shapes recomputes node values on the graph's own fake mode, keeping dynamic dims symbolic."""

import re

import pytest
import torch
from torch import nn
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from autodeploy.errors import TransformError
from autodeploy.transforms import shape_propagation
from autodeploy.transforms.shape_propagation import propagate_shapes
from tests.transforms.cleanup_harness import export_dynamic

aten = torch.ops.aten


# Seen on the GPU machine's torch 2.11 (not on 2.13): propagation keeps values right but the batch/seq
# symbols get specialised to the example sizes. Strict, so a fix (or a newer torch there) is noticed.
SYMBOLS_SPECIALISE = pytest.mark.xfail(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch < 2.13 specialises dynamic dims during fake propagation (notes/gpu_checks.md)",
    strict=True,
)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):  # [batch, seq, 16]
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 4).unbind(2)
        scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1)
        return (scores.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(x.shape[0], x.shape[1], 16)


def _describe(value) -> tuple:
    """Shape and strides as the symbolic expressions they are, plus dtype and device."""
    return tuple(map(str, value.shape)), tuple(map(str, value.stride())), value.dtype, value.device


def _tensor_values(gm) -> dict:
    return {node.name: _describe(node.meta["val"]) for node in gm.graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)}


@SYMBOLS_SPECIALISE
def test_restores_cleared_and_corrupted_values_symbolically():
    gm = export_dynamic(Attention(), torch.randn(2, 3, 16), dynamic_dims={0: "batch", 1: "seq"})
    expected = _tensor_values(gm)
    nodes = {node.name: node for node in gm.graph.nodes}
    matmul = next(node for node in gm.graph.nodes if node.target is aten.matmul.default)
    output_node = gm.graph.find_nodes(op="output")[0].args[0][0]
    batch, seq = nodes["x"].meta["val"].shape[:2]
    assert isinstance(batch, torch.SymInt) and isinstance(seq, torch.SymInt)
    del matmul.meta["val"]
    with nodes["x"].meta["val"].fake_mode:
        output_node.meta["val"] = torch.empty(2, 3, 16, dtype=torch.float16)  # wrong: static, half
    assert _tensor_values(gm) != expected

    assert propagate_shapes(gm) is gm

    assert _tensor_values(gm) == expected
    fake_mode = nodes["x"].meta["val"].fake_mode
    assert all(node.meta["val"].fake_mode is fake_mode for node in (matmul, output_node)), "the graph's mode was not reused"
    assert output_node.meta["val"].dtype == torch.float32
    assert list(output_node.meta["val"].shape[:2]) == [batch, seq]  # the very same symbols, not example sizes
    assert re.fullmatch(r"s\d+", str(matmul.meta["val"].shape[0]))


@SYMBOLS_SPECIALISE
def test_fills_values_of_nodes_a_rewrite_added():
    gm = export_dynamic(Attention(), torch.randn(2, 3, 16), dynamic_dims={0: "batch", 1: "seq"})
    x = gm.graph.find_nodes(op="placeholder")[0]
    output = gm.graph.find_nodes(op="output")[0]
    with gm.graph.inserting_before(output):
        pooled = gm.graph.call_function(aten.sum.dim_IntList, (output.args[0][0], [1]))
        scaled = gm.graph.call_function(aten.mul.Tensor, (pooled, 2.0))
    output.args = ((scaled,),)
    gm.recompile()

    propagate_shapes(gm)

    batch = x.meta["val"].shape[0]
    assert pooled.meta["val"].shape == (batch, 16) and scaled.meta["val"].shape == (batch, 16)
    assert isinstance(scaled.meta["val"].shape[0], torch.SymInt)


@SYMBOLS_SPECIALISE
def test_parameters_on_the_meta_device():
    with torch.device("meta"):
        model = Attention()
        example = torch.empty(2, 3, 16)
    gm = export_dynamic(model, example, dynamic_dims={0: "batch", 1: "seq"})
    expected = _tensor_values(gm)
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            node.meta.pop("val", None)

    propagate_shapes(gm)

    assert _tensor_values(gm) == expected
    assert all(value[3] == torch.device("meta") for value in expected.values())


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_attributes_are_faked_even_when_the_mode_refuses_real_tensors(device):
    """A graph traced by hand or by make_fx has a FakeTensorMode that rejects real tensors; parameters still work."""
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    assert not fake_mode.allow_non_fake_inputs
    rows = shape_env.create_unspecified_symint_and_symbol(3, ConstantSource("rows"), DimDynamic.DYNAMIC)
    root = nn.Module()
    root.weight = nn.Parameter(torch.randn(8, 16, device=device))
    graph = Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("weight")
    linear = graph.call_function(aten.linear.default, (x, weight))
    graph.output(linear)
    with fake_mode:
        x.meta["val"] = torch.empty_strided((rows, 16), (16, 1), device=device)
    gm = GraphModule(root, graph)

    propagate_shapes(gm)

    assert linear.meta["val"].shape == (rows, 8) and linear.meta["val"].device.type == device
    assert weight.meta["val"].fake_mode is fake_mode


def test_a_placeholder_without_value_is_a_clear_error():
    gm = export_dynamic(Attention(), torch.randn(2, 3, 16), dynamic_dims={0: "batch", 1: "seq"})
    del gm.graph.find_nodes(op="placeholder")[0].meta["val"]
    with pytest.raises(TransformError, match="placeholder.*x.*meta\\['val'\\]"):
        propagate_shapes(gm)


def test_docstring_example_runs():
    example = re.search(r"```python\n(.*?)```", shape_propagation.__doc__, re.DOTALL).group(1)
    exec(compile(example, "shape_propagation example", "exec"), {})
