"""Images through the Triton ensemble: ``autodeploy triton-repo`` of a tiny LLaVA writes a preprocessing step that
turns ``image_input`` (an encoded image's bytes, or a data: URL) into the model's pixel values beside the token ids;
greedy answers equal in-process ``LLM.generate`` with the same image, and bad images are the request's error alone."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from autodeploy import SamplingParams, autodeploy
from tests.serve.test_triton_server import serve_repository
from tests.tiny_vision_models import IMAGE_TOKEN, png, random_image, write_tiny_llava

PROMPT = f"{IMAGE_TOKEN}\ndef fibonacci(n):"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("llava")
    write_tiny_llava(checkpoint, "clip")
    llm = autodeploy(str(checkpoint), device="cpu", dtype="float32", max_seq_len=256)
    with serve_repository(tmp_path_factory.mktemp("triton-llava"), checkpoint, "--set", "dtype=float32", "--set", "max_seq_len=256",
                          "--decoupled", "false") as server:
        yield llm, server
    llm.shutdown()


def expected(llm, image, max_tokens: int = 8) -> str:
    return llm.generate([{"prompt": PROMPT, "images": [image]}], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].outputs[0].text


@pytest.mark.timeout(300)
def test_the_ensemble_takes_image_bytes_and_data_urls(llava):
    llm, server = llava
    image = random_image(40)
    with httpclient.InferenceServerClient(server.http.removeprefix("http://")) as client:
        text = httpclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=np.object_))
        images = httpclient.InferInput("image_input", [1, 1], "BYTES")
        images.set_data_from_numpy(np.array([[png(image)]], dtype=np.object_))
        tokens = httpclient.InferInput("max_tokens", [1, 1], "INT32")
        tokens.set_data_from_numpy(np.array([[8]], dtype=np.int32))
        temperature = httpclient.InferInput("temperature", [1, 1], "FP32")
        temperature.set_data_from_numpy(np.array([[0.0]], dtype=np.float32))
        result = client.infer("ensemble", [text, images, tokens, temperature])
        assert result.as_numpy("text_output").reshape(-1)[0].decode() == expected(llm, image)
        other = random_image(41)
        data_url = f"data:image/png;base64,{base64.b64encode(png(other)).decode()}"
        body = {"text_input": PROMPT, "image_input": [data_url], "max_tokens": 8, "temperature": 0.0}
        answer = httpx.post(f"{server.http}/v2/models/ensemble/generate", json=body, timeout=120).json()
        assert answer["text_output"] == expected(llm, other)
        images.set_data_from_numpy(np.array([[b"not an image"]], dtype=np.object_))
        with pytest.raises(InferenceServerException, match="image 0"):
            client.infer("ensemble", [text, images, tokens, temperature])
        plain = httpx.post(f"{server.http}/v2/models/ensemble/generate", json={"text_input": "import os", "max_tokens": 4,
                                                                               "temperature": 0.0}, timeout=120).json()
        assert plain["text_output"] == llm.generate("import os", SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].text
