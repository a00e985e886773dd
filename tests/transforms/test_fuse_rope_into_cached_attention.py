"""``fuse_rope_into_cached_attention``: each layer's rope(q), rope(k) folds into its cached_attention, with
the same logits and generations as the unfused graph; layers it cannot fold are left alone, with the reason.
(Every coverage architecture, fused, against HF eager: ``tests/test_architecture_coverage.py``.)"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import AutoModelForCausalLM, GPT2Config

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy import SamplingParams, autodeploy
from autodeploy.pipeline import run_transform
from autodeploy.transforms import TransformConfig, TransformContext
from autodeploy.transforms.fuse_rope_into_cached_attention import FuseRopeIntoCachedAttention
from tests.coverage_models import eager_reference_model
from tests.custom_ops.test_paged_attention_triton import (  # noqa: F401  (the fixture lets the interpreter loop)
    interpreter_loops_with_numpy_2_4,
    paged_batch,
)

ops = torch.ops.autodeploy
UNFUSED = {"fuse_rope_into_cached_attention": {"enabled": False}}
FUSED = {"fuse_rope_into_cached_attention": {"enabled": True}}  # the default, stated so the tests read on their own
QUICK = dict(device="cpu", verify={"enabled": False})
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
GREEDY = SamplingParams(max_tokens=5, temperature=0, logprobs=0, ignore_eos=True)


def targets(llm) -> list[str]:
    return [str(n.target) for n in llm.graph.graph.nodes if n.op == "call_function"]


def record(llm):
    return next(r for r in llm.records if r.name == "fuse_rope_into_cached_attention")


def assert_same_outputs(fused, unfused) -> None:
    """Prompt logits, and greedy decodes whose every step reads keys the fused op rotated into the cache."""
    for ours, theirs in zip(fused.logits(SEQUENCES), unfused.logits(SEQUENCES)):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    ours, theirs = fused.generate(SEQUENCES, GREEDY), unfused.generate(SEQUENCES, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-6, rtol=0)


def test_llama_rotates_q_and_k_in_its_cache_write(llama_llm, llama_dir):
    # llama_llm is the default build, which fuses; the unfused one turns the pass off.
    unfused = autodeploy(str(llama_dir), **QUICK, transforms=UNFUSED)
    assert_same_outputs(llama_llm, unfused)
    assert record(llama_llm).matches == 2  # one per layer
    assert record(llama_llm).notes == "2 attention layers rotate q and k in their cache write (4 ropes folded in)"
    assert targets(llama_llm).count("autodeploy.cached_attention_rope_sdpa.default") == 2
    assert not any("rope_torch" in t or t == "autodeploy.cached_attention_sdpa.default" for t in targets(llama_llm))
    assert targets(unfused).count("autodeploy.rope_torch.default") == 4
    assert "cached_attention_rope ×2 → cached_attention_rope_sdpa (only candidate" in llama_llm.pipeline_report()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter; on a GPU the "
                    "kernel is checked in tests/custom_ops/test_cached_attention_rope.py and serves every deploy")
def test_the_triton_kernel_serves_a_fused_graph(tmp_path):
    # On the CPU select never picks Triton, so the fused nodes are retargeted by hand and run in the
    # interpreter: Phi-3's partial rotary, q/k/v as strided views of its fused projection, real angles.
    eager_reference_model("phi3").save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), **QUICK, transforms=FUSED)
    expected_logits, expected = llm.logits(SEQUENCES), llm.generate(SEQUENCES, GREEDY)
    fused = llm.graph.graph.find_nodes(op="call_function", target=ops.cached_attention_rope_sdpa.default)
    assert len(fused) == 2
    for node in fused:
        node.target = ops.cached_attention_rope_triton.default
    llm.graph.recompile()
    for ours, theirs in zip(llm.logits(SEQUENCES), expected_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert [o.token_ids for o in llm.generate(SEQUENCES, GREEDY)] == [o.token_ids for o in expected]


def test_a_model_without_rope_is_left_alone(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), **QUICK, transforms=FUSED)
    assert (record(llm).matches, record(llm).notes) == (0, "no cached_attention reads rope(q) and rope(k)")
    assert record(llm).details == ["2 attention layers left unfused: q is not a rope's output"]
    assert targets(llm).count("autodeploy.cached_attention_sdpa.default") == 2


# --- hand-built layers ------------------------------------------------------------------------------

def layer_inputs(rotary_dim: int = 16) -> tuple:
    q, k, v, k_cache, v_cache, *metadata, scale = paged_batch([(3, 3)], [5], q_heads=4, kv_heads=2)
    angles = torch.rand(1, q.shape[1], rotary_dim // 2, device=q.device).repeat(1, 1, 2)
    return (q, k, v, angles.cos(), angles.sin(), k_cache, v_cache, *metadata), scale


def fuse(layer, backends=None):
    """Trace ``layer`` on fake tensors, run the pass, and return (matches, notes, details, outputs before,
    outputs after, targets after); each run gets its own copy of the caches."""
    inputs, _ = layer_inputs()
    gm = make_fx(layer, tracing_mode="fake")(*inputs)

    def run():
        copies = [t.clone() for t in inputs]
        return [*gm(*copies), copies[5], copies[6]]  # outputs, then the caches as written

    before = run()
    result = run_transform(FuseRopeIntoCachedAttention(TransformConfig()), gm,
                           TransformContext(settings={"backends": backends or {}}))
    after = run()
    return result, before, after, [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


SCALE = 0.25


def two_ropes(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    rotated_q = ops.rope(q, cos, sin).transpose(1, 2).transpose(1, 2)  # the views the rope pattern leaves
    return (ops.cached_attention(rotated_q, ops.rope(k, cos, sin), v, k_cache, v_cache, *metadata, SCALE),)


def test_a_layer_fuses_through_views_that_cancel():
    result, before, after, targets_after = fuse(two_ropes)
    assert result.matches == 1 and result.changed
    assert targets_after == ["autodeploy.cached_attention_rope.default"]  # ropes and transposes gone
    for ours, theirs in zip(after, before):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, equal_nan=True)


def angles_built_once_per_rope(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    # GPT-OSS's spelling: the rope pattern duplicates half-width angles separately for q and for k.
    def duplicated(half):
        return torch.cat([half[..., :8], half[..., :8]], dim=-1)

    rotated_q = ops.rope(q, duplicated(cos), duplicated(sin))
    rotated_k = ops.rope(k, duplicated(cos), duplicated(sin))
    return (ops.cached_attention(rotated_q, rotated_k, v, k_cache, v_cache, *metadata, SCALE),)


def test_angles_computed_twice_by_the_same_pure_ops_count_as_one():
    result, before, after, targets_after = fuse(angles_built_once_per_rope)
    assert result.matches == 1
    # q's angles stay (per angle: a cat of two slices); k's copies are erased with its rope
    assert targets_after.count("aten.cat.default") == 2 and targets_after.count("aten.slice.Tensor") == 4
    for ours, theirs in zip(after, before):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, equal_nan=True)


def k_read_elsewhere(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    rotated_k = ops.rope(k, cos, sin)
    return ops.cached_attention(ops.rope(q, cos, sin), rotated_k, v, k_cache, v_cache, *metadata, SCALE), rotated_k


def other_angles_for_k(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    rotated_k = ops.rope(k, sin, cos)
    return (ops.cached_attention(ops.rope(q, cos, sin), rotated_k, v, k_cache, v_cache, *metadata, SCALE),)


def interleaved_k(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    rotated_k = ops.rope(k, cos, sin, True)
    return (ops.cached_attention(ops.rope(q, cos, sin), rotated_k, v, k_cache, v_cache, *metadata, SCALE),)


def unrotated_q(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    return (ops.cached_attention(q, ops.rope(k, cos, sin), v, k_cache, v_cache, *metadata, SCALE),)


def views_that_compose_to_the_identity(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    rotated_q = ops.rope(q, cos, sin).permute(0, 1, 3, 2).transpose(2, 3).transpose(0, 0)
    rotated_k = ops.rope(k, cos, sin).transpose(0, 1).transpose(0, 1)
    return (ops.cached_attention(rotated_q, rotated_k, v, k_cache, v_cache, *metadata, SCALE),)


def views_that_do_not_cancel(q, k, v, cos, sin, k_cache, v_cache, *metadata):
    rotated_q = ops.rope(q, cos, sin).transpose(1, 2)  # 4 tokens, 4 heads: the shape fits, the values do not
    return (ops.cached_attention(rotated_q, ops.rope(k, cos, sin), v, k_cache, v_cache, *metadata, SCALE),)


@pytest.mark.parametrize(
    "layer, reason",
    [
        (k_read_elsewhere, "k's rope feeds other nodes too"),
        (other_angles_for_k, "q and k are rotated by different angles or layouts"),
        (interleaved_k, "q and k are rotated by different angles or layouts"),
        (unrotated_q, "q is not a rope's output"),
        (views_that_do_not_cancel, "the views between q's rope and the attention do not cancel"),
    ],
)
def test_a_layer_that_cannot_fold_keeps_its_ropes_and_says_why(layer, reason):
    result, before, after, targets_after = fuse(layer)
    assert (result.matches, result.changed) == (0, False)
    assert result.details == [f"1 attention layers left unfused: {reason}"]
    assert "autodeploy.cached_attention.default" in targets_after
    for ours, theirs in zip(after, before):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0, equal_nan=True)


def test_any_chain_of_views_that_composes_to_the_identity_fuses():
    result, before, after, _ = fuse(views_that_compose_to_the_identity)
    assert result.matches == 1
    for ours, theirs in zip(after, before):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, equal_nan=True)


def test_a_kernel_preference_for_cached_attention_keeps_the_layers_unfused():
    result, *_ = fuse(two_ropes, backends={"cached_attention": ["sdpa"]})
    assert result.matches == 0 and "backends.cached_attention chooses the unfused op's kernels" in result.notes
    result, *_ = fuse(two_ropes, backends={"cached_attention": ["sdpa"], "cached_attention_rope": ["sdpa"]})
    assert result.matches == 1
