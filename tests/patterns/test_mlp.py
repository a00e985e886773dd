"""MLP patterns on Hugging Face's MLP modules, for every activation the canonical ops support."""

import pytest
import torch
from torch import nn
from transformers import GPTNeoXConfig, LlamaConfig, Phi3Config
from transformers.activations import ACT2FN
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from autodeploy.patterns import apply_patterns, select_patterns
from autodeploy.patterns import mlp  # noqa: F401  (registers the MLP patterns)
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, export_dynamic, run_transform

HIDDEN, INNER = 32, 48
HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


class BiaslessMLP(nn.Module):
    def __init__(self, hidden_act: str, out_features: int = HIDDEN):
        super().__init__()
        self.up = nn.Linear(HIDDEN, INNER, bias=False)
        self.down = nn.Linear(INNER, out_features, bias=False)
        self.act = ACT2FN[hidden_act]

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _make(form: str, hidden_act: str) -> nn.Module:
    sizes = dict(hidden_size=HIDDEN, intermediate_size=INNER, hidden_act=hidden_act)
    if form == "gated":
        return LlamaMLP(LlamaConfig(**sizes))
    if form == "fused_gated":
        return Phi3MLP(Phi3Config(**sizes))
    if form == "bias":
        return GPTNeoXMLP(GPTNeoXConfig(**sizes, num_attention_heads=4))
    return BiaslessMLP(hidden_act)


PATTERN_NAMES = {"gated": "gated_mlp_{}", "fused_gated": "fused_gated_mlp_{}", "bias": "mlp_{}_bias", "plain": "mlp_{}"}


def _export_and_match(module: nn.Module):
    gm = export_dynamic(module.eval(), torch.randn(3, 5, HIDDEN), dynamic_dims={0: "batch", 1: "seq"})
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    counts = apply_patterns(gm, select_patterns(["mlp"]))
    return gm, {name: count for name, count in counts.items() if count}


@pytest.mark.parametrize("activation", HF_ACTIVATIONS)
@pytest.mark.parametrize("form", PATTERN_NAMES)
def test_mlp_module_becomes_one_canonical_op(form, activation):
    torch.manual_seed(0)
    module = _make(form, HF_ACTIVATIONS[activation])
    gm, counts = _export_and_match(module)

    assert counts == {PATTERN_NAMES[form].format(activation): 1}
    canonical = torch.ops.autodeploy.mlp.default if form in ("bias", "plain") else torch.ops.autodeploy.gated_mlp.default
    (op,) = gm.graph.find_nodes(op="call_function", target=canonical)
    assert op.args[-1] == activation
    assert "aten.linear.default" not in call_targets(gm)
    for shape in [(1, 1, HIDDEN), (4, 9, HIDDEN)]:
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), module(x), rtol=1e-6, atol=1e-6)


def test_mlp_that_changes_the_width_is_not_matched():
    """The ops return x's shape; a down projection to another width stays as exported."""
    _, counts = _export_and_match(BiaslessMLP("silu", out_features=HIDDEN + 8))
    assert counts == {}


@pytest.mark.parametrize(("feed_forward_proj", "pattern", "canonical"),
                         [("relu", "mlp_relu", "mlp"), ("gated-gelu", "gated_mlp_gelu_new", "gated_mlp")])
def test_t5s_mlps_become_canonical_ops(feed_forward_proj, pattern, canonical):
    """T5 v1.0's ReLU MLP, and v1.1's gated ``gelu_new`` (transformers spells its formula out in ops: the canonical
    ``gelu_tanh``, equal to float32 rounding)."""
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5LayerFF

    torch.manual_seed(0)
    config = T5Config(d_model=HIDDEN, d_ff=INNER, feed_forward_proj=feed_forward_proj)
    module = T5LayerFF(config).DenseReluDense
    gm, counts = _export_and_match(module)
    assert counts == {pattern: 1}
    (op,) = gm.graph.find_nodes(op="call_function", target=getattr(torch.ops.autodeploy, canonical).default)
    assert op.args[-1] == ("relu" if canonical == "mlp" else "gelu_tanh")
    x = torch.randn(4, 9, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), module(x), rtol=1e-6, atol=1e-6)
