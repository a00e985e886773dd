"""``compile.backend: torch_compile`` (``runtime/compiled_graph.py``): the graph under Inductor serves HF's
tokens; a compile that fails leaves the eager graph serving, with a warning. On the GPU the compiled
graph's decode steps are captured as CUDA graphs too (``torch_compile_cuda_graph``)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.autotuner.token_dispatch import token_dispatch
from autodeploy.custom_ops import candidates
from autodeploy.deployment import MODEL
from autodeploy.runtime.compiled_graph import CompiledGraph
from autodeploy.runtime.engine import Engine
from tests.runtime.test_engine import GREEDY, hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model


def test_the_compiled_graph_serves_hf_greedy_tokens_through_token_dispatches(tiny_checkpoint):
    """On a GPU ``select`` leaves per-token-count dispatches in the graph; torch.compile must trace them
    (a graph break would fail ``fullgraph`` and leave the graph eager)."""
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", compile={"backend": "torch_compile"}, verify={"enabled": False})
    assert isinstance(llm.engine.graph, CompiledGraph) and llm.engine.graph.failure is None
    assert "torch.compile" in llm.pipeline_report()
    graph = copy.deepcopy(llm.graph)
    backends = {b.name: b for b in candidates("rms_norm")}
    dispatch = token_dispatch("rms_norm", {1: backends["torch"], 8: backends["reference"], 64: backends["torch"]}, (0, 1))
    norms = [node for node in graph.graph.nodes if node.target == backends["torch"].op]
    assert norms
    for node in norms:
        node.target = dispatch
    graph.recompile()
    signature = dataclasses.replace(llm.deployment.signature, decode_graph_batch_sizes=(), prefill_graph_token_sizes=())
    engine = Engine(dataclasses.replace(llm.deployment, graphs={MODEL: graph}, signature=signature, eos_token_ids=()))
    llm._engine = engine
    prompts = random_prompts(3, seed=31, lengths=(1, 40))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    hf = tiny_hf_model("llama")
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert engine.graph.failure is None  # prefill, decode and mixed steps all ran compiled


class CompilerMissing(torch._dynamo.exc.TorchDynamoException):
    """What a failed compile raises (Inductor's own errors derive from the same class)."""


def test_a_compile_failure_falls_back_to_the_eager_graph_with_a_warning(tiny_checkpoint, llama_llm, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        def compiled(*inputs):
            raise CompilerMissing("no C++ compiler here")

        return compiled

    monkeypatch.setattr(torch, "compile", refuse)
    with caplog.at_level(logging.WARNING, logger="autodeploy.runtime.compiled_graph"):
        llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", compile={"backend": "torch_compile"}, verify={"enabled": False})
        prompts = random_prompts(2, seed=32, lengths=(3, 20))
        params = SamplingParams(max_tokens=4, **GREEDY)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in llama_llm.generate(prompts, params)]
    assert isinstance(llm.engine.graph.failure, CompilerMissing)
    assert any("torch.compile failed" in record.message and "runs eagerly" in record.message for record in caplog.records)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_compiled_decode_steps_are_captured_and_match_hf(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cuda", dtype="float32", max_batch_size=4,
                     compile={"backend": "torch_compile_cuda_graph"})
    engine = llm.engine
    assert isinstance(engine.graph, CompiledGraph) and engine.runner.decode_graphs is not None
    prompts = random_prompts(4, seed=33, lengths=(2, 50))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    hf = tiny_hf_model("llama")
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]
    assert engine.graph.failure is None
