"""``fuse_fp8_quantization``: fp8 linears' per-token rounding moved into the norm or gated activation before
them, the same bits out."""

from __future__ import annotations

import collections
import operator
from types import SimpleNamespace

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy import autodeploy
from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight
from autodeploy.pipeline import run_transform
from autodeploy.transforms import TransformConfig, TransformContext
from autodeploy.transforms.fuse_fp8_quantization import FuseFp8Quantization

ops = torch.ops.autodeploy
H, N, I = 32, 24, 40


def _graph(extra_reader: bool = False) -> fx.GraphModule:
    """add_rms_norm → q and k (fp8); the residual sum → gate and up (fp8) → gated_activation → down (fp8)."""
    module = nn.Module()
    gen = torch.Generator().manual_seed(1)
    module.register_parameter("norm_weight", nn.Parameter(torch.rand(H, generator=gen) + 0.5, requires_grad=False))
    for name, rows, columns, per_channel in [("q", N, H, True), ("k", N, H, False), ("gate", I, H, True),
                                             ("up", I, H, True), ("down", H, I, True)]:
        stored = quantize_weight(QuantScheme("fp8", per_channel=per_channel), torch.randn(rows, columns, generator=gen))
        for role in ("qweight", "scale"):
            module.register_parameter(f"{name}_{role}", nn.Parameter(stored[role], requires_grad=False))
    graph = fx.Graph()
    x, residual = graph.placeholder("x"), graph.placeholder("residual")
    linear = lambda name, inp: graph.call_function(  # noqa: E731
        ops.fp8_linear.default, (inp, graph.get_attr(f"{name}_qweight"), graph.get_attr(f"{name}_scale"), None))
    norm = graph.call_function(ops.add_rms_norm.default, (x, residual, graph.get_attr("norm_weight"), 1e-6, 0.0))
    normed, total = (graph.call_function(operator.getitem, (norm, i)) for i in range(2))
    outputs = [linear("q", normed), linear("k", normed), total]
    if extra_reader:
        outputs.append(graph.call_function(torch.ops.aten.neg.default, (normed,)))
    hidden = graph.call_function(ops.gated_activation.default, (linear("gate", total), linear("up", total), "silu"))
    outputs.append(linear("down", hidden))
    graph.output(tuple(outputs))
    gm = fx.GraphModule(module, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(torch.empty(5, H)) for _ in range(2)))
    return gm


def _targets(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target).removeprefix("autodeploy.").removesuffix(".default")
                               for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)


def test_the_norm_and_the_gated_activation_round_for_their_fp8_linears_with_the_same_bits():
    gm = _graph()
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(5, H, generator=gen) * 3, torch.randn(5, H, generator=gen)
    before = gm(x, residual)
    result = run_transform(FuseFp8Quantization(TransformConfig()), gm, TransformContext(settings=None))
    assert result.matches == 2 and not result.details
    # q and k share the norm's one rounding (per-channel and per-tensor weight scales alike); gate and up
    # read the residual sum, which nothing rounds, so they keep theirs.
    assert _targets(gm) == {"add_rms_norm_fp8": 1, "gated_activation_fp8": 1, "fp8_prequantized_linear": 3,
                            "fp8_linear": 2}
    for ours, theirs in zip(gm(x, residual), before, strict=True):
        assert torch.equal(ours, theirs)


def test_a_float32_gpu_deploy_keeps_each_fp8_linears_own_rounding():
    # There fp8_linear's GEMV sums in float32; no fast fp8_prequantized_linear kernel writes float32.
    gm = _graph()
    on_gpu = TransformContext(settings=SimpleNamespace(device="cuda"))
    result = run_transform(FuseFp8Quantization(TransformConfig()), gm, on_gpu)
    assert result.matches == 0 and _targets(gm)["fp8_linear"] == 5
    on_cpu = TransformContext(settings=SimpleNamespace(device="cpu"))
    assert run_transform(FuseFp8Quantization(TransformConfig()), gm, on_cpu).matches == 2


def test_a_norm_that_another_op_reads_keeps_its_output_and_is_named():
    gm = _graph(extra_reader=True)
    result = run_transform(FuseFp8Quantization(TransformConfig()), gm, TransformContext(settings=None))
    assert result.matches == 1  # the gated activation's still fuses
    assert any("add_rms_norm" in d and "neg" in d for d in result.details), result.details
    assert _targets(gm)["add_rms_norm"] == 1 and _targets(gm)["fp8_linear"] == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_deploy_fuses_its_roundings_and_serves_the_unfused_logits(tiny_checkpoint, dtype):
    settings = dict(device="cpu", dtype=dtype, quantize={"default": "fp8"},
                    backends={op: ["reference"] for op in ("add_rms_norm", "gated_activation", "rms_norm")})
    llm = autodeploy(str(tiny_checkpoint("llama")), **settings)
    unfused = autodeploy(str(tiny_checkpoint("llama")), **settings, transforms={"fuse_fp8_quantization": {"enabled": False}})
    ops_used = collections.Counter(str(n.target).split(".")[1] for n in llm.graph.graph.nodes
                                   if n.op == "call_function" and "autodeploy" in str(n.target))
    # Per layer: q/k/v after the input norm (an add_rms_norm past layer 0), gate/up after the post-attention
    # norm, down after the gated activation; o_proj reads attention and keeps its own rounding.
    assert ops_used["add_rms_norm_fp8"] == 3 and ops_used["gated_activation_fp8"] == 2
    assert sum(count for op, count in ops_used.items() if op.startswith("fp8_prequantized_linear")) == 5
    sequences = [[3, 4, 5, 6], list(range(10, 40))]
    for ours, theirs in zip(llm.logits(sequences), unfused.logits(sequences)):
        assert torch.equal(ours, theirs)


def test_the_autotuner_draws_e4m3_rows_for_a_prequantized_linear():
    # select_kernels times backends on random activations: e4m3 ones are drawn in float32, then rounded.
    from autodeploy.transforms.select_kernels import _Problem, _TokenShapes

    gm = _graph()
    run_transform(FuseFp8Quantization(TransformConfig()), gm, TransformContext(settings=None))
    (linear, *_) = gm.graph.find_nodes(op="call_function", target=ops.fp8_prequantized_linear.default)
    problem = _Problem(linear, gm, _TokenShapes(gm), torch.device("cpu"))
    assert problem.tunable() is None
    x_q, x_scale, *rest = problem.make_inputs(5)
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == (5, H) and x_scale.dtype == torch.float32
    assert ops.fp8_prequantized_linear(x_q, x_scale, *rest).shape == (5, N)
