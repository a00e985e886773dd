"""Bad requests are InvalidRequestErrors and leave the model serving; export failures are ExportErrors that help."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from autodeploy import SamplingParams, register_export_patch
from autodeploy.errors import ConfigError, ExportError, InvalidRequestError
from autodeploy.export import export_to_graph_module

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def reference_tokens(llama_llm) -> list[int]:
    return llama_llm.generate([PROMPT], GREEDY)[0].token_ids


def assert_still_serving(llm, reference_tokens) -> None:
    (output,) = llm.generate([PROMPT], GREEDY)
    assert output.token_ids == reference_tokens


BAD_PARAMS = [
    pytest.param(SamplingParams(max_tokens=0), "max_tokens", id="max_tokens=0"),
    pytest.param(SamplingParams(max_tokens=-1), "max_tokens", id="max_tokens=-1"),
    pytest.param(SamplingParams(max_tokens=2.0), "max_tokens", id="max_tokens=2.0"),
    pytest.param(SamplingParams(temperature=-0.5), "temperature", id="temperature=-0.5"),
    pytest.param(SamplingParams(temperature="hot"), "temperature", id="temperature=str"),
    pytest.param(SamplingParams(top_p=0), "top_p", id="top_p=0"),
    pytest.param(SamplingParams(top_p=1.5), "top_p", id="top_p=1.5"),
    pytest.param(SamplingParams(top_k=-1), "top_k", id="top_k=-1"),
    pytest.param(SamplingParams(top_k=2.5), "top_k", id="top_k=2.5"),
    pytest.param(SamplingParams(stop=[3]), "stop", id="stop=[int]"),
    pytest.param(SamplingParams(stop=[""]), "stop", id="stop=[empty]"),
    pytest.param(SamplingParams(stop_token_ids=[-1]), "stop_token_ids", id="stop_token_ids=[-1]"),
    pytest.param(SamplingParams(seed="x", temperature=1.0), "seed", id="seed=str"),
    pytest.param(SamplingParams(stop=3), "stop", id="stop=int"),
    pytest.param(SamplingParams(stop_token_ids=3), "stop_token_ids", id="stop_token_ids=int"),
    pytest.param(SamplingParams(top_k=True, max_tokens=2), "top_k", id="top_k=True"),
    pytest.param(SamplingParams(temperature=float("nan"), max_tokens=2), "temperature", id="temperature=nan"),
]


@pytest.mark.parametrize("params, named", BAD_PARAMS)
def test_bad_sampling_params(llama_llm, reference_tokens, params, named):
    with pytest.raises(InvalidRequestError, match=named):
        llama_llm.generate([PROMPT], params)
    assert_still_serving(llama_llm, reference_tokens)


BAD_PROMPTS = [
    pytest.param([], "at least one prompt", id="no-prompts"),
    pytest.param((), "at least one prompt", id="empty-tuple"),
    pytest.param([""], "empty", id="empty-string"),
    pytest.param([[]], "empty", id="empty-token-list"),
    pytest.param([[1.0, 2.0]], "string or a list of token ids", id="float-ids"),
    pytest.param([["a", "b"]], "string or a list of token ids", id="str-ids"),
    pytest.param([[True, False]], "string or a list of token ids", id="bool-ids"),
    pytest.param([torch.tensor([1, 2])], "string or a list of token ids", id="tensor"),
    pytest.param([[1, 512]], r"outside the vocabulary \[0, 512\)", id="id=vocab_size"),
    pytest.param([[1, -1]], "outside the vocabulary", id="id=-1"),
    pytest.param([PROMPT, [5, 6], 7], "prompt 2", id="int-among-prompts"),
]


@pytest.mark.parametrize("prompts, named", BAD_PROMPTS)
def test_bad_prompts(llama_llm, reference_tokens, prompts, named):
    with pytest.raises(InvalidRequestError, match=named):
        llama_llm.generate(prompts, GREEDY)
    assert_still_serving(llama_llm, reference_tokens)


def test_prompt_plus_max_tokens_beyond_max_seq_len(llama_llm, reference_tokens):
    limit = llama_llm.settings.max_seq_len
    prompt = [7] * (limit - 2)
    with pytest.raises(InvalidRequestError, match=f"{limit + 1} > max_seq_len={limit}"):
        llama_llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0))
    assert_still_serving(llama_llm, reference_tokens)
    (at_limit,) = llama_llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(at_limit.token_ids) == 2


@pytest.mark.parametrize("params", [[GREEDY] * 3, [GREEDY], []], ids=["3-for-2", "1-list-for-2", "empty-list"])
def test_params_list_length_must_match_prompts(llama_llm, reference_tokens, params):
    with pytest.raises(InvalidRequestError, match="SamplingParams for"):
        llama_llm.generate([PROMPT, [5, 6]], params)
    assert_still_serving(llama_llm, reference_tokens)


def test_params_of_the_wrong_type(llama_llm, reference_tokens):
    with pytest.raises(InvalidRequestError, match="must be SamplingParams"):
        llama_llm.generate([PROMPT], {"max_tokens": 3})
    assert_still_serving(llama_llm, reference_tokens)


def test_one_bad_request_in_a_batch_rejects_the_call_before_any_work(llama_llm, reference_tokens):
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llama_llm.generate([PROMPT, [1, 10_000]], GREEDY)
    assert_still_serving(llama_llm, reference_tokens)


# --- export failures --------------------------------------------------------------------------

class DataDependentGate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a Python branch on a tensor value: torch.export cannot trace it
            return x * 2
        return x


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = DataDependentGate()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(self.gate(x))


@register_export_patch("test_branch_free_gate")
@contextlib.contextmanager
def branch_free_gate(model: nn.Module):
    """The same gate as one traceable ``torch.where``, only while export runs."""
    gates = [m for m in model.modules() if isinstance(m, DataDependentGate)]
    for gate in gates:
        gate.forward = lambda x: torch.where(x.sum() > 0, x * 2, x)
    try:
        yield
    finally:
        for gate in gates:
            del gate.forward


def test_export_failure_names_the_submodule_and_suggests_a_patch():
    model = GatedNet().eval()
    with pytest.raises(ExportError) as error:
        export_to_graph_module(model, (torch.ones(2, 4),))
    message = str(error.value)
    assert "gate (DataDependentGate)" in message
    assert "if x.sum() > 0" in message  # the model line that broke export
    assert "register_export_patch" in message and "transforms.export_to_fx.patches" in message
    assert not model.gate._forward_pre_hooks and not model.gate._forward_hooks  # tracking hooks removed


def test_registered_export_patch_makes_export_pass():
    model = GatedNet().eval()
    gm = export_to_graph_module(model, (torch.ones(2, 4),), patches=["test_branch_free_gate"])
    assert "forward" not in vars(model.gate)  # the patch is undone after export
    with torch.no_grad():
        for x in (torch.ones(2, 4), -torch.ones(2, 4)):  # both branches of the original code
            torch.testing.assert_close(gm(x), model(x))


def test_unknown_export_patch_is_a_config_error():
    with pytest.raises(ConfigError, match="no_such_patch") as error:
        export_to_graph_module(GatedNet().eval(), (torch.ones(2, 4),), patches=["no_such_patch"])
    assert "test_branch_free_gate" in str(error.value)  # lists the registered ones
