"""The unmatched-layer report: expected counts from the config, found ops and unmatched modules from the graph."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3MoeConfig

from autodeploy.export.export import export_causal_lm
from autodeploy.patterns import apply_patterns, select_patterns
from autodeploy.transforms import TransformConfig, TransformContext
from autodeploy.transforms import match_patterns  # noqa: F401  (registers the built-in patterns)
from autodeploy.transforms.match_report import MODULE_SUFFIXES, MatchReportTransform, expected_counts, match_report
from tests.patterns.tiny_norm_mlp_models import ALL_ARCHITECTURES, config_for, model_for
from tests.tiny_models import TINY_COMMON
from tests.transforms.cleanup_harness import CLEANUP_PASSES, run_transform

_QWEN3_MOE = dict(TINY_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MORE_CONFIGS = {
    "gemma3_text": lambda: Gemma3TextConfig(**TINY_COMMON, head_dim=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_QWEN3_MOE),
    "qwen3_moe_first_layer_dense": lambda: Qwen3MoeConfig(**_QWEN3_MOE, mlp_only_layers=[0]),
}


@pytest.mark.parametrize("arch", [*ALL_ARCHITECTURES, *MORE_CONFIGS])
def test_expected_counts_equal_the_norm_mlp_and_moe_modules_hf_builds(arch):
    config = MORE_CONFIGS[arch]() if arch in MORE_CONFIGS else config_for(arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    modules = {kind: sum(type(m).__name__.endswith(suffixes) for m in model.modules()) for kind, suffixes in MODULE_SUFFIXES.items()}
    expected, assumed = expected_counts(config)
    assert not assumed
    assert {kind: count for kind, count in modules.items() if count} == {kind: n for kind, n in expected.items() if n}


def test_report_names_what_is_left_unmatched():
    model = model_for("llama")
    gm = export_causal_lm(model, max_num_tokens=64, max_seq_len=64)
    for name in CLEANUP_PASSES:
        run_transform(name, gm)

    apply_patterns(gm, select_patterns(["norm"]))
    partial = match_report(gm, model.config)
    assert not partial.complete
    assert partial.unmatched_modules == [
        "model.model.layers.0.mlp (LlamaMLP)", "model.model.layers.0.self_attn (LlamaAttention)",
        "model.model.layers.1.mlp (LlamaMLP)", "model.model.layers.1.self_attn (LlamaAttention)",
    ]
    assert str(partial) == f"attention 0/2, norm 5/5, mlp 0/2 — unmatched: {', '.join(partial.unmatched_modules)}"

    apply_patterns(gm, select_patterns(["rope", "attention", "mlp"]))
    assert match_report(gm, model.config).complete
    assert str(match_report(gm, model.config)) == "attention 2/2, norm 5/5, mlp 2/2"
    assert str(match_report(gm)) == "attention 2, norm 5, mlp 2"  # no config: found counts only
    unknown = SimpleNamespace(num_hidden_layers=3, model_type="my_arch")
    assert str(match_report(gm, unknown)) == "attention 2/3, norm 5/7, mlp 2/3 (expected counts assume 2 norms + 1 MLP per layer)"

    context = TransformContext(settings=None, model_factory=SimpleNamespace(hf_config=model.config))
    result = MatchReportTransform(TransformConfig()).apply(gm, context)
    assert result.notes == "attention 2/2, norm 5/5, mlp 2/2" and not result.changed
