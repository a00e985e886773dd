"""``batch_invariant: true`` end to end: every GEMM, norm and attention node takes its batch-invariant kernel, a
token's logits are the same bits in a forward of any length, and greedy decoding with speculation equals decoding
without it. Without a GPU the Triton kernels run in the interpreter (``tests/conftest.py``), admitted here by
stubbing the device check, in float32 (the interpreter's bfloat16 dots are wrong: triton-lang/triton#11584); on a
GPU the same tests run in bfloat16 on the compiled kernels. Refusals: a CPU deploy, ops with no invariant kernel,
tree drafts, a ``backends`` entry for an op the setting decides."""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.custom_ops import op_by_target
from autodeploy.custom_ops.triton import triton_unavailable
from autodeploy.errors import ConfigError
from tests.custom_ops.test_paged_attention_triton import interpreter_loops_with_numpy_2_4  # noqa: F401  (autouse)
from tests.custom_ops.test_batch_invariant import interpreter_dots_row_by_row  # noqa: F401  (autouse)
from tests.runtime.test_eagle3 import head_dir  # noqa: F401  (a fixture: a tiny EAGLE-3 head for the tiny Llama)
from tests.runtime.test_tree_drafts import _trees  # noqa: F401  (registers the "test_trees" drafter)

GPU = torch.cuda.is_available()
DEPLOY = dict(device="cuda", dtype="bfloat16", kv_cache={"num_blocks": 64}) if GPU else dict(device="cpu", dtype="float32")
QUICK = dict(verify={"enabled": False}, batch_invariant=True, max_seq_len=96, max_batch_size=4,
             scheduler={"max_num_tokens": 64}, **DEPLOY)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DECIDED = {"linear", "fused_gated_mlp", "add_rms_norm", "rms_norm", "cached_attention_rope"}


@pytest.fixture(scope="module")
def interpreted():
    """On a CPU: let the batch-invariant backends run on CPU tensors, in Triton's interpreter."""
    with pytest.MonkeyPatch.context() as patch:
        if not GPU:
            patch.setattr("autodeploy.custom_ops.batch_invariant.triton_unavailable", lambda device: None)
        yield


@pytest.fixture(scope="module")
def invariant_llm(llama_dir, interpreted):
    return autodeploy(str(llama_dir), **QUICK)


def kernels_by_op(llm) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for node in llm.graph.graph.nodes:
        match = op_by_target(node.target) if node.op == "call_function" else None
        if match is not None:
            found.setdefault(match[0].name, set()).add(match[1])
    return found


def test_every_reducing_node_takes_its_batch_invariant_kernel(invariant_llm):
    kernels = kernels_by_op(invariant_llm)
    assert DECIDED <= set(kernels)
    for op in DECIDED:
        assert kernels[op] == {"invariant"}, op
    assert "→ linear_invariant (batch_invariant)" in invariant_llm.pipeline_report()


def test_a_tokens_logits_are_the_same_bits_in_a_forward_of_any_length(invariant_llm):
    """One forward over 24 tokens, then forwards over prefixes: row i is the same bits each time (the fast kernels
    pick other tiles, splits and attention kernels by length)."""
    ids = [(7 * i + 3) % 200 + 5 for i in range(24)]
    whole = invariant_llm.engine.prompt_logits(ids)
    for length in (1, 5, 17):
        assert torch.equal(invariant_llm.engine.prompt_logits(ids[:length])[-1], whole[length - 1]), length


def test_greedy_decoding_with_speculation_is_identical(llama_dir, interpreted, invariant_llm, head_dir):
    """An EAGLE-3 head drafts (the graph also copies out hidden states; on a GPU verification runs through the
    verify graphs): every token comes out of a verification forward, and the output is the plain one."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [12] * 7]
    plain = [o.outputs[0].token_ids for o in invariant_llm.generate(prompts, GREEDY)]
    speculative = autodeploy(str(llama_dir), **QUICK, speculative={"method": "eagle3", "model": str(head_dir),
                                                                  "num_tokens": 3, "auto": False})
    assert [o.outputs[0].token_ids for o in speculative.generate(prompts, GREEDY)] == plain
    assert speculative.engine.speculator.stats.drafted > 0  # it did verify drafted tokens


def test_a_cpu_deploy_is_refused_by_name(llama_dir, monkeypatch):
    if GPU:
        pytest.skip("the refusal is for devices without Triton")
    monkeypatch.setattr("autodeploy.custom_ops.batch_invariant.triton_unavailable", triton_unavailable)  # not stubbed
    with pytest.raises(ConfigError, match="batch_invariant: true needs the batch-invariant Triton kernels.*CUDA"):
        autodeploy(str(llama_dir), **QUICK)


def test_ops_without_an_invariant_kernel_are_refused_by_name(llama_dir, interpreted):
    with pytest.raises(ConfigError, match=r"no batch-invariant kernel serves int8_wo_linear \(×\d+\)"):
        autodeploy(str(llama_dir), **QUICK, quantize={"default": "int8_wo"})


def test_tree_drafts_are_refused_by_name(llama_dir, interpreted):
    with pytest.raises(ConfigError, match="batch_invariant: true, but cached_attention_rope's batch-invariant kernel "
                                          "cannot serve node .*tree drafts"):
        autodeploy(str(llama_dir), **QUICK, speculative={"method": "test_trees", "num_tokens": 3, "tree_width": 2})


def test_a_backends_entry_for_a_decided_op_is_refused(llama_dir, interpreted):
    with pytest.raises(ConfigError, match="batch_invariant: true selects the batch-invariant kernel of linear"):
        autodeploy(str(llama_dir), **QUICK, backends={"linear": ["torch"]})
