"""SamplingParams.validate: every bad field is an InvalidRequestError that names the field, the value and the range."""

from __future__ import annotations

import doctest
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime import sampling_params
from autodeploy.runtime.sampling_params import SamplingParams

BEAM = {"beam_width": 4, "temperature": 0}

BAD = [
    pytest.param({"max_tokens": 0}, "max_tokens", "0", id="max_tokens=0"),
    pytest.param({"temperature": -0.5}, "temperature", "-0.5", id="temperature=-0.5"),
    pytest.param({"temperature": math.inf}, "temperature", "inf", id="temperature=inf"),
    pytest.param({"top_k": -1}, "top_k", "-1", id="top_k=-1"),
    pytest.param({"top_p": 0}, "top_p", "(0, 1]", id="top_p=0"),
    pytest.param({"top_p": 1.5}, "top_p", "1.5", id="top_p=1.5"),
    pytest.param({"min_p": 2}, "min_p", "[0, 1]", id="min_p=2"),
    pytest.param({"min_p": -0.1}, "min_p", "-0.1", id="min_p=-0.1"),
    pytest.param({"repetition_penalty": 0}, "repetition_penalty", "> 0", id="repetition_penalty=0"),
    pytest.param({"repetition_penalty": -1.2}, "repetition_penalty", "-1.2", id="repetition_penalty<0"),
    pytest.param({"presence_penalty": 3}, "presence_penalty", "[-2, 2]", id="presence_penalty=3"),
    pytest.param({"frequency_penalty": -2.5}, "frequency_penalty", "-2.5", id="frequency_penalty=-2.5"),
    pytest.param({"frequency_penalty": "high"}, "frequency_penalty", "'high'", id="frequency_penalty=str"),
    pytest.param({"n": 0}, "n must", "≥ 1", id="n=0"),
    pytest.param({"n": 2.0}, "n must", "2.0", id="n=2.0"),
    pytest.param({"logprobs": 21}, "logprobs", "[0, 20]", id="logprobs=21"),
    pytest.param({"logprobs": -1}, "logprobs", "-1", id="logprobs=-1"),
    pytest.param({"logprobs": True}, "logprobs", "True", id="logprobs=True"),
    pytest.param({"beam_width": 0}, "beam_width", "≥ 1", id="beam_width=0"),
    pytest.param({"length_penalty": math.nan}, "length_penalty", "nan", id="length_penalty=nan"),
    pytest.param({"early_stopping": "sometimes"}, "early_stopping", '"never"', id="early_stopping=str"),
    pytest.param({"early_stopping": 1}, "early_stopping", "1", id="early_stopping=1"),
    pytest.param({"seed": 1.5}, "seed", "1.5", id="seed=1.5"),
    pytest.param({"seed": "x"}, "seed", "'x'", id="seed=str"),
    pytest.param({"stop": 5}, "stop", "5", id="stop=5"),
    pytest.param({"stop": [1]}, "stop", "[1]", id="stop=[1]"),
    pytest.param({"stop": None}, "stop", "None", id="stop=None"),
    pytest.param({"stop_token_ids": [-1]}, "stop_token_ids", "[-1]", id="stop_token_ids=[-1]"),
    pytest.param({"ignore_eos": "yes"}, "ignore_eos", "'yes'", id="ignore_eos=str"),
    pytest.param({"beam_width": 2}, "temperature must be 0", "1.0", id="beam-with-default-temperature"),
    pytest.param({"beam_width": 2, "temperature": 0.7}, "temperature must be 0", "0.7", id="beam-with-temperature"),
    pytest.param({**BEAM, "top_k": 5}, "top_k", "5", id="beam-with-top_k"),
    pytest.param({**BEAM, "top_p": 0.9}, "top_p", "0.9", id="beam-with-top_p"),
    pytest.param({**BEAM, "min_p": 0.1}, "min_p", "0.1", id="beam-with-min_p"),
    pytest.param({**BEAM, "repetition_penalty": 1.2}, "repetition_penalty", "1.2", id="beam-with-repetition_penalty"),
    pytest.param({**BEAM, "presence_penalty": 0.5}, "presence_penalty", "0.5", id="beam-with-presence_penalty"),
    pytest.param({**BEAM, "frequency_penalty": 0.5}, "frequency_penalty", "0.5", id="beam-with-frequency_penalty"),
    pytest.param({**BEAM, "n": 5}, "n must be ≤ beam_width", "n=5", id="beam-n>beam_width"),
    pytest.param({"logit_bias": {5: 101}}, "logit_bias", "[-100, 100]", id="logit_bias>100"),
    pytest.param({"logit_bias": {-1: 1.0}}, "logit_bias", "{-1: 1.0}", id="logit_bias-negative-token"),
    pytest.param({"logit_bias": {"five": 1.0}}, "logit_bias keys must be token ids", "'five'", id="logit_bias-word-token"),
    pytest.param({"logit_bias": '{"5": 1'}, "logit_bias is not valid JSON", "line 1", id="logit_bias-bad-json"),
    pytest.param({"logit_bias": {5: math.nan}}, "logit_bias", "nan", id="logit_bias=nan"),
    pytest.param({"logit_bias": [5]}, "logit_bias", "[5]", id="logit_bias-list"),
    pytest.param({**BEAM, "logit_bias": {5: 1.0}}, "logit_bias", "{5: 1.0}", id="beam-with-logit_bias"),
]


@pytest.mark.parametrize("fields, named, shows", BAD)
def test_bad_field_is_an_invalid_request_naming_field_and_value(fields, named, shows):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**fields).validate()
    assert named in str(error.value)
    assert shows in str(error.value)


GOOD = [
    pytest.param({}, id="defaults"),
    pytest.param({"temperature": 0, "logprobs": 0}, id="greedy-logprobs-0"),
    pytest.param({"logprobs": 20, "n": 3, "seed": -7}, id="logprobs-20-n-3"),
    pytest.param({"min_p": 1, "top_p": 1, "top_k": 1}, id="filter-bounds"),
    pytest.param({"repetition_penalty": 0.5, "presence_penalty": -2, "frequency_penalty": 2}, id="penalty-bounds"),
    pytest.param({**BEAM, "n": 4, "length_penalty": -0.5, "early_stopping": "never", "logprobs": 2}, id="beam"),
    pytest.param({**BEAM, "early_stopping": True}, id="beam-early-stopping"),
    pytest.param({"logit_bias": {0: -100, 7: 100, 9: 0.5}}, id="logit_bias-bounds"),
]


def test_logit_bias_takes_string_token_ids_and_json_text():
    for given in ({"5": -100, 7: 2.5}, '{"5": -100, "7": 2.5}'):
        params = SamplingParams(logit_bias=given)
        params.validate()
        assert params.logit_bias == {5: -100, 7: 2.5}


@pytest.mark.parametrize("fields", GOOD)
def test_good_params_validate(fields):
    SamplingParams(**fields).validate()


def test_a_single_stop_string_becomes_a_list():
    params = SamplingParams(stop="\n\n")
    params.validate()
    assert params.stop == ["\n\n"]


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_min_p_is_valid_exactly_in_the_unit_interval(min_p):
    params = SamplingParams(min_p=min_p)
    if 0 <= min_p <= 1:
        params.validate()
    else:
        with pytest.raises(InvalidRequestError, match="min_p"):
            params.validate()


@given(st.sampled_from(["presence_penalty", "frequency_penalty"]), st.floats(allow_nan=True, allow_infinity=True))
def test_openai_penalties_are_valid_exactly_in_minus_two_to_two(name, value):
    params = SamplingParams(**{name: value})
    if -2 <= value <= 2:
        params.validate()
    else:
        with pytest.raises(InvalidRequestError, match=name):
            params.validate()


@given(st.integers(-5, 30))
def test_logprobs_is_valid_exactly_from_zero_to_twenty(logprobs):
    params = SamplingParams(logprobs=logprobs)
    if 0 <= logprobs <= 20:
        params.validate()
    else:
        with pytest.raises(InvalidRequestError, match="logprobs"):
            params.validate()


def test_docstring_example():
    result = doctest.testmod(sampling_params)
    assert result.attempted > 0 and result.failed == 0
