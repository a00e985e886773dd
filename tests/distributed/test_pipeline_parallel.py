"""Pipeline parallelism on the CPU: gloo processes, as ``torchrun`` starts them, each deploying the tiny Llama
(2 layers) with ``distributed.pipeline_parallel=2`` (one layer a stage), alone or with ``tensor_parallel=2``
(4 processes); their logits equal one process's, their greedy tokens HF's, and in-flight batching of mixed
requests in GPipe micro-batches gives one process's tokens, on every rank."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
PROMPT = [5, 6, 7, 8]
# Mixed prompt lengths and max_tokens, one sampled with a seed; at most 3 run at once and a step holds at
# most 16 tokens, so prompts are prefilled in chunks beside decodes and the later requests join as others finish.
MIXED = [list(range(3, 3 + n)) for n in (3, 21, 7, 1, 12)]
MIXED_PARAMS = [dict(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 3, 9, 5, 2)]
MIXED_PARAMS[2].update(temperature=0.8, seed=7)
SERVING = dict(max_batch_size=3, scheduler={"max_num_tokens": 16})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mixed(llm) -> list[list[int]]:
    outputs = llm.generate(MIXED, [SamplingParams(**p) for p in MIXED_PARAMS])
    return [list(o.outputs[0].token_ids) for o in outputs]


def _rank(rank: int, world: int, port: int, directory: str, out: str, distributed: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from autodeploy.runtime.pipeline_schedule import PipelineSchedule

    llm = autodeploy(directory, device="cpu", distributed={**distributed, "timeout_s": 120}, **SERVING)
    result = {
        "logits": [t.tolist() for t in llm.logits(SEQUENCES)],
        "tokens": list(llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
                       .outputs[0].token_ids),
        "params": {name: p.numel() for name, p in llm.graph.named_parameters()},
        "report": llm.pipeline_report(),
        "caches": sorted(llm.engine.caches),
    }
    if distributed.get("pipeline_micro_batches", 1) > 1:
        result["mixed"] = {"async": _mixed(llm)}
        for name, schedule in (("sync", PipelineSchedule(2, overlapped=False)),
                               ("depth 1", PipelineSchedule(3, overlapped=True, depth=1))):
            llm.engine.runner.schedule = schedule
            result["mixed"][name] = _mixed(llm)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def _run_ranks(directory, tmp_path, world: int, distributed: dict) -> list[dict]:
    out = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(world, _free_port(), str(directory), out, distributed), nprocs=world,
                       start_method="spawn")
    results = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            results.append(json.load(f))
    return results


def _assert_logits(ranks: list[dict], want: list[torch.Tensor]) -> None:
    for result in ranks:
        for got, expected in zip(result["logits"], want):
            torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)


def test_two_stages_compute_one_process_logits_hf_greedy_tokens_and_its_in_flight_batches(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint("llama")
    single = autodeploy(str(directory), device="cpu", **SERVING)
    ranks = _run_ranks(directory, tmp_path, 2, {"pipeline_parallel": 2, "pipeline_micro_batches": 2})
    _assert_logits(ranks, single.logits(SEQUENCES))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):].tolist()
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == greedy
    # Mixed requests in micro-batches of every schedule: one process's tokens, on both ranks.
    want = _mixed(single)
    for result in ranks:
        assert result["mixed"] == {"async": want, "sync": want, "depth 1": want}
    # Stage 0 holds layer 0 and the (tied) embedding table; stage 1 layer 1, the final norm and the same table
    # as the LM head: each about half of the layers, and its own KV cache.
    named = {name: p.numel() for name, p in single.graph.named_parameters()}
    table = named["model.lm_head.weight"]
    layer = {i: sum(n for name, n in named.items() if f"layers.{i}." in name) for i in (0, 1)}
    assert layer[0] == layer[1] > 0
    assert sum(ranks[0]["params"].values()) == table + layer[0]
    assert sum(ranks[1]["params"].values()) == table + layer[1] + named["model.model.norm.weight"]
    assert not any("layers.1." in name for name in ranks[0]["params"])
    assert not any("layers.0." in name for name in ranks[1]["params"])
    assert ranks[0]["caches"] == ["k_cache_0", "v_cache_0"] and ranks[1]["caches"] == ["k_cache_1", "v_cache_1"]
    assert "stage 0 of 2: layers 0…0 of 2 (1 attentions); sends add_7 to rank 1, receives the logits from rank 1" in ranks[0]["report"]
    assert "stage 1 of 2: layers 1…1 of 2 (1 attentions); receives add_7 from rank 0; sends the logits to ranks [0]" in ranks[1]["report"]


def test_two_stages_of_two_tensor_parallel_ranks_compute_one_process_logits(tiny_checkpoint, tmp_path):
    directory = tiny_checkpoint("qwen2")  # q/k/v biases, untied LM head
    single = autodeploy(str(directory), device="cpu", **SERVING)
    ranks = _run_ranks(directory, tmp_path, 4, {"tensor_parallel": 2, "pipeline_parallel": 2})
    _assert_logits(ranks, single.logits(SEQUENCES))
    assert len({tuple(result["tokens"]) for result in ranks}) == 1
    # Ranks 0, 1 (stage 0) pass to ranks 2, 3 (stage 1), each to the rank of its place; each rank holds a quarter
    # of the layers' projections.
    for rank, result in enumerate(ranks):
        peer = rank + 2 if rank < 2 else rank - 2
        assert re.search(rf"sends \w+ to rank {peer}" if rank < 2 else rf"receives \w+ from rank {peer}", result["report"])
    assert all(not any("lm_head" in name for name in result["params"]) for result in ranks[:2])
    assert all(not any("embed_tokens" in name for name in result["params"]) for result in ranks[2:])


def test_what_pipeline_parallelism_cannot_cut_is_refused_at_build(tiny_checkpoint, monkeypatch):
    # One process standing in for a rank of 3 stages (each check runs before any transfer).
    from autodeploy import api
    from autodeploy.custom_ops import parallel_state

    monkeypatch.setattr(api, "init_distributed", lambda settings, store=None: None)
    monkeypatch.setattr(api, "check_parallelism", lambda settings, config: None)  # the graph's own check, not the config's
    monkeypatch.setenv("RANK", "0")  # not a plain process: nothing is spawned
    monkeypatch.setattr(parallel_state, "_layout", parallel_state.Layout(pipeline_parallel=3))
    with pytest.raises(ConfigError, match=r"pipeline_parallel=3 must divide the layers \(2 attention layers"):
        autodeploy(str(tiny_checkpoint("llama")), device="meta", distributed={"pipeline_parallel": 3})
    monkeypatch.setattr(parallel_state, "_layout", parallel_state.Layout(pipeline_parallel=2))
    with pytest.raises(ConfigError, match="pipeline_parallel > 1 with quantization"):
        autodeploy(str(tiny_checkpoint("llama")), device="meta", distributed={"pipeline_parallel": 2},
                   quantize={"default": "int8_wo"})
    with pytest.raises(ConfigError, match="compile.backend=torch_compile with pipeline_parallel > 1"):
        autodeploy(str(tiny_checkpoint("llama")), device="meta", distributed={"pipeline_parallel": 2},
                   compile={"backend": "torch_compile"})
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="pipeline_schedule sync or async"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", distributed={"pipeline_parallel": 2, "pipeline_schedule": "1f1b"})
    with pytest.raises(ConfigError, match=r"pipeline_parallel=3 must divide the layers \(2\)"):  # before any process starts
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", distributed={"pipeline_parallel": 3})
