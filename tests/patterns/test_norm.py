"""Norm patterns on the norm modules Hugging Face and PyTorch ship, exported with dynamic batch/seq dims."""

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from autodeploy.patterns import apply_patterns, select_patterns
from autodeploy.patterns import norm  # noqa: F401  (registers the norm patterns)
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, export_dynamic, run_transform

HIDDEN = 48


class NativeLayerNorm(nn.LayerNorm):
    """A LayerNorm the way decomposed graphs spell it."""

    def forward(self, x):
        return torch.native_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)[0]


class NotANorm(nn.Module):
    """RMSNorm's ops, but scaled by an activation instead of a weight vector: must stay as it is."""

    def forward(self, x):
        hidden = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x.sigmoid() * hidden


class CubeMeanNorm(nn.Module):
    """Same shape of graph, other literal (``pow(x, 3)``): must stay as it is."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6))


def _randomized(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()
    return module.eval()


def _export_and_match(module: nn.Module, x: torch.Tensor):
    gm = export_dynamic(module, x, dynamic_dims={0: "batch", 1: "seq"})
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    counts = apply_patterns(gm, select_patterns(["norm"]))
    return gm, {name: count for name, count in counts.items() if count}


CASES = {
    "llama": (lambda: LlamaRMSNorm(HIDDEN, eps=1e-5), "rms_norm_llama", (1e-5,)),
    "gemma": (lambda: GemmaRMSNorm(HIDDEN, eps=1e-6), "rms_norm_gemma", (1e-6, 1.0)),
    # T5's spelling has no cast of x before its multiply: without casts (float32) it is Llama's.
    "t5": (lambda: T5LayerNorm(HIDDEN, eps=1e-6), {torch.float32: "rms_norm_llama", torch.bfloat16: "rms_norm_t5"}, (1e-6,)),
    "layer_norm": (lambda: nn.LayerNorm(HIDDEN, eps=1e-5), "layer_norm", (1e-5,)),
    "layer_norm_no_bias": (lambda: nn.LayerNorm(HIDDEN, eps=1e-4, bias=False), "layer_norm_no_bias", (None, 1e-4)),
    "layer_norm_no_affine": (lambda: nn.LayerNorm(HIDDEN, elementwise_affine=False), "layer_norm_no_affine", (None, None, 1e-5)),
    "native_layer_norm": (lambda: NativeLayerNorm(HIDDEN), "native_layer_norm", (1e-5,)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_module_becomes_one_canonical_op(case, dtype):
    make, pattern, trailing_args = CASES[case]
    pattern = pattern[dtype] if isinstance(pattern, dict) else pattern
    module = _randomized(make()).to(dtype)
    gm, counts = _export_and_match(module, torch.randn(3, 5, HIDDEN, dtype=dtype))

    assert counts == {pattern: 1}
    canonical = torch.ops.autodeploy.rms_norm.default if pattern.startswith("rms") else torch.ops.autodeploy.layer_norm.default
    assert [name for name in call_targets(gm) if not name.startswith("aten.sym_size")] == [str(canonical)]
    (op,) = gm.graph.find_nodes(op="call_function", target=canonical)
    assert tuple(op.args[-len(trailing_args):]) == trailing_args  # eps (and Gemma's weight offset) read from the graph
    for shape in [(1, 1, HIDDEN), (4, 9, HIDDEN)]:
        x = torch.randn(shape, dtype=dtype)
        with torch.no_grad():
            expected = module(x)
        tolerance = 0 if dtype == torch.float32 else 1e-2  # Llama rounds before the weight multiply, the op after
        torch.testing.assert_close(gm(x), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("module", [NotANorm(), CubeMeanNorm()], ids=["activation_as_weight", "other_literal"])
def test_look_alikes_are_not_matched(module):
    _, counts = _export_and_match(module.eval(), torch.randn(3, 5, HIDDEN))
    assert counts == {}


def test_per_head_norm_on_four_dim_tensor():
    """Qwen3's q/k norm: weight over the head dim of a [B, S, H, D] tensor."""
    module = _randomized(LlamaRMSNorm(16, eps=1e-6))
    gm, counts = _export_and_match(module, torch.randn(3, 5, 4, 16))
    assert counts == {"rms_norm_llama": 1}
    x = torch.randn(2, 7, 4, 16)
    torch.testing.assert_close(gm(x), module(x), rtol=0, atol=0)
