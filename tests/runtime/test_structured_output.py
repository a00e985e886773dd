"""Grammar-constrained decoding (SamplingParams.json_schema / json_object) on the tiny random Llama: its
output is arbitrary, but always JSON of the asked-for shape, and it never changes what shares its batch."""

from __future__ import annotations

import doctest
import json

import jsonschema
import pytest
import torch

from autodeploy import SamplingParams
from autodeploy.errors import InvalidRequestError
from autodeploy.runtime import structured_output
from autodeploy.runtime.sampler import SamplingRow, sample

# An enum and a bounded integer, no other properties: the JSON ends within a few dozen tokens.
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "size"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("overlap", [False, True])
def test_json_schema_output_validates_and_shares_a_batch_with_unconstrained_greedy(llama_llm, monkeypatch, overlap):
    monkeypatch.setattr(llama_llm.engine, "overlap", overlap)
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = llama_llm.generate(["import os"], free)[0]
    constrained, unconstrained = llama_llm.generate(
        ["def f(x):", "import os"], [SamplingParams(max_tokens=60, temperature=0, json_schema=SCHEMA), free]
    )
    jsonschema.validate(json.loads(constrained.text), SCHEMA)
    assert constrained.finish_reason == "stop" and constrained.token_ids[-1] in llama_llm.engine.eos_token_ids
    assert unconstrained.token_ids == alone.token_ids


def test_sampled_samples_each_follow_their_own_grammar(llama_llm):
    (output,) = llama_llm.generate(["def f(x):"], SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=3, json_schema=json.dumps(SCHEMA)))
    assert len(output.outputs) == 3
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert completion.finish_reason == "stop"


def test_json_object_output_is_an_object(llama_llm):
    (output,) = llama_llm.generate(["def f(x):"], SamplingParams(max_tokens=60, temperature=1.0, seed=2, json_object=True))
    assert output.finish_reason == "stop" and isinstance(json.loads(output.text), dict)


def test_constrained_requests_do_not_run_ahead(llama_llm, monkeypatch):
    engine = llama_llm.engine
    monkeypatch.setattr(engine, "overlap", True)
    engine.add_request("def f(x):", SamplingParams(max_tokens=8, temperature=0))
    ran_ahead = False
    while engine.has_unfinished():
        engine.step()
        ran_ahead |= engine._in_flight is not None
    assert ran_ahead  # an unconstrained request does
    request = engine.add_request("def f(x):", SamplingParams(max_tokens=60, temperature=0, json_schema=SCHEMA))
    while engine.has_unfinished():
        engine.step()
        assert engine._in_flight is None
    (completion,) = request.output(llama_llm.tokenizer).outputs
    jsonschema.validate(json.loads(completion.text), SCHEMA)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(json_schema={"type": "nonsense"}), 'Unsupported type "nonsense"'),
    (SamplingParams(json_schema={"type": "object", "properties": 5}), "properties must be an object"),
    (SamplingParams(json_schema="{not json"), "json_schema is not valid JSON"),
    (SamplingParams(json_schema=[1, 2]), "json_schema must be a dict"),
    (SamplingParams(json_schema=SCHEMA, json_object=True), "set one of json_schema, json_object and structural_tag"),
    (SamplingParams(json_object=True, structural_tag={"type": "structural_tag", "format": {"type": "any_text"}}), "set one of"),
    (SamplingParams(structural_tag="{not json"), "structural_tag is not valid JSON"),
    (SamplingParams(structural_tag=7), "structural_tag must be a dict"),
    (SamplingParams(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "structural_tag cannot be enforced"),
    (SamplingParams(json_object=True, beam_width=2, temperature=0), "beam search"),
    (SamplingParams(json_object="yes"), "json_object must be True or False"),
])
def test_invalid_structured_output_is_refused_at_make_request(llama_llm, params, message):
    engine = llama_llm.engine
    with pytest.raises(InvalidRequestError, match=message):
        engine.make_request("def f(x):", params)
    assert not engine.has_unfinished()


def test_the_mask_leaves_only_allowed_tokens_and_unconstrained_rows_alone():
    bitmask = torch.zeros(2, dtype=torch.int32)
    bitmask[1] = -(2**31)  # only token 63 allowed: the top (sign) bit of the second word
    logits = torch.arange(64, dtype=torch.float32).flip(0).repeat(2, 1)  # token 0 is everyone's argmax
    rows = [SamplingRow(SamplingParams(temperature=0), 0, 0, [0], [], token_bitmask=bitmask),
            SamplingRow(SamplingParams(temperature=0), 0, 0, [0], [])]
    assert sample(logits, rows).token_ids == [63, 0]
    rows[0].params = SamplingParams(temperature=1.0, top_p=0.5, logprobs=1)
    result = sample(logits, rows)
    assert result.token_ids[0] == 63 and result.top_logprobs[0].keys() == {0}  # logprobs stay the raw model's


def test_docstrings():
    assert doctest.testmod(structured_output).failed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_constrained_rows_mask_on_the_device_beside_run_ahead_free_requests(gpu_llama_llm):
    # Triton kernels, decode CUDA graphs, the overlapped runtime: free requests run ahead until a constrained one joins.
    llm = gpu_llama_llm
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.token_ids for o in llm.generate(["import os", "def g(y):"], free)]
    outputs = llm.generate(["def f(x):", "import os", "def g(y):"],
                           [SamplingParams(max_tokens=60, temperature=0.7, seed=3, json_schema=SCHEMA), free, free])
    jsonschema.validate(json.loads(outputs[0].text), SCHEMA)
    assert outputs[0].finish_reason == "stop"
    assert [o.token_ids for o in outputs[1:]] == alone
    assert llm.engine.pool.num_used_blocks == 0
