"""Checkpoint → pipeline → runtime equals Hugging Face eager, for every supported tiny architecture."""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from tests.tiny_models import ARCHITECTURES, write_tiny_checkpoint

SHAPES = [(1, 1), (1, 13), (3, 7), (4, 1), (2, 33)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def deployed(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_checkpoint(request.param, directory, max_shard_size="200KB")
    return request.param, hf_model, autodeploy(str(directory))


def test_logits_equal_hf_eager_for_many_shapes_from_one_export(deployed):
    arch, hf_model, llm = deployed
    token_inputs = [n.meta["val"].shape for n in llm.graph.graph.nodes if n.name in ("input_ids", "position_ids")]
    assert all(not isinstance(dim, int) for shape in token_inputs for dim in shape), "the token count must be symbolic"
    generator = torch.Generator().manual_seed(0)
    for batch, seq in SHAPES:
        input_ids = torch.randint(3, 500, (batch, seq), generator=generator)
        with torch.no_grad():
            expected = hf_model(input_ids=input_ids).logits
        got = torch.stack(llm.logits(input_ids.tolist()))
        assert (got - expected).abs().max().item() <= 1e-5, f"{arch} {batch}x{seq}"


def test_greedy_generate_equals_hf_generate_token_for_token(deployed):
    arch, hf_model, llm = deployed
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (5, 1, 12)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert output.token_ids == reference[0, len(prompt):].tolist(), arch


def test_text_prompts_use_the_checkpoint_tokenizer(deployed):
    arch, hf_model, llm = deployed
    output = llm.generate("def f(x):", SamplingParams(max_tokens=4, temperature=0))[0]
    assert output.prompt_token_ids == llm.tokenizer("def f(x):").input_ids
    assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)
