"""Decode steps that prefetch the next projection's weight into L2 (``runtime/weight_prefetch.py``).

On the CPU the prefetch calls return at once, so the engine runs the rewritten decode graph exactly as a GPU
would minus the hint: generation must stay token-identical to Hugging Face. The rewrite itself is checked
node by node: after each weight-streaming node, the next one's weight; one join before the output; the
original graph untouched and the weights shared, not copied.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from autodeploy.runtime.weight_prefetch import join_prefetches, prefetch_after, with_weight_prefetches
from tests.runtime.test_cuda_graphs import engine_with_graphs
from tests.runtime.test_engine import GREEDY, hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model


def test_each_streaming_node_prefetches_the_next_ones_weight(llama_llm, monkeypatch):
    monkeypatch.setattr("autodeploy.runtime.weight_prefetch._STREAMED_BYTES", 1)  # the tiny model's weights count
    graph = llama_llm.graph
    before = [n.format_node() for n in graph.graph.nodes]
    prefetching, count = with_weight_prefetches(graph, 1 << 20)
    assert [n.format_node() for n in graph.graph.nodes] == before  # a copy; the original is untouched
    calls = [n for n in prefetching.graph.nodes if n.target is prefetch_after]
    assert count == len(calls) > 0
    for call in calls:
        fetched = call.args[1]
        assert fetched.op == "get_attr" and call.args[2] == 1 << 20
        later = call.next
        while not any(a.op == "get_attr" and a.target == fetched.target for a in later.all_input_nodes):
            later = later.next  # the next streaming node reads the weight fetched
        assert later.op == "call_function"
    joins = [n for n in prefetching.graph.nodes if n.target is join_prefetches]
    assert len(joins) == 1 and joins[0].next.op == "output"
    for name, tensor in prefetching.named_parameters():
        assert tensor is dict(graph.named_parameters())[name]  # shared


def test_without_two_streaming_nodes_the_graph_is_returned_as_is(llama_llm):
    graph, count = with_weight_prefetches(llama_llm.graph, 1 << 20)  # the tiny model's weights are under 1 MiB
    assert graph is llama_llm.graph and count == 0


def test_the_calls_do_nothing_on_the_cpu():
    weight = torch.randn(8, 8)
    prefetch_after(torch.randn(1, 1, 8), weight, 1 << 20)
    result = object()
    assert join_prefetches(result, 0) is result


def test_decode_steps_with_prefetches_match_hf_generate(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr("autodeploy.runtime.weight_prefetch._STREAMED_BYTES", 1)
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", max_batch_size=4, verify={"enabled": False},
                     compile={"l2_prefetch_bytes": 1 << 20})
    llm._engine = engine = engine_with_graphs(llm, (1, 4))
    assert any(n.target is prefetch_after for n in engine.decode_graphs.graph.graph.nodes)
    hf = tiny_hf_model("llama")
    prompts = random_prompts(4, seed=5, lengths=(1, 30))
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=6, **GREEDY)] * 4)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


def test_a_negative_byte_count_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="l2_prefetch_bytes"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", compile={"l2_prefetch_bytes": -1})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_decode_graphs_with_prefetches_replay_what_they_replay_without(llama_dir, monkeypatch):
    # The side stream's fork and join inside each capture, and the prefetch kernels replayed: same logits.
    monkeypatch.setattr("autodeploy.runtime.weight_prefetch._STREAMED_BYTES", 1)
    prompts = random_prompts(5, seed=6, lengths=(1, 60))
    params = [SamplingParams(max_tokens=4 + 3 * i, logprobs=0, **GREEDY) for i in range(5)]
    common = dict(device="cuda", dtype="float32", max_batch_size=8, kv_cache={"num_blocks": 256})
    plain = autodeploy(str(llama_dir), compile={"batch_sizes": [1, 2, 4, 8]}, **common)
    prefetching = autodeploy(str(llama_dir), compile={"batch_sizes": [1, 2, 4, 8], "l2_prefetch_bytes": 1 << 20}, **common)
    graphs = prefetching.engine.decode_graphs
    assert all(graphs.batches[size].graph is not None for size in (1, 2, 4, 8))
    assert any(n.target is prefetch_after for n in graphs.graph.graph.nodes)
    expected = [o.outputs[0] for o in plain.generate(prompts, params)]
    got = [o.outputs[0] for o in prefetching.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=0, rtol=0)
