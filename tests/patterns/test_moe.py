"""The MoE pattern turns every router + top-k + experts block of exported HF models into one
``autodeploy.moe``, keeps the logits equal to HF eager, and leaves blocks outside the op's contract alone.

HF models go through the stages as the pipeline runs them (export with the default patches, the cleanup
passes, the match stage); the hand-built routers below get the MoE pattern alone, so that a block it
must not match shows as an unchanged graph.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import autodeploy.patterns.moe  # noqa: F401  (registers moe_batched_experts)
import autodeploy.transforms.match_patterns  # noqa: F401  (registers the match-stage transforms)
from autodeploy import SamplingParams, autodeploy
from autodeploy.export.export import ExportConfig, export_causal_lm, export_to_graph_module
from autodeploy.patterns.registry import apply_patterns, select_patterns
from tests.logit_comparison import max_logit_diff
from tests.patterns.tiny_family_configs_moe import NUM_EXPERTS, TOP_K, moe_layer_count, tiny_moe_model
from tests.tiny_models import tiny_hf_model
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, run_transform

MOE = "autodeploy.moe.default"
MATCH_STAGE = ("match_patterns", "match_linear")
SHAPES = [(1, 1, 0), (2, 7, 0), (3, 16, 5)]  # batch, seq, first position
# Ops only the routing and the batched experts use; none may survive a match.
ROUTING_AND_EXPERT_OPS = (
    "aten.topk.default",
    "aten.bmm.default",
    "aten.repeat_interleave.self_int",
    "aten.div_.Tensor",
)


def replace_moe_blocks(gm) -> int:
    """Only the MoE pattern, selected and applied through the pattern registry as the match stage does."""
    return apply_patterns(gm, select_patterns(["moe_batched_experts"]))["moe_batched_experts"]


def _exported_and_cleaned(model: nn.Module):
    """What the pipeline hands the match stage: export with the default patches (HF experts through
    ``batched_mm``), then the cleanup passes."""
    gm = export_causal_lm(model, max_num_tokens=64, max_seq_len=64, patches=ExportConfig().patches)
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    return gm


def _matched(model: nn.Module):
    """Export, cleanup, then the match stage with every pattern family."""
    gm = _exported_and_cleaned(model)
    for name in MATCH_STAGE:
        run_transform(name, gm)
    return gm


def _max_logit_diff(model, gm) -> float:
    return max_logit_diff(model, gm, SHAPES)


@pytest.mark.parametrize(
    "arch, renormalize",
    [("mixtral", True), ("qwen2_moe", False), ("qwen3_moe", True), ("olmoe", False)],
)
def test_every_moe_layer_becomes_one_op_and_logits_equal_hf(arch, renormalize):
    model = tiny_moe_model(arch)

    gm = _matched(model)

    ops = call_targets(gm)
    assert ops[MOE] == moe_layer_count(model)
    assert not any(ops[op] for op in ROUTING_AND_EXPERT_OPS), ops
    moe_nodes = [node for node in gm.graph.nodes if str(node.target) == MOE]
    assert all(node.args[4] == TOP_K for node in moe_nodes)
    options = {"scoring": "softmax", "renormalize": renormalize, "activation": "silu"}
    assert all(node.kwargs == options for node in moe_nodes)
    # The router linear stays outside the op and feeds it the [T, E] logits.
    assert all(node.args[1].target is torch.ops.autodeploy.linear.default for node in moe_nodes)
    assert all(node.args[1].meta["val"].shape[1] == NUM_EXPERTS for node in moe_nodes)
    assert _max_logit_diff(model, gm) <= 1e-5


def test_qwen2_moe_shared_expert_and_its_sigmoid_gate_stay_outside_the_op():
    model = tiny_moe_model("qwen2_moe")

    gm = _matched(model)

    ops = call_targets(gm)
    assert ops["aten.sigmoid.default"] == ops["autodeploy.gated_mlp.default"] == moe_layer_count(model)
    for moe in (node for node in gm.graph.nodes if str(node.target) == MOE):
        (user,) = moe.users
        assert user.target is torch.ops.aten.add.Tensor  # routed experts + sigmoid(gate) * shared expert


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bfloat16_graph_with_routing_casts_is_matched(arch):
    # Mixtral upcasts the logits and casts the float32 sum back; Qwen3-MoE casts the top-k weights down.
    model = tiny_moe_model(arch, dtype=torch.bfloat16)
    gm = _exported_and_cleaned(model)
    assert call_targets(gm)["aten.to.dtype"] > 0

    assert replace_moe_blocks(gm) == moe_layer_count(model)

    assert not any(call_targets(gm)[op] for op in ROUTING_AND_EXPERT_OPS)
    assert _max_logit_diff(model, gm) <= 2e-2  # bf16 rounding: HF and the op accumulate in different orders


def test_gpt_oss_experts_are_outside_the_op_contract_and_stay_as_exported():
    model = tiny_moe_model("gpt_oss")
    gm = _exported_and_cleaned(model)
    ops_before = call_targets(gm)

    assert replace_moe_blocks(gm) == 0

    assert call_targets(gm) == ops_before
    run_transform("match_patterns", gm)
    assert call_targets(gm)["aten.topk.default"] == moe_layer_count(model)
    assert _max_logit_diff(model, gm) <= 1e-5


class _RoutedExperts(nn.Module):
    """A router HF does not ship (any scoring, optional renormalisation) in front of HF's own experts,
    exported through the same ``batched_mm`` path as the models."""

    def __init__(self, scoring: str, renormalize: bool, hidden_act: str = "silu", experts_class=Qwen3MoeExperts):
        super().__init__()
        config = Qwen3MoeConfig(
            hidden_size=64, moe_intermediate_size=32, num_experts=NUM_EXPERTS, hidden_act=hidden_act
        )
        config._experts_implementation = "batched_mm"
        self.router = nn.Linear(64, NUM_EXPERTS, bias=False)
        self.experts = experts_class(config)
        nn.init.normal_(self.experts.gate_up_proj, std=0.1)
        nn.init.normal_(self.experts.down_proj, std=0.1)
        self.scoring, self.renormalize = scoring, renormalize
        self.returns_top_weights = False

    def forward(self, x: torch.Tensor):
        logits = self.router(x)
        scores = logits.float().softmax(-1) if self.scoring == "softmax" else logits.float().sigmoid()
        weights, ids = torch.topk(scores, TOP_K, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, ids, weights.to(x.dtype))
        return (out, weights) if self.returns_top_weights else out


def _export_tokens(module: nn.Module):
    tokens = torch.export.Dim.DYNAMIC(min=1, max=64)
    gm = export_to_graph_module(module.eval(), (torch.randn(4, 64),), dynamic_shapes=({0: tokens},))
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    return gm


@pytest.mark.parametrize(
    "scoring, renormalize, hidden_act, activation",
    [
        ("sigmoid", True, "silu", "silu"),
        ("sigmoid", False, "gelu_pytorch_tanh", "gelu_tanh"),
        ("softmax", False, "gelu", "gelu"),
        ("softmax", True, "relu", "relu"),
    ],
)
def test_scoring_renormalisation_and_activation_are_read_from_the_graph(scoring, renormalize, hidden_act, activation):
    torch.manual_seed(0)
    module = _RoutedExperts(scoring, renormalize, hidden_act)
    gm = _export_tokens(module)

    assert replace_moe_blocks(gm) == 1

    (moe,) = [node for node in gm.graph.nodes if str(node.target) == MOE]
    assert moe.kwargs == {"scoring": scoring, "renormalize": renormalize, "activation": activation}
    for tokens in (1, 5, 33):
        x = torch.randn(tokens, 64)
        with torch.no_grad():
            assert (gm(x) - module(x)).abs().max().item() <= 1e-5


def test_block_whose_top_k_weights_are_also_read_elsewhere_is_left_alone():
    module = _RoutedExperts("softmax", True)
    module.returns_top_weights = True
    gm = _export_tokens(module)
    ops_before = call_targets(gm)

    assert replace_moe_blocks(gm) == 0
    assert call_targets(gm) == ops_before


class _UpFirstExperts(Qwen3MoeExperts):
    """The activation on the second half of ``gate_up_proj``: not the op's [gate; up] layout."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        up, gate = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def test_activation_on_the_up_half_is_not_matched():
    gm = _export_tokens(_RoutedExperts("softmax", True, experts_class=_UpFirstExperts))
    assert replace_moe_blocks(gm) == 0


def test_greedy_generation_on_a_tiny_mixtral_checkpoint_equals_hf_generate(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", transforms={name: {} for name in MATCH_STAGE})
    hf_model = tiny_hf_model("mixtral")  # the checkpoint's weights: tiny checkpoints are seeded

    assert call_targets(llm.graph)[MOE] == moe_layer_count(hf_model)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (5, 1, 12)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert output.token_ids == reference[0, len(prompt) :].tolist()
