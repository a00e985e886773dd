"""The model runner's graphs by role and side inputs (``runtime/model_runner.py``), on a hand-built graph.

The graph embeds its tokens with an identity table, then scatters the rows of its side input
``embeds_override`` over the tokens ``embeds_override_token_index`` names, and its logits are the hidden
rows themselves: a greedy token is the argmax of the hidden row that produced it. So a request whose last
prompt position carries the one-hot row of token 7 generates 7 first, whatever its last token is.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autodeploy.config import load_settings
from autodeploy.custom_ops.serving_signature import KVCacheSpec, ServingSignature
from autodeploy.deployment import MODEL, Deployment
from autodeploy.errors import InvalidRequestError, UnsupportedModelError
from autodeploy.runtime.engine import Engine
from autodeploy.runtime.model_runner import ModelRunner
from autodeploy.runtime.request import TokenRows
from autodeploy.runtime.sampling_params import SamplingParams

VOCAB = 16
INPUTS = ("input_ids", "logit_index", "embeds_override", "embeds_override_token_index", "k_cache_0", "v_cache_0")
GREEDY = dict(temperature=0.0, ignore_eos=True)


class _EmbeddingOverride(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Parameter(torch.eye(VOCAB), requires_grad=False)

    def forward(self, input_ids, logit_index, embeds_override, embeds_override_token_index, k_cache_0, v_cache_0):
        hidden = self.embedding[input_ids]  # [1, T, H]
        hidden = hidden.index_put((torch.zeros_like(embeds_override_token_index), embeds_override_token_index),
                                  embeds_override)
        return hidden[:, logit_index] @ self.embedding.T  # [1, N, vocab]


def graph_with_side_input() -> fx.GraphModule:
    graph = fx.symbolic_trace(_EmbeddingOverride())
    # The shapes export records: the side input's rows [N, H], the logits [1, N, vocab].
    next(n for n in graph.graph.nodes if n.target == "embeds_override").meta["val"] = torch.empty(0, VOCAB)
    next(n for n in graph.graph.nodes if n.op == "output").args[0].meta["val"] = torch.empty(1, 0, VOCAB)
    return graph


def deployment(graphs: dict | None = None, **settings) -> Deployment:
    settings = load_settings(overrides={"device": "cpu", "dtype": "float32", "max_seq_len": 32, "max_batch_size": 4,
                                        "kv_cache": {"prefix_caching": False, "num_blocks": 16}, **settings})
    signature = ServingSignature(INPUTS, (KVCacheSpec.for_layer(0, 1, 1, 1, torch.float32),))
    return Deployment(graphs or {MODEL: graph_with_side_input()}, signature, settings)


def engine(**settings) -> Engine:
    return Engine(deployment(**settings))


def one_hot(token: int) -> torch.Tensor:
    return torch.eye(VOCAB)[token] * 10


def generate(engine: Engine, requests: list[tuple[list[int], dict | None]], max_tokens: int = 1) -> list[list[int]]:
    made = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY), side_inputs=s) for p, s in requests]
    while engine.has_unfinished():
        engine.step()
    return [r.output(None).outputs[0].token_ids for r in made]


def test_side_input_rows_reach_the_graph_at_their_positions_in_a_step_of_several_requests():
    # Without an override a prompt's last token is its own argmax; the carried rows override it.
    prompts = [
        ([1, 2, 3], {"embeds_override": TokenRows((2,), one_hot(7)[None])}),
        ([4, 5], None),
        ([6, 8, 9, 10], {"embeds_override": TokenRows((0, 3), torch.stack([one_hot(12), one_hot(11)]))}),
    ]
    assert generate(engine(), prompts) == [[7], [5], [11]]


def test_side_input_rows_follow_their_positions_across_prefill_chunks():
    chunked = engine(scheduler={"max_num_tokens": 4, "chunked_prefill": True})
    prompt = list(range(1, 11))  # 10 tokens: chunks of 4, 4 and 2
    rows = TokenRows((9, 1), torch.stack([one_hot(13), one_hot(0)]))
    assert generate(chunked, [(prompt, {"embeds_override": rows})], max_tokens=2) == [[13, 13]]
    # Decode steps carry no rows (positions past the prompt): the second token follows the first.


def test_a_side_input_the_graph_does_not_take_is_refused():
    with pytest.raises(InvalidRequestError, match="side input 'image_embeds', which this model's graph does not take"):
        engine().add_request([1, 2], SamplingParams(max_tokens=1), side_inputs={"image_embeds": TokenRows((0,), one_hot(1)[None])})


@pytest.mark.parametrize("rows, message", [
    (TokenRows((0,), torch.zeros(1, 3)), r"has rows \(1, 3\) torch.float32; the graph takes \(1, 16\)"),
    (TokenRows((5,), torch.zeros(1, VOCAB)), r"distinct prompt positions in \[0, 2\)"),
])
def test_side_input_rows_must_fit_the_graph_and_the_prompt(rows, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine().add_request([1, 2], SamplingParams(max_tokens=1), side_inputs={"embeds_override": rows})


def test_side_inputs_are_refused_beside_the_prefix_cache():
    cached = engine(kv_cache={"prefix_caching": True, "num_blocks": 16})
    with pytest.raises(InvalidRequestError, match="prefix_caching off"):
        cached.add_request([1, 2], SamplingParams(max_tokens=1), side_inputs={"embeds_override": TokenRows((0,), one_hot(1)[None])})


def test_a_graph_role_the_runner_does_not_run_is_refused():
    graph = graph_with_side_input()
    with pytest.raises(UnsupportedModelError, match=r"no \['draft'\] graph yet"):
        ModelRunner(deployment({MODEL: graph, "draft": graph}))
