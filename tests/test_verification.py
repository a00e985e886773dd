"""Build-time verification: a deploy that computes something other than the source model is refused,
naming the first diverging module; a correct one carries its verified error."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from autodeploy import Transform, TransformConfig, TransformResult, autodeploy, register_transform
from autodeploy.errors import ConfigError, UnsupportedModelError
from autodeploy.models import twin


@dataclass
class CorruptNormConfig(TransformConfig):
    factor: float = 1.5


@register_transform("test_corrupt_first_norm", stage="fuse")
class CorruptFirstNorm(Transform):
    """Scales the output of the graph's first rms_norm: a stand-in for a pass with a bug."""

    config_class = CorruptNormConfig

    def apply(self, gm, context):
        norm = next(n for n in gm.graph.nodes if n.target is torch.ops.autodeploy.rms_norm.default)
        with gm.graph.inserting_after(norm):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (norm, self.config.factor))
        scaled.meta = dict(norm.meta)
        norm.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        return TransformResult(matches=1, changed=True)


CORRUPT = {"test_corrupt_first_norm": {}}
# Before torch 2.13 inductor's pattern matcher does not pass the module stack on to the canonical ops it
# inserts, so the corrupted norm has no module of its own there and the next module is named instead.
FIRST_DIVERGING = (
    "first diverging module: model.layers.0.input_layernorm (LlamaRMSNorm)" if torch.__version__ >= "2.13"
    else "first diverging module: model.layers.0.self_attn.q_proj (Linear)"
)


def test_a_correct_deploy_reports_its_verified_error(llama_llm):
    report = llama_llm.verification
    assert report is not None and report.relative_error <= report.tolerance == 1e-4
    assert report.device == "cpu" and report.dtype == "float32"
    assert "verified on a twin" in llama_llm.pipeline_report()


def test_a_wrong_pass_is_refused_naming_the_diverging_module(llama_dir):
    with pytest.raises(UnsupportedModelError) as raised:
        autodeploy(str(llama_dir), device="cpu", transforms=CORRUPT)
    message = str(raised.value)
    assert FIRST_DIVERGING in message
    assert "verify.enabled=false" in message


def test_verification_can_be_switched_off(llama_dir):
    llm = autodeploy(str(llama_dir), device="cpu", transforms=CORRUPT, verify={"enabled": False})
    assert llm.verification is None


def test_non_finite_logits_are_refused(llama_dir):
    with pytest.raises(UnsupportedModelError, match="non-finite logits"):
        autodeploy(str(llama_dir), device="cpu", transforms={"test_corrupt_first_norm": {"factor": float("nan")}})


def test_a_reduced_twin_verifies_and_refuses_alike(llama_dir, monkeypatch):
    monkeypatch.setattr(twin, "FULL_SIZE_LIMIT", 0)  # every model gets a reduced twin of its own
    llm = autodeploy(str(llama_dir), device="cpu")
    assert "1 of 2 layers" in llm.verification.twin
    with pytest.raises(UnsupportedModelError) as raised:
        autodeploy(str(llama_dir), device="cpu", transforms=CORRUPT)
    assert FIRST_DIVERGING in str(raised.value)


def test_a_meta_deploy_verifies_its_twin_on_the_cpu(llama_dir):
    llm = autodeploy(str(llama_dir), device="meta", weights="random")
    assert (llm.verification.device, llm.verification.dtype) == ("cpu", "float32")


def test_tolerances_are_checked_when_loaded():
    with pytest.raises(ConfigError, match="verify.tolerance"):
        autodeploy(verify={"tolerance": {"float32": 0.0}})
