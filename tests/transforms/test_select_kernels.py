"""select_kernels on a deployed tiny Llama: preferences (per op and per node glob), impossible and unknown
preferences as ConfigErrors at build, the autotuner's choice between a user's kernels, a dispatch per
token bucket, and generation unchanged by any of it."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autodeploy import SamplingParams, autodeploy, register_backend
from autodeploy.custom_ops import op_by_target
from autodeploy.custom_ops.rms_norm import rms_norm_reference
from autodeploy.errors import ConfigError

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPTS = [[5, 6, 7, 8], [9, 10]]
QUICK = dict(device="cpu", verify={"enabled": False})


def kernels(llm, op_name):
    """Backend name per node of ``op_name``, in graph order."""
    found = []
    for node in llm.graph.graph.nodes:
        if node.op != "call_function":
            continue
        match = op_by_target(node.target)
        if match is not None and match[0].name == op_name:
            found.append(match[1])
        elif getattr(node.target, "__name__", "").startswith(f"{op_name}_by_tokens"):
            found.append(node.target.__name__)
    return found


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def default_tokens(llama_llm):
    return tokens(llama_llm)


def test_every_canonical_node_is_retargeted_and_the_report_says_why(llama_llm):
    assert kernels(llama_llm, "cached_attention_rope") == ["sdpa", "sdpa"]  # RoPE fused into the cache write
    report = llama_llm.pipeline_report()
    assert "cached_attention_rope ×2 → cached_attention_rope_sdpa (only candidate" in report
    assert "fused_gated_mlp ×2 → fused_gated_mlp_torch (only candidate" in report  # fuse_gate_up's op, as any other


def test_a_preference_per_op_and_per_node_glob(llama_dir, default_tokens):
    llm = autodeploy(str(llama_dir), **QUICK, backends={"cached_attention": ["reference"]})
    assert kernels(llm, "cached_attention") == ["reference", "reference"]
    assert "(preference)" in llm.pipeline_report()
    assert tokens(llm) == default_tokens

    per_node = {"cached_attention": {"*layers.0*": ["reference"], "*": ["triton", "sdpa"]}}
    llm = autodeploy(str(llama_dir), **QUICK, backends=per_node)
    assert kernels(llm, "cached_attention") == ["reference", "sdpa"]
    assert tokens(llm) == default_tokens


@pytest.mark.parametrize(
    "backends, message",
    [
        ({"cached_attention": ["flash"]}, "has no backend 'flash'; registered: triton, sdpa, invariant, reference"),
        ({"no_such_op": ["torch"]}, "no canonical op is named 'no_such_op'"),
        ({"cached_attention": 3}, "must be a list of backend names"),
        ({"cached_attention": {"*": []}}, "must be a list of backend names"),
    ],
)
def test_bad_preferences_are_config_errors_before_anything_runs(llama_dir, backends, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        autodeploy(str(llama_dir), **QUICK, backends=backends)


# A user's kernels for rms_norm, admitted only while a test turns them on (the registry is process-wide).
ENABLED = {"on": False}


def _enabled(*args, device):
    return ENABLED["on"] or "only inside test_select_kernels"


def user_fast(x, weight, eps, weight_offset=0.0):
    return rms_norm_reference(x, weight, eps, weight_offset)


def user_wrong(x, weight, eps, weight_offset=0.0):
    return rms_norm_reference(x, weight, eps, weight_offset) * 2


register_backend("rms_norm", "user_fast", user_fast, supports=_enabled)
register_backend("rms_norm", "user_wrong", user_wrong, supports=_enabled)


@pytest.fixture
def user_kernels(monkeypatch, tmp_path):
    monkeypatch.setitem(ENABLED, "on", True)
    speeds = {}

    def fake_median_seconds(backend, run, input_sets, device, **_):
        run(input_sets[0])
        return speeds[backend.name](input_sets[0][0].shape[0] * input_sets[0][0].shape[1])

    monkeypatch.setattr("autodeploy.autotuner.tuner.median_seconds", fake_median_seconds)
    return speeds


def test_a_fast_user_kernel_wins_the_contest_and_a_wrong_one_never_does(llama_dir, default_tokens, user_kernels, tmp_path):
    user_kernels.update(user_fast=lambda t: 1.0, user_wrong=lambda t: 0.001, torch=lambda t: 5.0)
    llm = autodeploy(str(llama_dir), **QUICK, autotuner={"cache_dir": str(tmp_path)})
    assert set(kernels(llm, "rms_norm")) == {"user_fast"}
    # One rms_norm is left (the first input norm, which reads the embeddings); fuse_add_rms_norm took the others.
    assert "rms_norm ×1 → rms_norm_user_fast (tuned)" in llm.pipeline_report()
    assert tokens(llm) == default_tokens


def test_buckets_that_disagree_get_a_dispatch_by_token_count(llama_dir, default_tokens, user_kernels, tmp_path):
    user_kernels.update(user_fast=lambda t: 1.0 if t <= 4 else 9.0, user_wrong=lambda t: 0.001, torch=lambda t: 5.0)
    llm = autodeploy(str(llama_dir), **QUICK, autotuner={"cache_dir": str(tmp_path)})
    names = set(kernels(llm, "rms_norm"))
    assert len(names) == 1
    (name,) = names
    assert name.startswith("rms_norm_by_tokens__1_4_user_fast__8_") and name.endswith("_torch")
    assert tokens(llm) == default_tokens


def test_autotuner_disabled_takes_the_first_supported(llama_dir, user_kernels, tmp_path):
    user_kernels.update(user_fast=lambda t: 1.0, user_wrong=lambda t: 0.001, torch=lambda t: 5.0)
    llm = autodeploy(str(llama_dir), **QUICK, autotuner={"enabled": False})
    first = kernels(llm, "rms_norm")
    assert len(set(first)) == 1 and first[0] != "user_wrong"
    assert "(first supported" in llm.pipeline_report()


def test_the_tune_command_prints_the_decision_table_and_a_rerun_reuses_it(llama_dir, user_kernels, tmp_path, capsys):
    from autodeploy.cli.main import main

    user_kernels.update(user_fast=lambda t: 1.0, user_wrong=lambda t: 0.001, torch=lambda t: 5.0)
    arguments = ["tune", str(llama_dir), "--set", "device=cpu", "--set", "verify.enabled=false",
                 "--set", f"autotuner.cache_dir={tmp_path}"]
    assert main(arguments) == 0
    first = capsys.readouterr().out
    assert "rms_norm ×1 → rms_norm_user_fast (tuned)" in first
    assert "rms_norm (1×T×64 float32, 64 float32, 1e-06): 1–2048: user_fast (at 1: torch 5000000.0, user_fast 1000000.0; at 2048:" in first
    assert "bucket timings made, 0 reused" in first and "tuned in" in first
    assert main(arguments) == 0
    assert " 0 bucket timings made" in capsys.readouterr().out
