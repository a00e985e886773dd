"""Encoder–decoders (tiny BART, mBART, T5 v1.0 and v1.1) over two tensor-parallel ranks on the CPU: both graphs sliced by
heads, each rank's cross-KV pool holding its own heads and T5's relative position bias table their columns; greedy
output equal to Hugging Face's ``generate`` and to one process's deployment, with requests of different lengths in
one batch and arriving mid-decode; an abort during decode frees both caches on every rank. Ranks as ``torchrun
--nproc-per-node 2`` starts them (each rank's state observed), and spawned by ``autodeploy()`` (the worker replays
rank 0's steps, encoder passes included)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError
from tests.distributed.conftest import run_two_ranks
from tests.tiny_seq2seq_models import hf_generate_greedy, lively

KINDS = ["bart", "mbart", "t5", "t5_v1_1"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 60)), [7]]
MAX_TOKENS = (9, 4, 12, 6)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _used_blocks(engine) -> list[int]:
    """Blocks held in the self-attention pool and in the cross-KV pool."""
    return [engine.pool.num_used_blocks, engine.encoder.pool.num_used_blocks]


def _batch_and_arrivals(llm) -> tuple[list[list[int]], list[list[int]]]:
    """The greedy tokens of PROMPTS in one batch, and of PROMPTS arriving one a step (encoder passes beside decodes)."""
    batch = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS])]
    engine, requests = llm.engine, []
    for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
        requests.append(engine.add_request(prompt, _greedy(max_tokens)))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return batch, [list(r.output(None).outputs[0].token_ids) for r in requests]


def _position_biases(llm) -> dict[str, dict]:
    """Each graph's T5 relative position bias: its table as this rank holds it and how many heads the op gives (the
    encoder's ``relative_position_bias`` ``[1, H, Sq, Sk]``, the decoder's ``relative_position_bias_by_distance``
    ``[H, L]``)."""
    ops = torch.ops.autodeploy
    heads_dim = {ops.relative_position_bias.default: 1, ops.relative_position_bias_by_distance.default: 0}
    found = {}
    for role, graph in llm.deployment.graphs.items():
        for node in graph.graph.nodes:
            if node.op == "call_function" and node.target in heads_dim:
                found[role] = {"table": graph.get_parameter(node.args[0].target).tolist(),
                               "heads": int(node.meta["val"].shape[heads_dim[node.target]])}
    return found


def serve_each(rank: int, world: int, directories: list[str]) -> list[dict]:
    """One rank's results of each tiny encoder–decoder deployed over ``world`` ranks (a job of the spawn below)."""
    results = []
    for directory in directories:
        llm = autodeploy(directory, device="cpu", dtype="float32", distributed={"tensor_parallel": world, "timeout_s": 120})
        engine = llm.engine
        batch, arrivals = _batch_and_arrivals(llm)
        after_arrivals = _used_blocks(engine)
        request = engine.add_request(PROMPTS[2], _greedy(30))
        for _ in range(3):
            engine.step()
        decoding = _used_blocks(engine)
        engine.abort(request.request_id)
        results.append({"batch": batch, "arrivals": arrivals, "after_arrivals": after_arrivals, "decoding": decoding,
                        "aborted": _used_blocks(engine), "cross_heads": [s.kv_heads for s in engine.encoder.specs],
                        "cross_blocks": engine.encoder.pool.num_blocks, "report": llm.pipeline_report(),
                        "position_biases": _position_biases(llm)})
    return results


def refusal(rank: int, world: int, directory: str, rules: dict) -> str:
    """The ``ConfigError`` a deploy with ``distributed.rules`` gives (a job of the spawn below)."""
    try:
        autodeploy(directory, device="cpu", dtype="float32", distributed={"tensor_parallel": world, "timeout_s": 120, "rules": rules})
    except ConfigError as error:
        return str(error)
    return "built"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    written = {}
    for kind in KINDS:
        written[kind] = tmp_path_factory.mktemp(f"tiny-{kind}")
        lively(kind).save_pretrained(written[kind])
    return written


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> list[dict]:
    """Each rank's results, by job: "seq2seq" (``serve_each``'s, by kind in KINDS order), "cross_rule"."""
    jobs = {"seq2seq": (serve_each, ([str(checkpoints[kind]) for kind in KINDS],)),
            "cross_rule": (refusal, (str(checkpoints["bart"]), {"model.decoder.layers.*.encoder_attn.k_proj": "replicate"}))}
    return run_two_ranks(jobs, tmp_path_factory.mktemp("two-ranks-seq2seq"))


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_give_hf_greedy_output_and_one_process_output(checkpoints, two_ranks, kind):
    model = lively(kind)
    expected = [hf_generate_greedy(model, prompt, n) for prompt, n in zip(PROMPTS, MAX_TOKENS)]
    single = autodeploy(str(checkpoints[kind]), device="cpu", dtype="float32")
    assert _batch_and_arrivals(single) == (expected, expected)
    ranks = [results["seq2seq"][KINDS.index(kind)] for results in two_ranks]
    for rank, result in enumerate(ranks):
        assert result["batch"] == result["arrivals"] == expected
        assert result["after_arrivals"] == [0, 0]
        # Each rank's cross-KV pool holds its 2 of the 4 heads, in as many blocks as one process's.
        assert result["cross_heads"] == [2, 2] and result["cross_blocks"] == single.engine.encoder.pool.num_blocks
        assert [s.kv_heads for s in single.engine.encoder.specs] == [4, 4]
        decoder, encoder = (line for line in result["report"].splitlines() if line.startswith("shard_tensor_parallel"))
        assert (f"rank {rank} of 2: 4 attentions (4 output projections all-reduced), 2 MLPs, 1 embeddings and the LM head "
                f"vocabulary-parallel") in decoder and "2 layers' cross keys and values: this rank's heads" in decoder
        assert (f"rank {rank} of 2: 2 attentions (2 output projections all-reduced), 2 MLPs, 1 embeddings vocabulary-parallel"
                in encoder) and "2 layers' cross keys and values: this rank's heads" in encoder
        if kind.startswith("t5"):  # each stack's bias table (layer 0's) keeps the columns of this rank's 2 of the 4 heads
            tables = {role: stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
                      for role, stack in (("encoder", model.encoder), ("model", model.decoder))}
            assert result["position_biases"] == {role: {"table": table[:, 2 * rank:2 * rank + 2].tolist(), "heads": 2}
                                                 for role, table in tables.items()}
            assert all("the relative position bias: this rank's heads" in line for line in (decoder, encoder))
        else:
            assert result["position_biases"] == {}


@pytest.mark.parametrize("kind", KINDS)
def test_an_abort_during_decode_frees_both_caches_on_every_rank(two_ranks, kind):
    for results in two_ranks:
        result = results["seq2seq"][KINDS.index(kind)]
        assert all(used > 0 for used in result["decoding"]) and result["aborted"] == [0, 0]


def test_a_spawned_worker_replays_the_encoder_passes_and_frees_its_cross_blocks(checkpoints):
    """``autodeploy(..., tensor_parallel=2)`` in this process: the worker rebuilds each request (its encoder input with
    it) and runs its encoder pass in the same step as rank 0. Its cross-KV pool holds ``max_batch_size`` inputs of
    ``max_seq_len`` tokens: after an abort during decode, two inputs that long take every block of it, which a block
    the worker kept would refuse (its step fails, and rank 0's with it)."""
    model = lively("bart")
    directory = str(checkpoints["bart"])
    llm = autodeploy(directory, device="cpu", dtype="float32", tensor_parallel=2, max_batch_size=2,
                     distributed={"timeout_s": 120})
    try:
        engine = llm.engine
        outputs = llm.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS])
        assert [o.outputs[0].token_ids for o in outputs] == [hf_generate_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        request = engine.add_request(PROMPTS[2], _greedy(30))
        for _ in range(3):
            engine.step()
        assert engine.encoder.pool.num_used_blocks > 0
        engine.abort(request.request_id)  # sent to the worker with the next step
        longest = [list(range(10, 10 + llm.settings.max_seq_len)), list(range(80, 80 + llm.settings.max_seq_len))]
        outputs = llm.generate(longest, _greedy(3))
        assert [o.outputs[0].token_ids for o in outputs] == [hf_generate_greedy(model, p, 3) for p in longest]
        assert _used_blocks(engine) == [0, 0]
    finally:
        llm.shutdown()


def test_rules_naming_a_cross_attention_projection_are_refused(checkpoints, two_ranks, monkeypatch):
    """A replicated query over sliced keys would read as grouped-query attention: refused at build. The decoder
    graph's query projection is refused in its shard stage, before any collective (so here, in one process); the
    encoder graph's key projection on both ranks, after the decoder graph was built."""
    from autodeploy import api

    monkeypatch.setattr(api, "init_distributed", lambda settings, store=None: None)
    monkeypatch.setattr(api, "should_spawn", lambda settings: False)
    refused = r"distributed.rules name model.decoder.layers.0.encoder_attn.{}, an encoder-decoder's cross-attention projection"
    with pytest.raises(ConfigError, match=refused.format("q_proj")):
        autodeploy(str(checkpoints["bart"]), device="cpu", dtype="float32",
                   distributed={"tensor_parallel": 2, "rules": {"model.decoder.layers.*.encoder_attn.q_proj": "replicate"}})
    for results in two_ranks:
        assert re.search(refused.format("k_proj"), results["cross_rule"])

