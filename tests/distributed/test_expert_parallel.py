"""MoE layers over two ranks on the CPU: two gloo processes, as ``torchrun --nproc-per-node 2`` starts them.

- the ``moe_expert_parallel`` op alone: tokens sent to their experts' ranks with all-to-all (uneven shares, a rank
  with no tokens, a rank whose experts nobody picks) equal one process's ``moe``, the same bits on both ranks;
- the tiny Mixtral deployed with expert_parallel=2 (balanced placement), expert_parallel=2 with tensor_parallel=2,
  and tensor_parallel=2 alone (experts sliced by intermediate size): logits equal one process's, greedy tokens
  equal HF's, each rank holds half of the experts' parameters;
- the tiny Mixtral with quantized experts (``quantize.experts``: int8_wo, balanced placement; int4_wo, contiguous)
  and expert_parallel=2: logits and greedy tokens equal one process's quantized deploy, each rank holds half of
  the experts' bytes.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autodeploy import SamplingParams, autodeploy
from tests.distributed.test_tensor_parallel import PROMPT, SEQUENCES, _free_port

# (tokens, experts whose logits are raised): 1 token (rank 1 routes none), 5 (shares of 2 and 3), 8 tokens all sent
# to experts 0 and 1 (under the reversed placement, both on rank 1: rank 0 receives none).
CASES = [(1, ()), (5, ()), (8, (0, 1))]
ORDER = [3, 2, 1, 0]  # rank 0 holds experts 3 and 2, rank 1 experts 1 and 0


def _environment(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)


def _case(tokens: int, raised: tuple[int, ...]):
    generator = torch.Generator().manual_seed(tokens)
    x, logits = torch.randn(tokens, 6, generator=generator), torch.randn(tokens, 4, generator=generator)
    logits[:, list(raised)] += 10.0
    return x, logits, torch.randn(4, 8, 6, generator=generator), torch.randn(4, 6, 4, generator=generator)


def _op_results(rank: int, world: int) -> list:
    """This rank's ``moe_expert_parallel`` of each case, in a gloo group of its own (left before the deploys)."""
    from autodeploy.custom_ops import parallel_state

    dist.init_process_group("gloo")
    parallel_state.configure(1, world, 1)
    results = []
    for tokens, raised in CASES:
        x, logits, gate_up, down = _case(tokens, raised)
        mine = ORDER[rank * 2:(rank + 1) * 2]
        results.append(torch.ops.autodeploy.moe_expert_parallel(x, logits, gate_up[mine], down[mine], ORDER, 2).tolist())
    dist.destroy_process_group()
    parallel_state.reset()
    return results


def test_two_ranks_exchange_tokens_with_all_to_all_like_one_moe(deployed_ranks):
    ranks = [result["op"] for result in deployed_ranks]
    assert ranks[0] == ranks[1]  # the same bits on every rank
    for (tokens, raised), got in zip(CASES, ranks[0]):
        x, logits, gate_up, down = _case(tokens, raised)
        torch.testing.assert_close(torch.tensor(got), torch.ops.autodeploy.moe(x, logits, gate_up, down, 2),
                                   atol=1e-6, rtol=1e-6)


# One spawn (two interpreters, each importing torch) runs the op alone, then deploys the tiny Mixtral on both ranks
# in every layout, then with each quantized-experts setting, one after another: `deployed_ranks`.
LAYOUTS = {
    "expert_parallel": {"expert_parallel": 2, "expert_placement": "balanced"},
    "expert_and_tensor_parallel": {"expert_parallel": 2, "tensor_parallel": 2, "expert_placement": "balanced"},
    "tensor_parallel": {"tensor_parallel": 2},
}
CALIBRATION = {"calibration": {"samples": 8, "seq_len": 64}}  # the text balanced placement routes: 512 tokens


def _layouts(directory: str) -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        llm = autodeploy(directory, device="cpu", distributed={**layout, "timeout_s": 120}, quantize=CALIBRATION)
        logits = [t.tolist() for t in llm.logits(SEQUENCES)]
        tokens = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
        experts = sum(p.numel() for p in llm.graph.parameters() if p.dim() == 3)
        results[name] = {"logits": logits, "tokens": list(tokens), "experts": experts, "report": llm.pipeline_report()}
        llm.shutdown()  # the next layout differs: a live deployment laid out otherwise would refuse it
    return results


@pytest.fixture(scope="module")
def mixtral(tiny_checkpoint):
    """The tiny Mixtral's directory, one process's logits and expert parameters, and HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint("mixtral")
    single = autodeploy(str(directory), device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):].tolist()
    experts = sum(p.numel() for p in single.graph.parameters() if p.dim() == 3)
    return directory, single.logits(SEQUENCES), experts, greedy


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_ranks_serve_the_moe_model_as_one_process(mixtral, deployed_ranks, name):
    directory, want, experts, greedy = mixtral
    ranks = [result["layouts"][name] for result in deployed_ranks]
    for result in ranks:
        for got, expected in zip(result["logits"], want):
            torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == greedy
    assert ranks[0]["experts"] == ranks[1]["experts"] == experts // 2  # half of every expert, or half of the experts
    report = ranks[0]["report"]
    if name == "tensor_parallel":
        assert "rank 0 of 2: 2 MoE layers' experts sliced by intermediate size (64 of 128 a rank), all-reduced" in report
        return
    assert "rank 0 of 2: 2 MoE layers, 2 of 4 experts a rank, tokens dispatched with all-to-all" in report
    found = re.search(r"placement balanced on 512 calibration tokens' routing: load imbalance \(max / mean rank load\) "
                      r"contiguous ([\d.]+) → balanced ([\d.]+)", report)
    assert found, report
    before, after = map(float, found.groups())
    assert after <= before
    assert report.count("pairs routed to each expert") == 2  # a line per MoE layer
    assert found.group(0) in ranks[1]["report"]  # both ranks measured alike, so they place alike
    print(f"\n{name}: " + "\n".join(line.strip() for line in report.splitlines() if "expert" in line))


# Two deploys in one spawn: int8 experts placed by routing (rows that are not one range), int4 experts contiguous.
QUANTIZED = {"int8_wo": {"expert_placement": "balanced"}, "int4_wo": {}}


def _quantized_settings(scheme: str) -> dict:
    return {"experts": scheme, "int4_group_size": 32, **CALIBRATION}


def _expert_bytes(llm) -> int:
    return sum(p.numel() * p.element_size() for name, p in llm.graph.named_parameters() if ".experts." in name)


def _quantized(directory: str) -> dict:
    results = {}
    for scheme, placement in QUANTIZED.items():
        llm = autodeploy(directory, device="cpu", distributed={"expert_parallel": 2, **placement, "timeout_s": 120},
                         quantize=_quantized_settings(scheme))
        tokens = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
        results[scheme] = {"logits": [t.tolist() for t in llm.logits(SEQUENCES)], "tokens": list(tokens),
                           "bytes": _expert_bytes(llm), "report": llm.pipeline_report(),
                           "ops": sorted({str(n.target) for n in llm.graph.graph.nodes if "moe" in str(n.target)})}
        del llm
    return results


def _deploy_rank(rank: int, world: int, port: int, directory: str, out: str) -> None:
    _environment(rank, world, port)
    results = {"op": _op_results(rank, world), "layouts": _layouts(directory), "quantized": _quantized(directory)}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def deployed_ranks(mixtral, tmp_path_factory) -> list[dict]:
    """Each rank's results of every deploy of `_deploy_rank`, from one spawn."""
    out = str(tmp_path_factory.mktemp("moe-ranks") / "rank")
    mp.start_processes(_deploy_rank, args=(2, _free_port(), str(mixtral[0]), out), nprocs=2, start_method="spawn")
    return [json.load(open(f"{out}.{rank}")) for rank in range(2)]


def test_two_ranks_serve_quantized_experts_as_one_process_quantizes_them(mixtral, deployed_ranks):
    directory = mixtral[0]
    ranks = [result["quantized"] for result in deployed_ranks]
    for scheme in QUANTIZED:
        single = autodeploy(str(directory), device="cpu", quantize=_quantized_settings(scheme))
        want = single.logits(SEQUENCES)
        greedy = single.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
        for result in (ranks[0][scheme], ranks[1][scheme]):
            for got, expected in zip(result["logits"], want):
                torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)
            assert result["tokens"] == list(greedy)
            assert result["bytes"] == _expert_bytes(single) // 2  # half of the experts, each with its own scales
            assert f"2 MoE layers' experts {scheme}" in result["report"]
            assert result["ops"] == [f"autodeploy.moe_expert_parallel_{scheme}.default"]
