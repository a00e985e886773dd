"""The pattern registry: registration-time validation, selection by family/name, user patterns and rewrites."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.errors import ConfigError
from autodeploy.patterns import (
    FAMILIES,
    PatternRegistrationError,
    apply_patterns,
    register_pattern,
    register_rewrite,
    registered_patterns,
    select_patterns,
    unregister_pattern,
)
from autodeploy.patterns import mlp, norm  # noqa: F401  (the built-in patterns)
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, export_dynamic, run_transform

X, W = torch.empty(2, 3, 8), torch.empty(4, 8)


@pytest.fixture
def temporary_patterns():
    """Names registered through this list are unregistered after the test, so other tests never see them."""
    names: list[str] = []
    yield names
    for name in names:
        if name in registered_patterns():
            unregister_pattern(name)


def relu_linear(x, weight):
    return F.linear(torch.relu(x), weight)


def relu_linear_replacement(x, weight):
    return torch.ops.autodeploy.linear(torch.relu(x), weight, None)


def test_replacement_with_other_shape_is_rejected_at_registration(temporary_patterns):
    temporary_patterns.append("wrong_shape")
    with pytest.raises(PatternRegistrationError, match=r"'wrong_shape'.*replacement returns \[\(2, 3, 8\).*search returns \[\(2, 3, 4\)"):
        register_pattern("wrong_shape", relu_linear, lambda x, weight: torch.relu(x), [X, W], family="mlp")
    assert "wrong_shape" not in registered_patterns()


def test_replacement_with_other_dtype_is_rejected_at_registration(temporary_patterns):
    temporary_patterns.append("wrong_dtype")
    with pytest.raises(PatternRegistrationError, match=r"torch.bfloat16 example inputs.*float32.*bfloat16"):
        register_pattern("wrong_dtype", relu_linear, lambda x, weight: relu_linear(x, weight).float(), [X, W], family="mlp")


@pytest.mark.parametrize(
    "name, family, replace, message",
    [
        ("new_pattern", "convolution", relu_linear_replacement, "unknown family 'convolution'"),
        ("rms_norm_llama", "norm", relu_linear_replacement, "already exists"),
        ("mlp", "mlp", relu_linear_replacement, "already exists"),  # a family name
        ("new_pattern", "mlp", lambda x: x, "replace must take search's parameters"),
    ],
)
def test_invalid_registrations_are_rejected(name, family, replace, message, temporary_patterns):
    with pytest.raises(PatternRegistrationError, match=message):
        register_pattern(name, relu_linear, replace, [X, W], family=family)


def test_search_that_fails_on_its_examples_is_rejected(temporary_patterns):
    temporary_patterns.append("bad_examples")
    with pytest.raises(PatternRegistrationError, match="search or replace failed"):
        register_pattern("bad_examples", relu_linear, relu_linear_replacement, [X, torch.empty(4, 5)], family="mlp")


def test_selection_by_family_and_name_keeps_family_order():
    norms = [p.name for p in select_patterns(["norm"])]
    assert norms[:2] == ["rms_norm_gemma", "rms_norm_llama"] and "layer_norm" in norms
    selected = select_patterns(["mlp", "rms_norm_llama"], skip=["gated_mlp_relu"])
    assert selected[0].name == "rms_norm_llama"  # the norm family runs before the mlp family
    assert {p.family for p in selected[1:]} == {"mlp"} and "gated_mlp_relu" not in [p.name for p in selected]
    everything = [p.name for p in select_patterns(list(FAMILIES))]
    assert [name for name in everything if name in {p.name for p in selected}] == [p.name for p in selected]
    with pytest.raises(ConfigError, match="'nrom' is neither a pattern family"):
        select_patterns(["nrom"])
    with pytest.raises(ConfigError, match="match_patterns.skip"):
        select_patterns(["norm"], skip=["unknown"])


class ReluProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.proj(torch.relu(x)) + 1


def test_user_pattern_rewrites_an_exported_graph_with_dynamic_dims(temporary_patterns):
    temporary_patterns.append("user_relu_linear")
    register_pattern("user_relu_linear", relu_linear, relu_linear_replacement, [X, W], family="mlp")
    module = ReluProjection().eval()
    gm = export_dynamic(module, torch.randn(3, 5, 8), dynamic_dims={0: "batch", 1: "seq"})
    for name in CLEANUP_PASSES:
        run_transform(name, gm)

    counts = apply_patterns(gm, select_patterns(["user_relu_linear"]))

    assert counts == {"user_relu_linear": 1}
    targets = call_targets(gm)
    assert targets["autodeploy.linear.default"] == 1 and "aten.linear.default" not in targets
    (linear,) = gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.linear.default)
    assert str(linear.meta["val"].shape[0]).startswith("s")  # the batch dim is still symbolic
    for shape in [(2, 7, 8), (6, 1, 8)]:
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), module(x), rtol=0, atol=0)


def test_scalar_parameters_match_any_value_and_reach_the_replacement():
    eps_values = [1e-5, 3e-6]

    class TwoNorms(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))

        def forward(self, x):
            return norm.rms_norm_llama(norm.rms_norm_llama(x, self.w1, eps_values[0]), self.w2, eps_values[1])

    gm = export_dynamic(TwoNorms().eval(), torch.randn(3, 5, 8), dynamic_dims={0: "batch", 1: "seq"})
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    assert apply_patterns(gm, select_patterns(["rms_norm_llama"])) == {"rms_norm_llama": 2}
    ops = gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.rms_norm.default)
    assert sorted(node.args[2] for node in ops) == sorted(eps_values)


def test_rewrite_written_as_code_is_selected_like_a_pattern(temporary_patterns):
    def tanh_to_sigmoid(gm):
        nodes = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.tanh.default)
        for node in nodes:  # tanh(x) = 2 * sigmoid(2x) - 1
            with gm.graph.inserting_before(node):
                twice = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node.args[0], 2.0))
                sigmoid = gm.graph.call_function(torch.ops.aten.sigmoid.default, (twice,))
                scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (sigmoid, 2.0))
                result = gm.graph.call_function(torch.ops.aten.sub.Tensor, (scaled, 1.0))
            node.replace_all_uses_with(result)
            gm.graph.erase_node(node)
        gm.recompile()
        return len(nodes)

    temporary_patterns.append("tanh_as_sigmoid")
    register_rewrite("tanh_as_sigmoid", tanh_to_sigmoid, family="attention")
    assert "tanh_as_sigmoid" in [p.name for p in select_patterns(["attention"])]
    module = nn.Tanh()
    gm = export_dynamic(module, torch.randn(3, 5), dynamic_dims={0: "batch"})
    assert apply_patterns(gm, select_patterns(["tanh_as_sigmoid"])) == {"tanh_as_sigmoid": 1}
    x = torch.randn(4, 5)
    torch.testing.assert_close(gm(x), torch.tanh(x))
