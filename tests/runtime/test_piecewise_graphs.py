"""Prefill and mixed steps as captured pieces around attention (``runtime/piecewise_graphs.py``).

On the CPU nothing is captured, but the engine runs the same split graph, padded static buffers and
narrowed attention inputs a GPU replays, so the padding and the split are checked against Hugging Face
here; the GPU test captures and replays for real.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.runtime.engine import Engine
from autodeploy.runtime.piecewise_graphs import NotSplittable, PiecewiseGraphs, eager_nodes, split_into_pieces
from autodeploy.transforms.compile_model import default_prefill_token_sizes
from tests.runtime.test_engine import GREEDY, hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model


def engine_with_pieces(llm, token_sizes, decode_sizes=()) -> Engine:
    signature = dataclasses.replace(llm.deployment.signature, decode_graph_batch_sizes=decode_sizes,
                                    prefill_graph_token_sizes=token_sizes)
    return Engine(dataclasses.replace(llm.deployment, signature=signature, eos_token_ids=()))


def test_default_token_sizes_double_up_to_the_budget():
    assert default_prefill_token_sizes(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert default_prefill_token_sizes(100) == (16, 32, 64, 100)
    assert default_prefill_token_sizes(8) == (8,)


def test_the_split_leaves_attention_and_the_logits_tail_eager(llama_llm):
    split, pieces = split_into_pieces(llama_llm.graph)
    eager = eager_nodes(llama_llm.graph)
    attention = [n for n in llama_llm.graph.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]
    assert set(attention) <= eager
    layers = len(attention)
    # embedding … q/k/v | attention | o_proj … next q/k/v | … | attention | o_proj … final norm | logits tail
    assert [p.captured for p in pieces] == [True, False] * layers + [True, False]
    assert sum(p.captured for p in pieces) == layers + 1


def test_pieces_of_layers_alike_share_a_structure_though_each_node_has_its_own_dispatch():
    # The capture runs one piece of each structure eagerly per bucket; a token dispatch is made per node,
    # so the structure names it by its backends, not by the object (its str() holds its address); each
    # layer's piece reads its own weights through placeholders named after them, so only their places count.
    from types import SimpleNamespace

    from torch import fx

    from autodeploy.autotuner.token_dispatch import token_dispatch
    from autodeploy.runtime.piecewise_graphs import _Piece

    backends = {1: SimpleNamespace(name="triton", op=torch.neg), 64: SimpleNamespace(name="torch", op=torch.neg)}

    def piece(dispatch, scale, weight="layers_0_weight") -> _Piece:
        graph = fx.Graph()
        x, w = graph.placeholder("x"), graph.placeholder(weight)  # split_module names a placeholder after its feed
        graph.output(graph.call_function(torch.mul, (graph.call_function(dispatch, (x, w)), scale)))
        return _Piece(fx.GraphModule(torch.nn.Module(), graph), True, [True, False], [False, True], [False, False])

    first, second = token_dispatch("rms_norm", backends, (0, 1)), token_dispatch("rms_norm", backends, (0, 1))
    other = token_dispatch("rms_norm", {1: backends[64]}, (0, 1))
    assert str(first) != str(second)
    assert piece(first, 2.0).structure == piece(second, 2.0, weight="layers_1_weight").structure
    assert piece(first, 2.0).structure != piece(other, 2.0).structure  # another backend: warmed apart
    assert piece(first, 2.0).structure != piece(second, 3.0).structure  # another constant


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padded_pieces_match_hf_generate(tiny_checkpoint, arch, monkeypatch):
    """Prompts of several lengths prefilled together, chunked (some steps mix decodes in), bucket sizes
    below and above each step's token count, and steps past the largest bucket (eager)."""
    llm = autodeploy(str(tiny_checkpoint(arch)), device="cpu", max_batch_size=8, verify={"enabled": False},
                     scheduler={"max_num_tokens": 96})
    engine = engine_with_pieces(llm, (16, 64))
    runs = []
    original = engine.runner.prefill_graphs.run
    monkeypatch.setattr(engine.runner.prefill_graphs, "run", lambda inputs, n: runs.append(n) or original(inputs, n))
    llm._engine = engine
    prompts = random_prompts(6, seed=41, lengths=(3, 70))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, **GREEDY))
    hf = tiny_hf_model(arch)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 5) for p in prompts]
    assert any(n < 16 for n in runs) and any(16 < n < 64 for n in runs)  # padded up to both buckets
    assert engine.pool.num_used_blocks == 0


def test_prompt_logits_through_the_pieces_equal_the_eager_graph(llama_llm, monkeypatch):
    engine = engine_with_pieces(llama_llm, (32,))
    runs = []
    original = engine.runner.prefill_graphs.run
    monkeypatch.setattr(engine.runner.prefill_graphs, "run", lambda inputs, n: runs.append(n) or original(inputs, n))
    tokens = random_prompts(1, seed=42, lengths=(20, 20))[0]
    pieces = engine.prompt_logits(tokens)
    assert runs == [20]
    torch.testing.assert_close(pieces, llama_llm.engine.prompt_logits(tokens), atol=1e-6, rtol=0)


def test_a_graph_without_recorded_shapes_is_not_split(llama_llm):
    """Token rows are told apart by the export's shapes; without them the graph stays whole (and eager)."""
    graph = llama_llm.graph
    copy = torch.fx.GraphModule(graph, torch.fx.Graph())
    copy.graph.graph_copy(graph.graph, {})
    input_ids = next(n for n in copy.graph.nodes if n.op == "placeholder" and n.target == "input_ids")
    del input_ids.meta["val"]
    with pytest.raises(NotSplittable, match="recorded shape"):
        split_into_pieces(copy)


def test_a_failed_capture_leaves_prefill_eager_with_a_warning(llama_llm, monkeypatch, caplog):
    def refuse(self, probe_inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PiecewiseGraphs, "capture_all", refuse)
    with caplog.at_level("WARNING", logger="autodeploy.runtime.model_runner"):
        engine = engine_with_pieces(llama_llm, (16, 64))
    assert engine.runner.prefill_graphs is None
    assert any("prefill CUDA graph capture failed" in r.message and "run eagerly" in r.message for r in caplog.records)
    tokens = random_prompts(1, seed=44, lengths=(30, 30))[0]
    torch.testing.assert_close(engine.prompt_logits(tokens), llama_llm.engine.prompt_logits(tokens), atol=1e-6, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_captured_pieces_replay_what_the_eager_graph_computes(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cuda", dtype="float32", max_batch_size=8,
                     scheduler={"max_num_tokens": 128})
    engine = llm.engine
    assert engine.runner.prefill_graphs is not None and engine.runner.prefill_graphs._graphs
    prompts = random_prompts(8, seed=43, lengths=(2, 90))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    hf = tiny_hf_model("llama")
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, 6) for p in prompts]
    tokens = prompts[0] + prompts[1]
    eager = engine_with_pieces(llm, ())
    torch.testing.assert_close(engine.prompt_logits(tokens), eager.prompt_logits(tokens), atol=1e-4, rtol=0)
