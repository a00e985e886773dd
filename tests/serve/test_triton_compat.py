"""Clients of the TensorRT-LLM and vLLM Triton backends against the repository's models: genai-perf's
``tensorrtllm`` and ``vllm`` payloads (built as its converters build them, genai-perf itself not being
installable here), the TensorRT-LLM backend's input names with their batch dimension, what is refused by
name, and a repository written with ``--decoupled false`` served to Triton's plain infer (HTTP and gRPC).
Greedy outputs must equal in-process ``LLM.generate``. The streamed (decoupled) side of the payloads is in
test_triton_server.py, against that module's server, which also holds the payload builders."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from autodeploy import SamplingParams
from autodeploy.errors import InvalidRequestError
from autodeploy.serve.triton import compatible_inputs
from autodeploy.serve.triton.client import grpc_inputs
from tests.serve.test_triton_server import Server, fixed_length, perf_analyzer_tensors, serve_repository, tensorrtllm_payload, vllm_payload

# ---- without a server: how the other backends' inputs read --------------------------------------------------


def test_vllm_sampling_parameters_convert_strings_and_refuse_what_is_not_implemented():
    fields = compatible_inputs.vllm_fields('{"max_tokens": "8", "temperature": "0.5", "ignore_eos": "true", "top_k": -1, "stop": "x", '
                                           '"skip_special_tokens": true, "best_of": 2, "n": 2}')
    assert {field: value for field, (value, _) in fields.items()} == {
        "max_tokens": 8, "temperature": 0.5, "top_k": 0, "n": 2, "ignore_eos": True, "stop": ["x"]}
    for text, message in (('{"use_beam_search": true}', "fields ['use_beam_search'] are not supported"),
                          ('{"include_stop_str_in_output": true}', "include_stop_str_in_output must be false"),
                          ('{"max_tokens": "8.5"}', "max_tokens must be a int"), ('{"best_of": 3}', "best_of other than n"),
                          ("[1]", "must be a JSON object"), ("{not json", "not valid JSON")):
        with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
            compatible_inputs.vllm_fields(text)


def test_tensorrt_llm_inputs_map_or_are_refused_by_name():
    fields = compatible_inputs.tensorrt_llm_fields({"random_seed": 3, "num_return_sequences": 2, "stop_words": ["", "\n\n"], "bad_words": [""],
                                                    "exclude_input_in_output": True, "pad_id": 0, "return_context_logits": False,
                                                    "guided_decoding_guide_type": "json"})
    assert {field: value for field, (value, _) in fields.items()} == {"seed": 3, "n": 2, "stop": ["\n\n"], "json_object": True}
    for values, message in (({"bad_words": ["foo"]}, "bad_words is not supported"),
                            ({"exclude_input_in_output": False}, "exclude_input_in_output false"),
                            ({"return_generation_logits": True}, "return_generation_logits is not supported"),
                            ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a+"}, "'regex' is not supported"),
                            ({"guided_decoding_guide_type": "json_schema"}, "needs guided_decoding_guide")):
        with pytest.raises(InvalidRequestError, match=message):
            compatible_inputs.tensorrt_llm_fields(values)
    with pytest.raises(InvalidRequestError, match="seed is given twice, as seed and as random_seed"):
        compatible_inputs.merge({"seed": (1, "seed")}, compatible_inputs.tensorrt_llm_fields({"random_seed": 2}))


def test_min_length_covering_the_output_bans_eos_and_end_id_must_be_eos():
    resolve = compatible_inputs.resolve
    assert resolve({"min_length": (1, "min_length")}, {2}, 16) == {}
    assert resolve({"min_length": (8, "min_length"), "max_tokens": (8, "max_tokens"), "logit_bias": ('{"5": 3}', "logit_bias")}, {2}, 16) == {
        "max_tokens": 8, "logit_bias": {"5": 3, "2": compatible_inputs.EOS_BAN}}
    assert resolve({"min_length": (16, "sampling_parameters.min_tokens")}, {2, 3}, 16)["logit_bias"] == {"2": -100.0, "3": -100.0}
    with pytest.raises(InvalidRequestError, match="sampling_parameters.min_tokens 4 below max_tokens 16 is not supported"):
        resolve({"min_length": (4, "sampling_parameters.min_tokens")}, {2}, 16)
    assert resolve({"end_id": (2, "end_id")}, {2}, 16) == {}
    with pytest.raises(InvalidRequestError, match="end_id 7 is not supported"):
        resolve({"end_id": (7, "end_id")}, {2}, 16)


# ---- against a --decoupled false repository ----------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory, llama_dir):
    """A server on a repository written with --decoupled false: one response a request."""
    with serve_repository(tmp_path_factory.mktemp("triton-plain"), llama_dir, "--decoupled", "false") as server:
        yield server


def generate(server: Server, model: str, body: dict) -> dict:
    return httpx.post(f"{server.http}/v2/models/{model}/generate", json=body, timeout=120).json()


def test_the_repository_is_not_decoupled_and_takes_a_batch_dimension(plain):
    for model in ("llm", "ensemble"):
        config = (plain.repository / model / "config.pbtxt").read_text()
        assert "decoupled" not in config and "max_batch_size: 1" in config


def test_genai_perf_payloads_through_plain_http_and_grpc_infer(plain, llama_llm):
    """Each payload to the llm model and the ensemble with Triton's plain infer: one response, the text of
    in-process greedy generate with EOS banned (min_length / min_tokens = max_tokens), max_tokens long."""
    prompt = "def fibonacci(n):"
    expected = fixed_length(llama_llm, prompt, 12)
    payloads = {"tensorrtllm": tensorrtllm_payload(prompt, 12, stream=False, temperature=0.0),
                "vllm": vllm_payload(prompt, 12, stream=False, sampling={"temperature": "0"})}
    with httpclient.InferenceServerClient(plain.http.removeprefix("http://")) as http, grpcclient.InferenceServerClient(plain.grpc) as grpc:
        for model in ("llm", "ensemble"):
            metadata = http.get_model_metadata(model)
            for kind, payload in payloads.items():
                tensors = perf_analyzer_tensors(payload, metadata)
                inputs = []
                for name, array in tensors.items():
                    tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
                    tensor.set_data_from_numpy(array)
                    inputs.append(tensor)
                result = http.infer(model, inputs)
                assert result.as_numpy("text_output").tolist() == [[expected.text.encode()]], (model, kind)
                assert result.as_numpy("output_ids").tolist() == [expected.token_ids] and len(expected.token_ids) == 12
                over_grpc = grpc.infer(model, grpc_inputs(tensors))
                assert over_grpc.as_numpy("text_output").item().decode() == expected.text, (model, kind)


def test_tensorrt_llm_requests_as_its_docs_send_them(plain, llama_llm):
    """The TensorRT-LLM backend's curl example (empty bad_words and stop_words), its other harmless inputs,
    and stop_words acting as stop strings; through the ensemble, as there."""
    expected = llama_llm.generate("import os", SamplingParams(max_tokens=10, temperature=0.0, seed=1))[0]
    eos = min(llama_llm.engine.eos_token_ids)
    body = {"text_input": "import os", "max_tokens": 10, "bad_words": "", "stop_words": "", "pad_id": eos, "end_id": eos,
            "random_seed": 1, "temperature": 0.0, "exclude_input_in_output": True, "return_log_probs": False}
    response = generate(plain, "ensemble", body)
    assert (response["text_output"], response["finish_reason"]) == (expected.text, expected.finish_reason)
    stop = expected.text[4:7]
    stopped = llama_llm.generate("import os", SamplingParams(max_tokens=10, temperature=0.0, stop=[stop]))[0]
    response = generate(plain, "ensemble", {**body, "stop_words": [stop]})
    assert (response["text_output"], response["finish_reason"]) == (stopped.text, "stop")


def test_what_would_change_the_output_is_refused_by_name(plain):
    base = {"text_input": "import os", "max_tokens": 8}
    for extra, message in (({"bad_words": ["os"]}, "bad_words is not supported"),
                           ({"exclude_input_in_output": False}, "exclude_input_in_output false"),
                           ({"end_id": 12345}, "end_id 12345 is not supported"),
                           ({"min_length": 3}, "min_length 3 below max_tokens 8 is not supported"),
                           ({"return_context_logits": True}, "return_context_logits is not supported"),
                           ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a+"}, "'regex' is not supported"),
                           ({"sampling_parameters": '{"use_beam_search": true}'}, "['use_beam_search'] are not supported"),
                           ({"sampling_parameters": '{"max_tokens": 4}'}, "max_tokens is given twice"),
                           ({"stream": True}, "stream true needs a decoupled model"),
                           ({"n": 2}, "n 2 sends a response a completion"),
                           ({"lora_task_id": 1, "temprature": 0}, "lora_task_id, temprature: not an input of this model")):
        for model in ("llm", "ensemble"):
            assert message in generate(plain, model, {**base, **extra}).get("error", ""), (model, extra)
    assert generate(plain, "llm", base)["finish_reason"]  # and it still serves
