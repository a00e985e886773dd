"""cleanup_noop removes exactly the ops that are the identity for every value of the dynamic dims."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch._dynamo.source import ConstantSource

from autodeploy.transforms import TransformContext
from tests.transforms.cleanup_harness import call_targets, export_dynamic, run_transform

aten = torch.ops.aten
INT64_MAX = 2**63 - 1


class EveryNoop(nn.Module):
    """One of each no-op the pass removes, beside look-alikes that it must keep."""

    def forward(self, x):
        b, n, d = x.shape
        y = x.view(b, n, d).reshape(b, n, -1)
        y = aten._unsafe_view(y, [b, n, d])
        y = aten.alias(y).expand(b, n, d)
        y = y.to(torch.float32)
        y = (y + 0) - 0
        y = (y * 1) / 1
        y = y.clone().tanh()
        kept = x.transpose(1, 2).contiguous().transpose(1, 2)  # a real copy: makes a transposed tensor contiguous
        kept = kept + x.to(torch.float16).float()  # a real cast
        kept = kept + x.reshape(n, b, d).sum()  # a real reshape (b and n differ)
        kept = kept + x[:, :1].expand(b, n, d).clone() * 2  # clone of an expanded tensor changes its strides
        return y + kept, x.clone()  # a copy returned to the caller is kept


def test_removes_every_noop_kind_and_keeps_real_ops():
    x = torch.randn(3, 5, 4)
    gm = export_dynamic(EveryNoop(), x, dynamic_dims={0: "batch", 1: "seq"})
    before = call_targets(gm)

    result = run_transform("cleanup_noop", gm)

    removed = before - call_targets(gm)
    assert removed == Counter(
        {
            "aten._assert_tensor_metadata.default": before["aten._assert_tensor_metadata.default"],
            "aten.view.default": 1,
            "aten.reshape.default": 1,
            "aten._unsafe_view.default": 1,
            "aten.alias.default": 1,
            "aten.expand.default": 1,
            "aten.to.dtype": 1,
            "aten.add.Tensor": 1,
            "aten.sub.Tensor": 1,
            "aten.mul.Tensor": 1,
            "aten.div.Tensor": 1,
            "aten.clone.default": 1,
        }
    )
    assert before["aten._assert_tensor_metadata.default"] >= 2
    assert result.matches == sum(removed.values()) and result.changed
    kept = call_targets(gm)
    assert kept["aten.contiguous.default"] == 1 and kept["aten.clone.default"] == 2 and kept["aten.reshape.default"] == 1
    for shape in [(3, 5, 4), (7, 3, 4)]:  # export guards batch % seq != 0 (from the reshape)
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), EveryNoop()(x), rtol=0, atol=0)


class SymbolicSlices(nn.Module):
    def forward(self, x):
        return x[:, : x.shape[0]] * 2, x[:5] * 3


class Dropouts(nn.Module):
    """Dropout as an exported eval-mode model keeps it (Phi-3: after each sublayer): outside training, or
    with p = 0, ATen hands back the input; in training with p > 0 it is random and must stay."""

    def forward(self, x):
        y = aten.dropout(x, 0.1, False) + 1
        y = aten.dropout(y, 0.0, True) * 2
        return aten.dropout(y, 0.5, True)


def test_dropout_goes_outside_training_or_at_p_zero_only():
    gm = export_dynamic(Dropouts(), torch.randn(3, 4), dynamic_dims={0: "batch"})
    assert call_targets(gm)["aten.dropout.default"] == 3

    run_transform("cleanup_noop", gm)

    dropouts = [n for n in gm.graph.nodes if n.target is aten.dropout.default]
    assert [(n.args[1], n.args[2]) for n in dropouts] == [(0.5, True)]


def test_a_phi3_deployment_keeps_no_dropout(tmp_path):
    from autodeploy import autodeploy
    from tests.coverage_models import eager_reference_model

    eager_reference_model("phi3").save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", verify={"enabled": False})
    assert not [n for n in llm.graph.graph.nodes if "dropout" in str(n.target)]


def test_slice_is_removed_only_when_full_for_every_dynamic_size():
    # rows >= 5 > 4 columns, so the first slice is full for every size; the second only for rows == 5.
    x = torch.randn(5, 4)
    gm = export_dynamic(SymbolicSlices(), x, dynamic_dims={0: "rows"}, min_size=5)
    assert call_targets(gm)["aten.slice.Tensor"] == 2

    result = run_transform("cleanup_noop", gm)

    assert result.matches == 1 and call_targets(gm)["aten.slice.Tensor"] == 1
    x = torch.randn(7, 4)
    full, first_five = gm(x)
    assert first_five.shape == (5, 4)
    torch.testing.assert_close((full, first_five), SymbolicSlices()(x), rtol=0, atol=0)


def test_example_sized_coincidences_are_not_noops():
    """Rows are dynamic with an example size of 4: a [rows, 4] → [4, rows] reshape and a [:4] slice look like
    identities at the example but are not, so both stay; the full slices and same-shape view go; no guard is added."""
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    rows = shape_env.create_unspecified_symint_and_symbol(4, ConstantSource("rows"), DimDynamic.DYNAMIC)
    graph = Graph()
    x = graph.placeholder("x")
    size = graph.call_function(aten.sym_size.int, (x, 0))
    transposed_shape = graph.call_function(aten.reshape.default, (x, [4, size]))
    first_four = graph.call_function(aten.slice.Tensor, (x, 0, 0, 4))
    all_rows = graph.call_function(aten.slice.Tensor, (x, 0, 0, INT64_MAX))
    up_to_size = graph.call_function(aten.slice.Tensor, (x, 0, None, size))
    same_shape = graph.call_function(aten.view.default, (x, [size, 4]))
    graph.output((transposed_shape, first_four, all_rows, up_to_size, same_shape))
    with fake_mode:
        x.meta["val"] = torch.empty_strided((rows, 4), (4, 1))
        size.meta["val"] = rows
        transposed_shape.meta["val"] = torch.empty_strided((4, rows), (rows, 1))
        first_four.meta["val"] = torch.empty_strided((4, 4), (4, 1))
        all_rows.meta["val"] = x.meta["val"]
        up_to_size.meta["val"] = x.meta["val"]
        same_shape.meta["val"] = x.meta["val"]
    gm = GraphModule(nn.Module(), graph)
    guards_before = list(shape_env.guards)

    result = run_transform("cleanup_noop", gm)

    assert result.matches == 3
    assert call_targets(gm) == Counter({"aten.sym_size.int": 1, "aten.reshape.default": 1, "aten.slice.Tensor": 1})
    assert shape_env.guards == guards_before, "the pass guarded on (specialised) a dynamic dim"
    x = torch.randn(6, 4)
    reshaped, sliced, everything, up_to_rows, viewed = gm(x)
    assert reshaped.shape == (4, 6) and sliced.shape == (4, 4)
    assert everything is x and up_to_rows is x and viewed is x


class CloneThenWriteInPlace(nn.Module):
    def forward(self, x):
        y = x.clone()
        y.add_(1)
        return y * 1 + x


def test_copies_stay_when_the_graph_writes_in_place():
    x = torch.randn(3, 4)
    gm = export_dynamic(CloneThenWriteInPlace(), x, dynamic_dims={0: "batch"})
    before = call_targets(gm)
    assert before["aten.add_.Tensor"] == 1

    run_transform("cleanup_noop", gm)

    assert call_targets(gm)["aten.clone.default"] == before["aten.clone.default"] == 1
    original = x.clone()
    torch.testing.assert_close(gm(x), CloneThenWriteInPlace()(original), rtol=0, atol=0)
    torch.testing.assert_close(x, original, rtol=0, atol=0)


NOOPS = {
    "view": lambda x: x.view(x.shape),
    "reshape": lambda x: x.reshape(x.shape[0], x.shape[1], -1),
    "unsafe_view": lambda x: aten._unsafe_view(x, x.shape),
    "expand": lambda x: x.expand(x.shape),
    "slice": lambda x: x[:, :, : x.shape[2]],
    "alias": lambda x: aten.alias(x),
    "to": lambda x: x.to(x.dtype),
    "add_zero": lambda x: x + 0,
    "sub_zero": lambda x: x - 0,
    "mul_one": lambda x: x * 1,
    "div_one": lambda x: x / 1,
    "clone": lambda x: x.clone(),
    "contiguous": lambda x: x.contiguous(),
}
REAL_OPS = {
    "transpose": lambda x: x.transpose(1, 2),
    "swap_outer": lambda x: x.transpose(0, 2),
    "tanh": torch.tanh,
    "affine": lambda x: x * 2 + 1,
    "to_half_and_back": lambda x: x.half().float(),
}


class Program(nn.Module):
    def __init__(self, ops: list[str]):
        super().__init__()
        self.ops = ops

    def forward(self, x):
        for op in self.ops:
            x = {**NOOPS, **REAL_OPS}[op](x)
        return x


sizes = st.integers(2, 6)


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(NOOPS) + sorted(REAL_OPS)), min_size=1, max_size=8),
    example_shape=st.tuples(sizes, sizes, sizes),
    other_shape=st.tuples(sizes, sizes, sizes),
    seed=st.integers(0, 2**16),
)
def test_outputs_unchanged_for_random_programs(ops, example_shape, other_shape, seed):
    torch.manual_seed(seed)
    program = Program(ops)
    gm = export_dynamic(program, torch.randn(example_shape), dynamic_dims={0: "a", 1: "b", 2: "c"})
    nodes_before = len(gm.graph.nodes)

    run_transform("cleanup_noop", gm)

    assert len(gm.graph.nodes) <= nodes_before
    assert "aten._assert_tensor_metadata.default" not in call_targets(gm)
    assert run_transform("cleanup_noop", gm).matches == 0, "a second run still found no-ops"
    for shape in (example_shape, other_shape):
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), program(x), rtol=0, atol=0)


def test_pipeline_rejects_a_module_that_is_not_a_graph():
    from autodeploy.errors import TransformError
    from autodeploy.pipeline import Pipeline
    from autodeploy.transforms import TransformConfig, get_transform_class

    pipeline = Pipeline([get_transform_class("cleanup_noop")(TransformConfig())])
    with pytest.raises(TransformError, match="needs the exported graph, got Linear"):
        pipeline.run(TransformContext(settings=None), nn.Linear(2, 2))
