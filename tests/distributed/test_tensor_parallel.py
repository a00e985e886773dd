"""Tensor parallelism on the CPU: two gloo processes, as ``torchrun --nproc-per-node 2`` starts them, each
deploying the tiny models with ``distributed.tensor_parallel=2``; their logits equal one process's and their
greedy tokens equal HF's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.cli.main import main
from autodeploy.errors import ConfigError

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
PROMPT = [5, 6, 7, 8]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ARCHITECTURES = ["llama", "qwen2"]  # qwen2: q/k/v biases (sliced), GQA


def deploy_each(rank: int, world: int, directories: list[str]) -> list[dict]:
    """One rank's results of each tiny model deployed over ``world`` ranks (a job of the spawn in conftest.py)."""
    results = []
    for directory in directories:
        llm = autodeploy(directory, device="cpu", distributed={"tensor_parallel": world, "timeout_s": 120})
        logits = [t.tolist() for t in llm.logits(SEQUENCES)]
        tokens = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
        params = sum(p.numel() for p in llm.graph.parameters())
        results.append({"logits": logits, "tokens": list(tokens), "params": params, "report": llm.pipeline_report()})
    return results


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_ranks_compute_one_process_logits_and_hf_greedy_tokens(tiny_checkpoint, two_ranks, arch):
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint(arch)
    single = autodeploy(str(directory), device="cpu")
    want = single.logits(SEQUENCES)
    index = ARCHITECTURES.index(arch)
    ranks = [result["architectures"][index] for result in two_ranks]
    for result in ranks:
        for got, expected in zip(result["logits"], want):
            torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)
    for rank, result in enumerate(ranks):
        assert (f"rank {rank} of 2: 2 attentions (2 output projections all-reduced), 2 MLPs, 1 embeddings and the "
                f"LM head vocabulary-parallel") in result["report"]
    hf = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):].tolist()
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == greedy
    # Each rank holds half of every projection, of the embedding and of the LM head, and all of the norms.
    named = dict(single.graph.named_parameters())
    norms = sum(p.numel() for name, p in named.items() if "norm" in name)
    total = sum(p.numel() for p in named.values())
    assert norms and ranks[0]["params"] == ranks[1]["params"] == norms + (total - norms) // 2


def test_torchrun_variables_that_do_not_match_the_parallelism_are_a_config_error(tiny_checkpoint, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")  # a launcher's variables, incomplete
    with pytest.raises(ConfigError, match="missing WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", distributed={"tensor_parallel": 2})
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(ConfigError, match="needs 2 processes but torchrun started 3"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", distributed={"tensor_parallel": 2})


def test_what_tensor_parallelism_cannot_slice_is_refused_at_build(tiny_checkpoint, monkeypatch):
    # The tiny models' 4 heads and 2 KV heads over 3 ranks, quantized MoE experts, quantization (each check runs
    # before any collective).
    from autodeploy import api
    monkeypatch.setattr(api, "init_distributed", lambda settings, store=None: None)
    monkeypatch.setattr(api, "should_spawn", lambda settings: False)
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 must divide the attention heads \(4\)"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", distributed={"tensor_parallel": 3})
    with pytest.raises(ConfigError, match="quantize.experts=int8_wo with expert_parallel=1 and tensor_parallel=2 is not "
                                          "available.*set expert_parallel=2"):
        autodeploy(str(tiny_checkpoint("mixtral")), device="cpu", distributed={"tensor_parallel": 2},
                   quantize={"experts": "int8_wo"})
    with pytest.raises(ConfigError, match="with quantization is not available yet"):
        autodeploy(str(tiny_checkpoint("llama")), device="cpu", distributed={"tensor_parallel": 2},
                   quantize={"default": "int8_wo"})


def test_autodeploy_run_under_torchrun_prints_rank_zeros_completion_once(tiny_checkpoint, capsys):
    # The CLI as a user starts it: `torchrun --nproc-per-node 2 -m autodeploy run MODEL --tp 2`; the one-process
    # reference runs in this process (a process of its own would import torch again for the same output).
    directory = str(tiny_checkpoint("llama"))
    argv = ["run", directory, "--prompt", "def f(", "--max-tokens", "6", "--set", "device=cpu"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "autodeploy", *argv, "--tp", "2"], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert single.strip() and ranks.stdout == single
