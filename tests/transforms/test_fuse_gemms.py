"""``fuse_gemms``: linears over one input become one GEMM over concatenated weights, with the same values."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy import autodeploy
from autodeploy.pipeline import run_transform
from autodeploy.transforms import TransformConfig, TransformContext
from autodeploy.transforms.fuse_gemms import FuseGemms

LINEAR = torch.ops.autodeploy.linear.default


def linears(llm) -> int:
    return sum(1 for n in llm.graph.graph.nodes if n.op == "call_function" and "linear" in str(n.target))


def test_qkv_projections_fuse_and_compute_the_same_logits(tiny_checkpoint):
    for arch in ("llama", "qwen2"):  # qwen2's q/k/v have biases: they are concatenated too
        directory = str(tiny_checkpoint(arch))
        fused = autodeploy(directory, device="cpu")
        separate = autodeploy(directory, device="cpu", transforms={"fuse_gemms": {"enabled": False}})
        sequences = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
        for ours, theirs in zip(fused.logits(sequences), separate.logits(sequences)):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
        assert linears(separate) - linears(fused) == 2 * 2  # per layer: q, k, v → one
        names = dict(fused.graph.named_parameters())
        assert not any(name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for name in names)
        assert any(name.endswith("q_proj_k_proj_v_proj_weight") for name in names)
        assert sum(p.numel() for p in fused.graph.parameters()) == sum(p.numel() for p in separate.graph.parameters())
        assert "6 linears → 2 GEMMs" in fused.pipeline_report()


@pytest.mark.parametrize("quantize", [{"default": "int8_wo"}, {"default": "int4_wo", "int4_group_size": 32},
                                      {"default": "fp8"}], ids=["int8_wo", "int4_wo", "fp8 per channel"])
def test_quantized_projections_over_one_input_fuse_row_by_row_and_compute_the_same_logits(tiny_checkpoint, quantize):
    directory = str(tiny_checkpoint("qwen2"))  # q/k/v with biases; gate and up are separate nodes once quantized
    fused = autodeploy(directory, device="cpu", quantize=quantize)
    separate = autodeploy(directory, device="cpu", quantize=quantize, transforms={"fuse_gemms": {"enabled": False}})
    sequences = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(fused.logits(sequences), separate.logits(sequences)))
    assert linears(separate) - linears(fused) == 2 * (2 + 1)  # per layer: q, k, v → one; gate, up → one
    assert "10 linears → 4 GEMMs" in fused.pipeline_report()
    assert fused.verification.relative_error == separate.verification.relative_error  # read through the moved rows
    assert sum(p.numel() for p in fused.graph.parameters()) == sum(p.numel() for p in separate.graph.parameters())


def test_projections_with_one_scale_a_layer_stay_apart(tiny_checkpoint):
    # Per-tensor fp8: each projection's one weight scale cannot become a row of a concatenation.
    llm = autodeploy(str(tiny_checkpoint("qwen2")), device="cpu", quantize={"default": "fp8", "fp8_weight_scale": "tensor"})
    assert "no linears share an input" in llm.pipeline_report()


class _Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.randn(n, 8)) for n in (4, 6, 5))


def _graph(shared_c: bool, bias_on_b: bool = False) -> fx.GraphModule:
    root = _Three()
    if bias_on_b:
        root.b_bias = nn.Parameter(torch.randn(6))
    graph = fx.Graph()
    x = graph.placeholder("x")
    weights = {name: graph.get_attr(name) for name in "abc"}
    outs = [graph.call_function(LINEAR, (x, weights[n], graph.get_attr("b_bias") if bias_on_b and n == "b" else None))
            for n in "abc"]
    if shared_c:  # c's weight is read by another node too (a tied weight): it must stay where it is
        outs.append(graph.call_function(torch.ops.aten.sum.default, (weights["c"],)))
    graph.output(tuple(outs))
    return fx.GraphModule(root, graph)


def _fuse(gm: fx.GraphModule):
    return run_transform(FuseGemms(TransformConfig()), gm, TransformContext(settings=None))


def test_a_weight_read_elsewhere_or_a_lone_bias_keeps_its_linear_apart():
    x = torch.randn(3, 8)
    for shared_c, bias_on_b, fused_group in ((False, False, 3), (True, False, 2), (False, True, 2)):
        gm = _graph(shared_c, bias_on_b)
        expected = gm(x)
        result = _fuse(gm)
        assert result.matches == 1 and result.notes == f"{fused_group} linears → 1 GEMMs"
        assert sum(1 for n in gm.graph.nodes if n.target is LINEAR) == 3 - fused_group + 1
        for ours, theirs in zip(gm(x), expected):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    gm = _graph(False)
    _fuse(gm)
    assert [name for name, _ in gm.named_parameters()] == ["a_b_c"]  # the originals are gone: no second copy
