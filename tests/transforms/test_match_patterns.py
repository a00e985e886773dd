"""The match stage on exported HF models: every norm and MLP becomes a canonical op, logits stay exact."""

import pytest
import torch

from autodeploy.errors import ConfigError
from autodeploy.export.export import export_causal_lm
from autodeploy import pipeline
from autodeploy.transforms import TransformContext, get_transform_class
from autodeploy.transforms import match_patterns, match_report  # noqa: F401  (register the match transforms)
from autodeploy.transforms.shape_propagation import propagate_shapes
from tests.logit_comparison import max_logit_diff
from tests.patterns.tiny_norm_mlp_models import ALL_ARCHITECTURES, model_for
from tests.transforms.cleanup_harness import CLEANUP_PASSES, call_targets, run_transform

# Canonical ops per architecture with 2 layers: norms = 2 per layer + final (Gemma-2: 4 per layer,
# Qwen3: + q/k norms per layer); one MLP per layer, none for Mixtral (its experts are the moe family's).
EXPECTED = {
    "llama": {"autodeploy.rms_norm.default": 5, "autodeploy.gated_mlp.default": 2},
    "mistral": {"autodeploy.rms_norm.default": 5, "autodeploy.gated_mlp.default": 2},
    "qwen2": {"autodeploy.rms_norm.default": 5, "autodeploy.gated_mlp.default": 2},
    "mixtral": {"autodeploy.rms_norm.default": 5},
    "gemma": {"autodeploy.rms_norm.default": 5, "autodeploy.gated_mlp.default": 2},
    "gemma2": {"autodeploy.rms_norm.default": 9, "autodeploy.gated_mlp.default": 2},
    "phi3": {"autodeploy.rms_norm.default": 5, "autodeploy.gated_mlp.default": 2},
    "gpt_neox": {"autodeploy.layer_norm.default": 5, "autodeploy.mlp.default": 2},
    "qwen3": {"autodeploy.rms_norm.default": 9, "autodeploy.gated_mlp.default": 2},
}
CANONICAL = ("autodeploy.rms_norm.default", "autodeploy.layer_norm.default", "autodeploy.gated_mlp.default", "autodeploy.mlp.default")


def _run(name: str, gm, **options):
    transform_class = get_transform_class(name)
    return pipeline.run_transform(transform_class(transform_class.config_class(**options)), gm, TransformContext(settings=None))


def _exported(arch: str, dtype: torch.dtype = torch.float32):
    model = model_for(arch, dtype)
    gm = export_causal_lm(model, max_num_tokens=64, max_seq_len=64)
    for name in CLEANUP_PASSES:
        run_transform(name, gm)
    return model, gm




def _values(gm) -> dict:
    return {n.name: (str(n.meta["val"].shape), str(n.meta["val"].stride()), n.meta["val"].dtype)
            for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_match_stage_replaces_every_norm_and_mlp_and_keeps_logits(arch):
    model, gm = _exported(arch)
    exported_nodes = {node.name for node in gm.graph.nodes}

    result = _run("match_patterns", gm, patterns=["norm", "mlp"])  # the families this suite covers
    linear_result = _run("match_linear", gm)

    targets = call_targets(gm)
    assert {op: targets[op] for op in CANONICAL if op in targets} == EXPECTED[arch]
    assert result.matches == sum(EXPECTED[arch].values()) and result.changed
    assert "aten.linear.default" not in targets and targets["autodeploy.linear.default"] == linear_result.matches > 0
    assert max_logit_diff(model, gm) <= 1e-5
    # New nodes carry the values a full propagation computes (export's own values may differ in form).
    new_values = {name: value for name, value in _values(gm).items() if name not in exported_nodes}
    assert len(new_values) >= result.matches
    propagated = _values(propagate_shapes(gm))
    assert new_values == {name: propagated[name] for name in new_values}


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3", "gpt_neox"])
def test_low_precision_graphs_keep_their_casts_and_still_match(arch):
    model, gm = _exported(arch, torch.bfloat16)
    _run("match_patterns", gm, patterns=["norm", "mlp"])
    targets = call_targets(gm)
    assert {op: targets[op] for op in CANONICAL if op in targets} == EXPECTED[arch]
    assert max_logit_diff(model, gm) <= 0.05  # the ops compute in float32, HF partly in bfloat16


def test_partly_matched_model_is_still_exact():
    model, gm = _exported("llama")
    result = _run("match_patterns", gm, patterns=["norm"])
    assert result.notes == "rms_norm_llama×5"
    _run("match_linear", gm)  # the MLPs' linears become canonical linears instead
    targets = call_targets(gm)
    assert "autodeploy.gated_mlp.default" not in targets and targets["autodeploy.linear.default"] == 15
    assert max_logit_diff(model, gm) <= 1e-5


def test_pattern_options_are_checked_when_the_config_loads():
    from autodeploy.config import validate_transform_entry

    with pytest.raises(ConfigError, match="'nrom' is neither a pattern family"):
        validate_transform_entry("match_patterns", {"patterns": ["nrom"]})
    with pytest.raises(ConfigError, match="transforms.match_patterns"):
        validate_transform_entry("match_patterns", {"patterns": "norm"})
    config = validate_transform_entry("match_patterns", {"patterns": ["norm", "gated_mlp_silu"], "skip": ["rms_norm_gemma"]})
    assert config.stage == "match" and config.skip == ["rms_norm_gemma"]


@pytest.fixture
def user_silu_pattern():
    from autodeploy.patterns import register_pattern, unregister_pattern

    def silu(x):
        return torch.nn.functional.silu(x)

    def silu_as_sigmoid(x):
        return x * torch.sigmoid(x)

    register_pattern("user_silu_as_sigmoid", silu, silu_as_sigmoid, [torch.empty(2, 8)], family="mlp")
    yield "user_silu_as_sigmoid"
    unregister_pattern("user_silu_as_sigmoid")


def test_user_pattern_enabled_by_name_in_yaml_rewrites_the_deployed_graph(user_silu_pattern, tiny_checkpoint, tmp_path):
    from autodeploy import autodeploy
    from tests.tiny_models import tiny_hf_model

    config = tmp_path / "pipeline.yaml"
    config.write_text(f"transforms:\n  match_patterns: {{patterns: [attention, {user_silu_pattern}]}}\n  match_report: {{}}\n")

    llm = autodeploy(str(tiny_checkpoint("llama")), config=config, device="cpu")

    records = {record.name: record for record in llm.records}
    assert records["match_patterns"].stage == "match" and records["match_patterns"].notes == f"attention_sdpa×2, {user_silu_pattern}×2"
    assert records["match_report"].notes.startswith("attention 2/2, norm 0/5, mlp 0/2 — unmatched: model.model.layers.0.input_layernorm")
    targets = call_targets(llm.graph)
    assert targets["aten.sigmoid.default"] == 2 and "aten.silu.default" not in targets
    tokens = [5, 17, 42, 99, 3]
    with torch.no_grad():
        expected = tiny_hf_model("llama")(input_ids=torch.tensor([tokens])).logits[0]
    assert (llm.logits([tokens])[0] - expected).abs().max().item() <= 1e-5
