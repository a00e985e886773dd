"""``fuse_gate_up``: gated MLPs become fused_gated_mlp over one gate/up weight, with the same values."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy import autodeploy
from autodeploy.pipeline import run_transform
from autodeploy.transforms import TransformConfig, TransformContext
from autodeploy.transforms.fuse_gate_up import FuseGateUp
from tests.patterns.tiny_family_configs_attention import tiny_family_model

GATED_MLP = torch.ops.autodeploy.gated_mlp.default
FUSED_GATED_MLP = torch.ops.autodeploy.fused_gated_mlp.default
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]


def _ops(llm, name: str) -> int:
    """Nodes running a backend of canonical op ``name`` (after select)."""
    prefix = f"autodeploy.{name}_"
    return sum(1 for n in llm.graph.graph.nodes if n.op == "call_function" and str(n.target).startswith(prefix))


def _parameters(llm) -> dict[str, torch.Tensor]:
    return dict(llm.graph.named_parameters())


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma2")
    tiny_family_model("gemma2").save_pretrained(directory)  # gelu_tanh gated MLPs between Gemma's 4 norms
    return directory


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # silu and gelu_tanh; Phi-3's one gate_up weight: below
def test_gated_mlps_fuse_and_serve_the_same_logits(arch, request):
    if arch == "llama":  # the shared default deploy is the fused one
        directory, fused = request.getfixturevalue("llama_dir"), request.getfixturevalue("llama_llm")
    else:
        directory = request.getfixturevalue("gemma2_dir")
        fused = autodeploy(str(directory), device="cpu")
    separate = autodeploy(str(directory), device="cpu", transforms={"fuse_gate_up": {"enabled": False}})
    for ours, theirs in zip(fused.logits(SEQUENCES), separate.logits(SEQUENCES)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert (_ops(fused, "fused_gated_mlp"), _ops(fused, "gated_mlp")) == (2, 0)
    assert (_ops(separate, "fused_gated_mlp"), _ops(separate, "gated_mlp")) == (0, 2)
    names = _parameters(fused)
    assert not any(name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")) for name in names)
    assert sum(name.endswith("mlp.gate_proj_up_proj_weight") for name in names) == 2
    assert sum(p.numel() for p in names.values()) == sum(p.numel() for p in _parameters(separate).values())
    assert "2 gated MLPs → one gate/up GEMM each" in fused.pipeline_report()


class _Weights(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(6, 8))
        self.gate_up, self.down = nn.Parameter(torch.randn(12, 8)), nn.Parameter(torch.randn(8, 6))


def _graph(form: str) -> fx.GraphModule:
    """One gated_mlp over x, its gate/up weights in ``form``."""
    root = _Weights()
    graph = fx.Graph()
    x = graph.placeholder("x")
    down = graph.get_attr("down")
    outputs = []
    if form in ("halves", "swapped halves"):  # Phi-3, as the match stage leaves it: chunk(gate_up, 2)
        chunk = graph.call_function(torch.ops.aten.chunk.default, (graph.get_attr("gate_up"), 2))
        first, second = (graph.call_function(operator.getitem, (chunk, i)) for i in (0, 1))
        gate, up = (first, second) if form == "halves" else (second, first)
    elif form == "one node for both":
        gate = up = graph.get_attr("gate")
    else:
        gate, up = graph.get_attr("gate"), graph.get_attr("up")
        if form == "gate read elsewhere":
            outputs.append(graph.call_function(torch.ops.aten.sum.default, (gate,)))
    outputs.append(graph.call_function(GATED_MLP, (x, gate, up, down, "gelu_tanh")))
    graph.output(tuple(outputs))
    gm = fx.GraphModule(root, graph)  # holds the parameters the graph reads, and no others
    if form == "gate under two names":  # a tied parameter: deleting one name would keep the tensor alive
        gm.register_parameter("tied", gm.gate)
    return gm


def _fuse(gm: fx.GraphModule):
    return run_transform(FuseGateUp(TransformConfig()), gm, TransformContext(settings=None))


@pytest.mark.parametrize(
    "form, fused, parameters",
    [
        ("separate", True, ["down", "gate_up"]),
        ("halves", True, ["down", "gate_up"]),
        ("gate read elsewhere", False, None),
        ("one node for both", False, None),
        ("gate under two names", False, None),
        ("swapped halves", False, None),
    ],
)
def test_only_gate_up_weights_of_its_own_are_fused(form, fused, parameters):
    gm = _graph(form)
    x = torch.randn(3, 8)
    expected = gm(x)
    before = [name for name, _ in gm.named_parameters()]
    result = _fuse(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (FUSED_GATED_MLP in targets, GATED_MLP in targets) == (fused, not fused)
    assert result.matches == int(fused) and result.changed == fused
    kept = "no gated MLP has gate/up weights of its own; 1 left as gated_mlp (gate/up weights shared, or not one pair)"
    assert result.notes == ("1 gated MLPs → one gate/up GEMM each" if fused else kept)
    if fused:
        assert [name for name, _ in gm.named_parameters()] == parameters  # no second copy of gate or up
        assert torch.ops.aten.chunk.default not in targets and operator.getitem not in targets
    else:
        assert [name for name, _ in gm.named_parameters()] == before
    for ours, theirs in zip(gm(x), expected):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
