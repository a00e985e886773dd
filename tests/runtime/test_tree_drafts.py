"""Tree drafts on the tiny random Llama: whatever tree a drafter proposes — the model's continuation hidden among
wrong siblings at any depth, random trees — the output is the output without speculation, token for token
(greedy, seeded sampling, penalties, logprobs, a pool small enough to preempt); the accepted nodes' KV entries
move to the positions they take; and the trees' rules are checked."""

from __future__ import annotations

import random

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from autodeploy.runtime.draft_trees import DraftTree, accepted_path, tree_depths, tree_masks
from autodeploy.runtime.speculative import register_drafter
from tests.runtime.test_engine import random_prompts
from tests.runtime.test_speculative import staggered_outputs

TREES = {"propose": lambda sequences, limits: [[] for _ in sequences]}


@register_drafter("test_trees")
def _trees(deployment, settings):
    return lambda sequences, limits: TREES["propose"](sequences, limits)


@pytest.fixture(scope="module")
def tree_llm(llama_dir):
    return autodeploy(str(llama_dir), device="cpu", verify={"enabled": False}, kv_cache={"num_blocks": 40},
                      speculative={"method": "test_trees", "num_tokens": 4, "tree_width": 3, "auto": False})


@pytest.fixture(autouse=True)
def _no_trees():
    yield
    TREES["propose"] = lambda sequences, limits: [[] for _ in sequences]


def hidden_path_trees(expected: dict[tuple, list[int]], seed: int, hit_rate: float = 0.8):
    """Trees down to the depth allowed: at each depth the known continuation (with probability ``hit_rate``) among
    1–3 children at a random place, and wrong subtrees beside it."""
    rng = random.Random(seed)

    def propose(sequences, limits):
        trees = []
        for sequence, limit in zip(sequences, limits):
            continuation = expected[tuple(sequence.request.prompt_token_ids)][len(sequence.output_token_ids):]
            tokens, parents, right, wrong = [], [], -1, None
            for depth in range(min(limit, len(continuation))):
                right_token = continuation[depth]
                children = [(right_token + 1 + i) % 512 for i in range(rng.randint(0, 2))]
                if rng.random() < hit_rate:
                    children.insert(rng.randint(0, len(children)), right_token)
                if wrong is not None:  # a wrong branch goes on too
                    tokens.append(rng.randrange(512))
                    parents.append(wrong)
                next_right, wrong = None, None
                for token in children:
                    tokens.append(token)
                    parents.append(right)
                    if token == right_token:
                        next_right = len(tokens) - 1
                    else:
                        wrong = len(tokens) - 1
                if next_right is None:
                    break
                right = next_right
            trees.append(DraftTree(tokens, parents))
        return trees

    return propose


def random_trees(seed: int):
    rng = random.Random(seed)

    def propose(sequences, limits):
        trees = []
        for limit in limits:
            tokens, parents = [], []
            for _ in range(rng.randint(0, 3 * limit)):
                parent = rng.randrange(-1, len(tokens))
                if (tree_depths(parents + [parent])[-1]) <= limit:
                    tokens.append(rng.randrange(512))
                    parents.append(parent)
            trees.append(DraftTree(tokens, parents))
        return trees

    return propose


@pytest.mark.parametrize("drafter", ["hidden path", "random"])
def test_output_is_the_output_without_speculation_under_preemption(tree_llm, llama_llm, drafter):
    prompts = random_prompts(18, seed=3, lengths=(1, 120))
    rng = random.Random(2)
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=True, logprobs=2) for _ in prompts]
    params[1] = SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True)
    params[2] = SamplingParams(max_tokens=30, temperature=0, frequency_penalty=1.5, ignore_eos=True)  # a chain only
    expected = [o.outputs[0] for o in llama_llm.generate(prompts, params)]
    continuation = {tuple(p): list(e.token_ids) for p, e in zip(prompts, expected)}
    TREES["propose"] = hidden_path_trees(continuation, seed=1) if drafter == "hidden path" else random_trees(5)
    engine = tree_llm.engine
    moves = []
    runner = engine.runner
    runner.move_kv = lambda sources, targets: (moves.append(len(sources)), type(runner).move_kv(runner, sources, targets))
    before = engine.speculator.stats.accepted
    try:
        outputs = staggered_outputs(engine, prompts, params, waves=3)
    finally:
        del runner.move_kv
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    for output, reference in zip(outputs, expected):
        assert (output.logprobs is None) == (reference.logprobs is None)
        if output.logprobs is not None:
            torch.testing.assert_close(output.logprobs, reference.logprobs, atol=1e-4, rtol=0)
            for got, want in zip(output.top_logprobs, reference.top_logprobs):
                assert got.keys() == want.keys()
    if drafter == "hidden path":  # the continuation sat among siblings: accepted, and moved into place
        assert engine.speculator.stats.accepted - before > 100 and sum(moves) > 20
    assert engine.pool.num_used_blocks == 0 or engine.pool.num_free_blocks > 0


def test_accepted_path_and_the_tree_layout():
    parents = [-1, -1, 0, 1, 1, 3]
    tokens = [10, 11, 12, 13, 14, 15]
    assert tree_depths(parents) == [1, 1, 2, 2, 2, 3]
    assert tree_masks(parents) == [1, 1 | 2, 1 | 4, 1 | 2 | 8, 1 | 4 | 16, 1 | 4 | 32, 1 | 4 | 16 | 64]
    # rows: the newest token's, then node i's at i + 1; the model samples 11, then 13, then 15, then 9
    assert accepted_path(tokens, parents, [11, 0, 13, 0, 15, 0, 9]) == [1, 3, 5]
    assert accepted_path(tokens, parents, [11, 0, 13, 0, 16, 0, 9]) == [1, 3]
    assert accepted_path(tokens, parents, [11, 0, 14, 0, 0, 15, 0]) == [1, 4]  # 15 is a child of node 3, not 4
    assert accepted_path(tokens, parents, [7, 0, 0, 0, 0, 0, 0]) == []
    assert DraftTree(tokens, parents).main_chain() == [10, 12]
    with pytest.raises(RuntimeError, match="not a tree in order"):
        DraftTree([1, 2], [1, -1]).check("mine")


def test_a_tree_that_breaks_the_rules_fails_its_requests(tree_llm):
    TREES["propose"] = lambda sequences, limits: [DraftTree([1, 2], [0, -1]) for _ in sequences]
    with pytest.raises(RuntimeError, match="not a tree in order"):
        tree_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))


def test_bad_tree_settings_are_refused_before_anything_is_built(llama_dir):
    for speculative, message in [
        ({"method": "test_trees", "tree_width": 0}, "tree_width must be ≥ 1"),
        ({"method": "test_trees", "num_tokens": 16, "tree_width": 4}, "num_tokens × tree_width ≤ 62"),
        ({"method": "ngram", "tree_width": 2}, "'ngram' drafts chains"),
    ]:
        with pytest.raises(ConfigError, match=message):
            autodeploy(str(llama_dir), device="cpu", speculative=speculative)


def test_only_tree_deployments_take_a_tree_mask(tree_llm, llama_llm):
    assert "tree_mask" in tree_llm.engine.graph_inputs
    assert "tree_mask" not in llama_llm.engine.graph_inputs
    nodes = [n for n in tree_llm.engine.graph.graph.nodes if "cached_attention" in str(n.target)]
    assert nodes and all(n.kwargs["tree_mask"].name == "tree_mask" for n in nodes)
    assert torch.is_tensor(tree_llm.engine.runner.caches["k_cache_0"])


def test_a_tree_graphs_per_token_inputs_are_as_long_as_its_tokens(tree_llm):
    """What the select stage hands a backend's ``supports``: ``tree_mask`` and ``slot_mapping`` one entry a token. (Their
    examples had a fixed 4 entries against 8 traced tokens, so Triton's attention refused every tree graph at build,
    and on a GPU tree verification ran through SDPA, eagerly, without its CUDA graphs.)"""
    from autodeploy.custom_ops.cached_attention_rope import CachedAttentionRopeArgs
    from autodeploy.transforms.select_kernels import _meta_args, _TokenShapes

    gm = tree_llm.graph
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "cached_attention_rope" in str(n.target)]
    assert nodes
    for node in nodes:
        call = CachedAttentionRopeArgs(*_meta_args(node, _TokenShapes(gm), gm))
        assert call.tree_mask.shape == call.slot_mapping.shape == (call.q.shape[1],)


@pytest.fixture(scope="module")
def gpu_tree_llm(llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return autodeploy(str(llama_dir), device="cuda", dtype="float32", kv_cache={"num_blocks": 64},
                      speculative={"method": "test_trees", "num_tokens": 4, "tree_width": 3, "auto": False})


def test_on_the_gpu_tree_verification_through_captured_graphs_changes_no_token(gpu_tree_llm, gpu_llama_llm):
    runner = gpu_tree_llm.engine.runner
    assert runner.verify_graphs is not None and runner.verify_graphs.width == 4 * 3 + 1
    prompts = random_prompts(12, seed=8, lengths=(1, 90))
    for params in (SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)):
        expected = [o.outputs[0] for o in gpu_llama_llm.generate(prompts, params)]
        TREES["propose"] = hidden_path_trees({tuple(p): list(e.token_ids) for p, e in zip(prompts, expected)}, seed=2)
        before = gpu_tree_llm.engine.speculator.stats.accepted
        assert [o.outputs[0].token_ids for o in gpu_tree_llm.generate(prompts, params)] == [e.token_ids for e in expected]
        assert gpu_tree_llm.engine.speculator.stats.accepted - before > 50
    assert gpu_tree_llm.engine.pool.num_used_blocks == 0


def test_a_tree_deployment_saves_and_a_graph_without_tree_masks_refuses_trees(tree_llm, llama_llm, tmp_path):
    reloaded = autodeploy(str(tree_llm.save(tmp_path / "tree")),
                          speculative={"method": "test_trees", "num_tokens": 4, "tree_width": 3, "auto": False})
    prompts = random_prompts(4, seed=9, lengths=(5, 40))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.outputs[0] for o in llama_llm.generate(prompts, params)]
    TREES["propose"] = hidden_path_trees({tuple(p): list(e.token_ids) for p, e in zip(prompts, expected)}, seed=3)
    assert [o.outputs[0].token_ids for o in reloaded.generate(prompts, params)] == [e.token_ids for e in expected]
    with pytest.raises(ConfigError, match="built without tree drafts"):
        autodeploy(str(llama_llm.save(tmp_path / "plain")), speculative={"method": "test_trees", "tree_width": 2})
