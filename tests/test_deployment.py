"""``Deployment``: the one record a build makes and ``LLM``, ``Engine``, save and load take; the loose-argument
forms from before it still work, with a ``DeprecationWarning``."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from autodeploy import LLM
from autodeploy.artifact import save_deployment
from autodeploy.deployment import MODEL, Deployment
from autodeploy.errors import ConfigError

SEQUENCES = [list(range(3, 30)), [5]]


def loose_arguments(deployment: Deployment) -> tuple:
    """The deployment as the 11 arguments ``LLM`` took before ``Deployment``, in their order."""
    signature, report = deployment.signature, deployment.report
    return (deployment.graph, signature.inputs, deployment.settings, deployment.tokenizer, list(deployment.eos_token_ids),
            report.records, signature.kv_caches, deployment.model_directory, report.verification,
            signature.decode_graph_batch_sizes, signature.prefill_graph_token_sizes)


def test_a_build_hands_over_one_deployment(llama_llm):
    deployment = llama_llm.deployment
    assert deployment.graph is llama_llm.graph is deployment.graphs[MODEL]
    assert deployment.signature.inputs[:2] == ("input_ids", "position_ids") == llama_llm.graph_inputs[:2]
    assert [spec.key_input for spec in deployment.signature.kv_caches][:2] == ["k_cache_0", "k_cache_1"]
    assert deployment.report.records is llama_llm.records and deployment.report.verification is llama_llm.verification
    assert deployment.vocab_size == llama_llm.vocab_size == llama_llm.engine.vocab_size
    assert llama_llm.engine.eos_token_ids == set(deployment.eos_token_ids)


def test_the_loose_argument_form_still_builds_the_same_llm_and_warns(llama_llm):
    with pytest.warns(DeprecationWarning, match="pass one Deployment") as warned:
        old = LLM(*loose_arguments(llama_llm.deployment))
    assert warned[0].filename == __file__  # the warning names the line to change
    assert old.deployment == llama_llm.deployment
    with pytest.warns(DeprecationWarning):
        keywords = LLM(llama_llm.graph, llama_llm.graph_inputs, llama_llm.settings, kv_caches=llama_llm.deployment.signature.kv_caches)
    assert keywords.deployment.signature.inputs == llama_llm.graph_inputs and keywords.deployment.eos_token_ids == ()
    for want, got in zip(llama_llm.logits(SEQUENCES), old.logits(SEQUENCES)):
        assert want.equal(got)


def test_save_deployment_takes_the_loose_form_too_and_writes_the_same_files(llama_llm, tmp_path):
    new = save_deployment(tmp_path / "new", llama_llm.deployment)
    with pytest.warns(DeprecationWarning, match="pass one Deployment"):
        old = save_deployment(tmp_path / "old", *loose_arguments(llama_llm.deployment))
    for name in ("serving.json", "settings.yaml", "build_report.json", "weights.safetensors"):
        assert (new / name).read_bytes() == (old / name).read_bytes(), name


def test_a_deployment_needs_a_model_graph_and_nothing_else_beside_it(llama_llm):
    with pytest.raises(ConfigError, match="'model' graph"):
        dataclasses.replace(llama_llm.deployment, graphs={"draft": llama_llm.graph})
    with pytest.raises(TypeError, match="Deployment alone"):
        LLM(llama_llm.deployment, llama_llm.graph_inputs)


def test_setting_a_part_of_a_copied_llm_leaves_the_original_alone(llama_llm):
    moved = copy.copy(llama_llm)
    moved.model_directory = "/elsewhere"
    moved.tokenizer = None
    assert llama_llm.model_directory != "/elsewhere" and llama_llm.tokenizer is not None
    assert moved.deployment.graph is llama_llm.graph
