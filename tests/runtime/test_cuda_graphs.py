"""Decode steps on static, padded inputs (``runtime/cuda_graphs.py``) and the compile stage that declares them.

On the CPU nothing is captured, but the engine runs the same padded static buffers a GPU replays, so the
padding (rows writing into the pad block, dropped logits), the bucket choice and the buffer refills are
checked against Hugging Face here; the GPU test captures and replays for real.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from autodeploy.runtime.cuda_graphs import DecodeGraphs
from autodeploy.runtime.engine import Engine
from autodeploy.runtime.model_runner import ModelRunner
from autodeploy.transforms.compile_model import _capturable_advice, default_batch_sizes, uncapturable_nodes
from tests.runtime.test_engine import GREEDY, hf_greedy, random_prompts
from tests.tiny_models import tiny_hf_model


def engine_with_graphs(llm, sizes) -> Engine:
    signature = dataclasses.replace(llm.deployment.signature, decode_graph_batch_sizes=sizes, prefill_graph_token_sizes=())
    return Engine(dataclasses.replace(llm.deployment, signature=signature, eos_token_ids=()))


def test_default_batch_sizes_cover_every_batch_up_to_the_maximum():
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert default_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    sizes = default_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 32) and sizes[-3:] == (192, 224, 256)
    assert all(b / a <= 2 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_padded_decode_steps_match_hf_generate(tiny_checkpoint, arch, monkeypatch):
    llm = autodeploy(str(tiny_checkpoint(arch)), device="cpu", max_batch_size=8, verify={"enabled": False})
    engine = engine_with_graphs(llm, (1, 4, 8))
    sizes_run = []
    replay = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, size, rows: sizes_run.append((rows, size)) or replay(self, size, rows))
    llm._engine = engine
    hf = tiny_hf_model(arch)
    prompts = random_prompts(7, seed=3, lengths=(1, 40))
    params = [SamplingParams(max_tokens=3 + 2 * i, **GREEDY) for i in range(7)]  # finishing at different steps
    outputs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, p.max_tokens)
    assert {(1, 1), (3, 4), (5, 8), (6, 8), (7, 8)} <= set(sizes_run)  # padded up to the next captured size
    assert engine.pool.num_used_blocks == 0
    # Padding rows write into one block more than the pool hands out (they would clobber the 7 otherwise).
    assert engine.caches["k_cache_0"].shape[0] == engine.pool.num_blocks + 1
    assert engine.runner.decode_graphs.pad_block == engine.pool.num_blocks


def test_larger_batches_and_prefill_steps_run_eagerly(llama_llm):
    engine = engine_with_graphs(llama_llm, (1, 2))
    graphs = engine.runner.decode_graphs
    prefill = [type("C", (), {"length": 5, "completes": True})()]
    decodes = [type("C", (), {"length": 1, "completes": True})() for _ in range(3)]
    assert not graphs.serves(prefill) and not graphs.serves(decodes) and graphs.serves(decodes[:2])
    midway = [type("C", (), {"length": 1, "completes": False})()]
    assert not graphs.serves(midway) and graphs.serves(midway, logits_for_all_tokens=True)


def test_the_compile_stage_declares_sizes_only_for_capturable_gpu_graphs(llama_llm):
    assert "decode: no CUDA graphs (they need a GPU; the deploy runs on cpu)" in llama_llm.pipeline_report()
    assert type(llama_llm.engine.runner) is ModelRunner  # eager: no graph to capture on the CPU
    # On the CPU attention (RoPE fused into its cache write) runs the SDPA kernel, which reads kv_lens on the
    # host: no graph could hold it.
    blockers = uncapturable_nodes(llama_llm.graph)
    assert len(blockers) == 2 and all(b.endswith("cached_attention_rope_sdpa") for b in blockers)


def test_the_advice_for_a_graph_kept_eager_names_each_ops_capturable_kernels():
    assert _capturable_advice(["cached_attention", "cached_cross_attention", "cached_attention"]) == (
        "choose capturable kernels (backends: {cached_attention: [triton], cached_cross_attention: [triton, dense]}) or set "
        "compile.backend: none")
    assert _capturable_advice(["moe", "moe_expert_parallel"]).startswith("no capturable kernel serves moe_expert_parallel; ")


@pytest.mark.parametrize("settings, message", [
    (dict(compile={"backend": "inductor"}), "compile.backend is 'inductor'; use one of none, cuda_graph"),
    (dict(compile={"batch_sizes": [0, 4]}), "compile.batch_sizes must list batch sizes ≥ 1"),
])
def test_bad_compile_settings_fail_at_build(llama_dir, settings, message):
    with pytest.raises(ConfigError, match=message):
        autodeploy(str(llama_dir), device="cpu", **settings)


def test_a_failed_capture_serves_eagerly_with_a_warning(llama_llm, monkeypatch, caplog):
    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture_all", fail)
    engine = engine_with_graphs(llama_llm, (1, 2))
    assert engine.runner.decode_graphs is None
    assert "decode CUDA graph capture failed (RuntimeError: operation not permitted" in caplog.text
    request = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert len(request.output(llama_llm.tokenizer).token_ids) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_decode_graphs_replay_what_eager_decoding_computes(llama_dir):
    # 7 requests finishing one after another: decode batches of 7 … 1 replay sizes 8, 4, 2 and 1, padded.
    prompts = random_prompts(7, seed=4, lengths=(1, 60))
    params = [SamplingParams(max_tokens=4 + 3 * i, logprobs=0, **GREEDY) for i in range(7)]
    common = dict(device="cuda", dtype="float32", max_batch_size=8, kv_cache={"num_blocks": 256})
    eager = autodeploy(str(llama_dir), compile={"backend": "none"}, **common)
    graphs = autodeploy(str(llama_dir), compile={"batch_sizes": [1, 2, 4, 8]}, **common)
    assert all(graphs.engine.runner.decode_graphs.batches[size].graph is not None for size in (1, 2, 4, 8))
    assert "decode: CUDA graphs at batch sizes 1, 2, 4, 8" in graphs.pipeline_report()
    expected = [o.outputs[0] for o in eager.generate(prompts, params)]
    got = [o.outputs[0] for o in graphs.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for ours, theirs in zip(got, expected):  # the logits themselves, not only their argmax
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_uploaded_after_capture_replays_its_work():
    from autodeploy.custom_ops.graph_capture import upload

    x = torch.arange(8.0, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = x * 2  # eager once before capture, as the engine does
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    assert upload(graph, torch.cuda.current_stream())
    x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(y, torch.full((8,), 7.0, device="cuda"))
