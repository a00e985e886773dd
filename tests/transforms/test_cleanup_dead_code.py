"""cleanup_dead_code removes unused pure nodes and unread submodules/tensors, and keeps side effects."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.transforms.cleanup_harness import call_targets, export_dynamic, run_transform


class WithDeadCode(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused_layer = nn.Linear(4, 4)
        self.unused_weight = nn.Parameter(torch.randn(4))
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("unused_buffer", torch.zeros(3))

    def forward(self, x):
        torch.relu(x) * 3  # computed, never used
        self.calls.add_(1)  # unused result, but a side effect
        return self.used(x) + torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_removes_dead_nodes_and_unread_attributes_and_keeps_side_effects():
    model = WithDeadCode()
    gm = export_dynamic(model, torch.randn(3, 4), dynamic_dims={0: "batch"})
    before, nodes_before = call_targets(gm), len(gm.graph.nodes)
    get_attrs_before = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    assert {"unused_weight", "unused_layer.weight", "unused_buffer"} <= get_attrs_before

    result = run_transform("cleanup_dead_code", gm)

    assert before - call_targets(gm) == Counter({"aten.relu.default": 1, "aten.mul.Tensor": 1})
    # 2 ops + the get_attrs of unused_weight, unused_layer.weight/.bias and unused_buffer.
    assert result.matches == nodes_before - len(gm.graph.nodes) == 6
    assert {node.target for node in gm.graph.nodes if node.op == "get_attr"} == get_attrs_before - {
        "unused_weight",
        "unused_layer.weight",
        "unused_layer.bias",
        "unused_buffer",
    }
    assert not hasattr(gm, "unused_layer") and not hasattr(gm, "unused_weight") and not hasattr(gm, "unused_buffer")
    assert hasattr(gm, "used") and hasattr(gm, "calls") and hasattr(gm, "_guards_fn")
    assert result.notes.endswith("1 submodules, 2 unused tensors")

    x = torch.randn(5, 4)
    calls = gm.calls.item()
    output = gm(x)
    assert gm.calls.item() == calls + 1, "the in-place buffer update was removed"
    torch.testing.assert_close(output, model(x), rtol=0, atol=0)


def test_export_input_guards_survive():
    # _guards_fn has no users; only its side effect (rejecting inputs outside the exported ranges) matters.
    gm = export_dynamic(WithDeadCode(), torch.randn(3, 4), dynamic_dims={0: "batch"})
    run_transform("cleanup_dead_code", gm)
    with pytest.raises(AssertionError, match="Guard failed"):
        gm(torch.randn(65, 4))  # batch is exported with max=64


def test_nothing_to_remove_is_reported_unchanged():
    gm = export_dynamic(nn.Linear(4, 4), torch.randn(3, 4), dynamic_dims={0: "batch"})
    run_transform("cleanup_dead_code", gm)
    code = gm.code

    result = run_transform("cleanup_dead_code", gm)

    assert (result.matches, result.changed) == (0, False) and gm.code == code


class DeadBranches(nn.Module):
    """Computes ``n_dead`` chains the output ignores, each ``depth`` ops long."""

    def __init__(self, n_dead: int, depth: int):
        super().__init__()
        self.n_dead, self.depth = n_dead, depth

    def forward(self, x):
        for branch in range(self.n_dead):
            dead = x
            for _ in range(self.depth):
                dead = torch.sin(dead) + branch
        return torch.cos(x)


@settings(max_examples=25, deadline=None)
@given(n_dead=st.integers(0, 4), depth=st.integers(1, 3), rows=st.integers(2, 9))
def test_removes_exactly_the_dead_branches(n_dead, depth, rows):
    gm = export_dynamic(DeadBranches(n_dead, depth), torch.randn(rows, 3), dynamic_dims={0: "batch"})

    result = run_transform("cleanup_dead_code", gm)

    assert result.matches == 2 * n_dead * depth  # a sin and an add per step
    assert set(call_targets(gm)) <= {"aten.cos.default"}
    x = torch.randn(rows + 1, 3)
    torch.testing.assert_close(gm(x), torch.cos(x), rtol=0, atol=0)
