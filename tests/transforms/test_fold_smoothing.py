"""``fold_smoothing``: smoothquant's input smoothing moved into the norm or up projection before it, same values."""

from __future__ import annotations


import pytest
import torch
from torch import fx, nn

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight
from autodeploy.pipeline import run_transform
from autodeploy.transforms import TransformConfig, TransformContext
from autodeploy.transforms.fold_smoothing import FoldSmoothing

ops = torch.ops.autodeploy
H, N, I = 32, 24, 40


def _smoothquant(module: nn.Module, name: str, rows: int, columns: int, smooth: torch.Tensor, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    stored = quantize_weight(QuantScheme("smoothquant"), torch.randn(rows, columns, generator=gen),
                             {"max_abs": torch.rand(columns, generator=gen) * 4 + 0.5})
    stored["smooth"] = smooth
    for role in ("qweight", "scale", "smooth"):
        module.register_parameter(f"{name}_{role}", nn.Parameter(stored[role], requires_grad=False))
    return [f"{name}_{role}" for role in ("qweight", "scale", "smooth")]


def _graph(norm: str, offset: float = 0.0, extra_reader: bool = False, same_smoothing: bool = True):
    """x → norm → two smoothquant projections (q, k); act(gate(x)) · up(x) → a smoothquant down projection."""
    module = nn.Module()
    gen = torch.Generator().manual_seed(1)
    smooth = torch.rand(H, generator=gen) + 0.5
    module.register_parameter("norm_weight", nn.Parameter(torch.rand(H, generator=gen) + 0.5, requires_grad=False))
    module.register_parameter("norm_bias", nn.Parameter(torch.randn(H, generator=gen), requires_grad=False))
    q = _smoothquant(module, "q", N, H, smooth, 2)
    k = _smoothquant(module, "k", N, H, smooth if same_smoothing else smooth * 2, 3)
    gate_w, up_w = torch.randn(I, H, generator=gen), torch.randn(I, H, generator=gen)
    module.register_parameter("gate_weight", nn.Parameter(gate_w, requires_grad=False))
    up = quantize_weight(QuantScheme("int8_wo"), up_w)
    module.register_parameter("up_qweight", nn.Parameter(up["qweight"], requires_grad=False))
    module.register_parameter("up_scale", nn.Parameter(up["scale"], requires_grad=False))
    down = _smoothquant(module, "down", H, I, torch.rand(I, generator=gen) + 0.5, 4)
    graph = fx.Graph()
    x = graph.placeholder("x")
    get = lambda name: graph.get_attr(name)  # noqa: E731
    if norm == "rms_norm":
        normed = graph.call_function(ops.rms_norm.default, (x, get("norm_weight"), 1e-6, offset))
    elif norm == "add_rms_norm":
        fused = graph.call_function(ops.add_rms_norm.default, (x, x, get("norm_weight"), 1e-6, offset))
        normed = graph.call_function(__import__("operator").getitem, (fused, 0))
    else:
        normed = graph.call_function(ops.layer_norm.default, (x, get("norm_weight"), get("norm_bias"), 1e-5))
    outputs = [graph.call_function(ops.int8_w8a8_linear.default, (normed, *map(get, names), None)) for names in (q, k)]
    if extra_reader:
        outputs.append(graph.call_function(torch.ops.aten.neg.default, (normed,)))
    gate = graph.call_function(ops.linear.default, (x, get("gate_weight"), None))
    up_out = graph.call_function(ops.int8_wo_linear.default, (x, get("up_qweight"), get("up_scale"), None))
    hidden = graph.call_function(ops.gated_activation.default, (gate, up_out, "silu"))
    outputs.append(graph.call_function(ops.int8_w8a8_linear.default, (hidden, *map(get, down), None)))
    graph.output(tuple(outputs))
    return fx.GraphModule(module, graph)


def _fold(gm):
    context = TransformContext(settings=None)
    result = run_transform(FoldSmoothing(TransformConfig()), gm, context)
    return result, context.folded_smoothing


@pytest.mark.parametrize("norm, offset", [("rms_norm", 0.0), ("rms_norm", 1.0), ("add_rms_norm", 1.0), ("layer_norm", 0.0)],
                         ids=["rms_norm", "gemma weight_offset", "add_rms_norm", "layer_norm"])
def test_smoothing_moves_into_the_norm_and_the_up_projection_with_the_same_outputs(norm, offset):
    gm = _graph(norm, offset)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(9)) * 3
    before = gm(x)
    smooths = {name: gm.get_parameter(name).clone() for name in ("q_smooth", "k_smooth", "down_smooth")}
    up_scale = gm.get_parameter("up_scale").clone()
    result, folded = _fold(gm)
    assert result.matches == 2 and "3 of 3 smoothquant projections" in result.notes
    assert all(n.args[3] is None for n in gm.graph.find_nodes(op="call_function", target=ops.int8_w8a8_linear.default))
    assert not any(name.endswith("smooth") for name, _ in gm.named_parameters())
    assert set(folded) == {*smooths, "up_scale"}  # what verification reads instead: the quantize stage's tensors
    assert all(torch.equal(folded[name], tensor) for name, tensor in smooths.items()) and torch.equal(folded["up_scale"], up_scale)
    after = gm(x)
    for ours, theirs in zip(after, before):  # float32: the same int8 roundings, up to the last bits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra_reader, same_smoothing, reason", [(True, True, "read by other ops too"),
                                                                  (False, False, "smoothing differs")])
def test_smoothing_stays_in_the_ops_where_a_fold_would_change_another_reader(extra_reader, same_smoothing, reason):
    gm = _graph("rms_norm", extra_reader=extra_reader, same_smoothing=same_smoothing)
    weight = gm.get_parameter("norm_weight").clone()
    result, _ = _fold(gm)
    assert result.matches == 1 and any(reason in d for d in result.details)  # the down projection's still folds
    assert torch.equal(gm.get_parameter("norm_weight"), weight)
    projections = list(gm.graph.find_nodes(op="call_function", target=ops.int8_w8a8_linear.default))
    assert [n.args[3] is None for n in projections] == [False, False, True]


def test_a_graph_without_weights_keeps_its_smoothing():
    # autodeploy inspect on the meta device: nothing to multiply yet, so nothing moves.
    gm = _graph("rms_norm").to("meta")
    result = run_transform(FoldSmoothing(TransformConfig()), gm, TransformContext(settings=None))
    assert not result.changed and "meta device" in result.notes
    assert all(n.args[3] is not None for n in gm.graph.find_nodes(op="call_function", target=ops.int8_w8a8_linear.default))
