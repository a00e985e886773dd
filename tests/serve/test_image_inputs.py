"""Images through the chat front ends: ``LLM.chat`` with image parts, and the OpenAI server's ``image_url`` parts (and
the Responses API's ``input_image``) —
data URLs, ``http`` URLs fetched from a server on loopback, and local files only inside ``vision.allowed_local_dir`` —
each answering exactly what Hugging Face generates for the same image."""

from __future__ import annotations

import base64
import contextlib
import http.server
import threading

import httpx
import openai
import pytest

from autodeploy import SamplingParams, autodeploy
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.server import serving_in_thread
from tests.test_vision_language import hf_greedy
from tests.tiny_vision_models import IMAGE_TOKEN, png, random_image, write_tiny_llava

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
MODEL = "tiny-llava"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llava")
    hf = write_tiny_llava(directory, "clip")
    allowed = tmp_path_factory.mktemp("images")
    llm = autodeploy(str(directory), device="cpu", dtype="float32", max_seq_len=256, max_batch_size=4,
                     vision={"allowed_local_dir": str(allowed)})
    yield llm, hf, allowed
    llm.shutdown()


@contextlib.contextmanager
def image_host(files: dict[str, bytes]):
    """A loopback HTTP server answering ``/name`` with ``files[name]`` (404 for the rest); yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            body = files.get(self.path.lstrip("/"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def expected(llm, hf, question: str, image) -> str:
    text = f"<|user|>{IMAGE_TOKEN}{question}\n<|assistant|>"
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    return llm.tokenizer.decode(hf_greedy(llm, hf, ids, [image]))


def test_llm_chat_takes_image_parts_where_they_stand(llava):
    llm, hf, _ = llava
    image = random_image(11)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]
    reply = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), chat_template=TEMPLATE)
    assert reply.content == expected(llm, hf, "What is it?", image)


@pytest.mark.timeout(120)
def test_the_server_takes_data_urls_loopback_urls_and_allowed_local_files(llava):
    llm, hf, allowed = llava
    images = [random_image(12), random_image(13), random_image(14)]
    (allowed / "local.png").write_bytes(png(images[2]))
    with image_host({"remote.png": png(images[1])}) as host, \
            serving_in_thread(build_app(llm, ServerOptions(served_model_name=MODEL, chat_template=TEMPLATE))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        urls = [f"data:image/png;base64,{base64.b64encode(png(images[0])).decode()}", f"{host}/remote.png",
                str(allowed / "local.png")]
        for url, image in zip(urls, images):
            reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0.0, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]}])
            assert reply.choices[0].message.content == expected(llm, hf, "Describe.", image), url
        response = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0.0, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": urls[0]}, {"type": "input_text", "text": "Describe."}]}])
        assert response.output_text == expected(llm, hf, "Describe.", images[0])
        refusals = [(f"{host}/missing.png", "404"), (str(allowed.parent / "outside.png"), "outside"),
                    ("data:text/plain;base64,aGk=", "image 0"), ("data:image/png;base64,!!!", "image 0")]
        for url, message in refusals:
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}])
        metrics = httpx.get(f"{base}/metrics").text
        vision = llm.engine.vision
        assert vision.images_encoded >= 3 and vision.cache.misses >= 3
        assert f"autodeploy_images_encoded_total {vision.images_encoded:.1f}" in metrics
        assert f"autodeploy_encoder_cache_misses_total {vision.cache.misses:.1f}" in metrics
    assert not llm.engine.has_unfinished()


@pytest.mark.timeout(120)
def test_without_an_allowed_directory_the_server_reads_no_local_image(tmp_path):
    write_tiny_llava(tmp_path / "model", "clip")
    llm = autodeploy(str(tmp_path / "model"), device="cpu", dtype="float32", max_seq_len=128, verify={"enabled": False})
    (tmp_path / "secret.png").write_bytes(png(random_image(15)))
    try:
        with serving_in_thread(build_app(llm, ServerOptions(served_model_name=MODEL, chat_template=TEMPLATE))) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
            for url in (str(tmp_path / "secret.png"), f"file://{tmp_path / 'secret.png'}"):
                with pytest.raises(openai.BadRequestError, match="reads no local files"):
                    client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}])
    finally:
        llm.shutdown()


@pytest.mark.timeout(120)
def test_the_server_serves_gemma3_images_with_its_expansion_and_mask(tmp_path):
    """Gemma 3 through the OpenAI client: the chat template writes ``<start_of_image>`` where the image part stands,
    admission expands it as Gemma 3's processor does, and the reply is HF's with the processor's ``token_type_ids``."""
    import torch

    from tests.test_vision_language_gemma3 import START, hf_run, processor_ids
    from tests.tiny_vision_models import write_tiny_gemma3

    hf = write_tiny_gemma3(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=128, max_batch_size=2)
    image = random_image(15)
    with serving_in_thread(build_app(llm, ServerOptions(served_model_name=MODEL, chat_template=TEMPLATE))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        url = f"data:image/png;base64,{base64.b64encode(png(image)).decode()}"
        reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0.0, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}}]}])
    ids = processor_ids(llm, f"<|user|>Describe{START}\n<|assistant|>")
    ids = ids[1:] if ids[0] == llm.tokenizer.bos_token_id else ids  # the template's text, tokenized without a BOS
    with torch.no_grad():
        tokens, _ = hf_run(llm, hf, ids, [image])
    assert reply.choices[0].message.content == llm.tokenizer.decode(tokens)
    llm.shutdown()
