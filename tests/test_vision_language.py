"""Vision-language models end to end on the CPU: tiny random LLaVA checkpoints (CLIP and SigLIP towers) deployed by
``autodeploy()`` generate, under greedy decoding, exactly what Hugging Face's ``generate`` does with the same images.

Also: several images a prompt, image and text-only prompts in one batch, the encoder cache (a hit gives what a miss
gives; two images never share an entry), the prefix cache keyed by the image, build-time verification of the vision
graph, and the typed errors of bad requests.
"""

from __future__ import annotations

import io

import pytest
import torch
from transformers import LlavaConfig

from autodeploy import SamplingParams, autodeploy
from autodeploy.deployment import VISION
from autodeploy.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from tests.tiny_vision_models import IMAGE_TOKEN, IMAGE_TOKEN_ID, random_image, write_tiny_llava

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TOKENS_PER_IMAGE = 16  # 32 × 32 pixels in 8 × 8 patches


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"llava-{request.param}")
    hf = write_tiny_llava(directory, request.param)
    llm = autodeploy(str(directory), device="cpu", dtype="float32", max_seq_len=256, max_batch_size=4)
    yield llm, hf
    llm.shutdown()


def hf_greedy(llm, hf, token_ids: list[int], images: list, max_tokens: int = GREEDY.max_tokens) -> list[int]:
    """Hugging Face's greedy continuation of ``token_ids`` (each placeholder expanded) with ``images``."""
    expanded = [t for token in token_ids for t in ([token] * TOKENS_PER_IMAGE if token == IMAGE_TOKEN_ID else [token])]
    pixels = llm.engine.vision.image_processor(images=images, return_tensors="pt")["pixel_values"] if images else None
    device = next(hf.parameters()).device
    ids = torch.tensor([expanded], device=device)
    pixels = pixels.to(device) if pixels is not None else None
    out = hf.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=max_tokens, do_sample=False,
                      attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


def test_the_build_verifies_the_vision_graph_and_reports_it(llava):
    llm, _ = llava
    assert set(llm.deployment.graphs) == {"model", VISION}
    verification = llm.deployment.report.verification
    assert verification.vision_relative_error is not None and verification.vision_relative_error <= 1e-4
    assert "image features" in str(verification)


def test_greedy_output_with_one_and_two_images_and_text_only_in_one_batch_matches_hugging_face(llava):
    llm, hf = llava
    tokenizer = llm.tokenizer
    one, two = random_image(1), random_image(2, (20, 64))
    prompts = [
        {"prompt": f"{IMAGE_TOKEN}\ndef fibonacci(n):", "images": [one]},
        {"prompt": f"print({IMAGE_TOKEN}, {IMAGE_TOKEN})", "images": [one, two]},
        {"prompt": f"{IMAGE_TOKEN}{IMAGE_TOKEN}\nfor i in range(10):", "images": [two, one]},
        "import os\nimport sys",
    ]
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        text, images = (prompt["prompt"], prompt["images"]) if isinstance(prompt, dict) else (prompt, [])
        assert output.outputs[0].token_ids == hf_greedy(llm, hf, tokenizer(text).input_ids, images), text
    assert len(outputs[1].prompt_token_ids) == len(tokenizer(prompts[1]["prompt"]).input_ids) + 2 * (TOKENS_PER_IMAGE - 1)


def test_prompts_already_expanded_by_a_processor_are_kept(llava):
    llm, hf = llava
    image = random_image(3)
    ids = [1, 5] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + [7, 8]
    [output] = llm.generate({"prompt": ids, "images": [image]}, GREEDY)  # one prompt, not in a list
    assert output.prompt_token_ids == ids
    assert output.outputs[0].token_ids == hf_greedy(llm, hf, [1, 5, IMAGE_TOKEN_ID, 7, 8], [image])


def test_an_image_seen_again_comes_from_the_encoder_cache_with_the_same_output(llava):
    llm, _ = llava
    cache = llm.engine.vision.cache
    image = random_image(4)
    encoded, hits = llm.engine.vision.images_encoded, cache.hits
    first = llm.generate([{"prompt": f"{IMAGE_TOKEN} x", "images": [image]}], GREEDY)[0]
    # The same pixels as PNG bytes: decoded, they hash alike.
    png = io.BytesIO()
    image.save(png, format="PNG")
    second = llm.generate([{"prompt": f"{IMAGE_TOKEN} x", "images": [png.getvalue()]}], GREEDY)[0]
    assert llm.engine.vision.images_encoded == encoded + 1 and cache.hits == hits + 1
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_two_images_never_share_an_encoder_cache_entry_nor_a_cached_prefix(llava):
    """Same tokens, images one pixel apart: each output is Hugging Face's for its own image (the KV prefix cache
    keys blocks by the image too)."""
    llm, hf = llava
    assert llm.deployment.settings.kv_cache.prefix_caching
    first = random_image(5)
    pixels = first.load()
    second = first.copy()
    second.putpixel((0, 0), tuple(255 - c for c in pixels[0, 0]))
    prompt = f"{IMAGE_TOKEN}\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
    entries = len(llm.engine.vision.cache)
    stats = llm.engine.pool.stats
    outputs, hits = [], []
    for image in (first, second, first):
        before = stats.hit_tokens
        outputs.append(llm.generate([{"prompt": prompt, "images": [image]}], GREEDY)[0])
        hits.append(stats.hit_tokens - before)
    assert len(llm.engine.vision.cache) == entries + 2
    # The other image's prompt reuses no block its placeholders touch; the same image's again reuses them.
    assert hits[1] < TOKENS_PER_IMAGE and hits[2] >= TOKENS_PER_IMAGE
    ids = llm.tokenizer(prompt).input_ids
    for output, image in zip(outputs, (first, second, first)):
        assert output.outputs[0].token_ids == hf_greedy(llm, hf, ids, [image])


@pytest.mark.parametrize("prompt, images, message", [
    ({"prompt": "no placeholder", "images": ["IMAGE"]}, None, r"0 image placeholder\(s\) .* for 1 image"),
    ({"prompt": f"{IMAGE_TOKEN}{IMAGE_TOKEN}", "images": ["IMAGE"]}, None, r"2 image placeholder\(s\) .* for 1 image"),
    ({"prompt": f"{IMAGE_TOKEN} and {IMAGE_TOKEN}", "images": ["IMAGE"]}, None, r"2 image placeholder\(s\)"),
    (f"{IMAGE_TOKEN} text only", None, r"1 image placeholder\(s\) .* for 0 image"),
    ({"prompt": "x", "images": "IMAGE"}, None, "images must be a list"),
    ({"prompt": "x", "pictures": []}, None, "takes the keys 'prompt' and 'images'"),
    ({"prompt": f"{IMAGE_TOKEN}", "images": [b"not an image"]}, None, "image 0"),
    ({"prompt": IMAGE_TOKEN * 9, "images": ["IMAGE"] * 9}, None, "at most 8 a request"),
])
def test_bad_image_requests_are_refused_with_a_typed_error_before_anything_is_queued(llava, prompt, images, message):
    llm, _ = llava
    image = random_image(6)
    if isinstance(prompt, dict) and isinstance(prompt.get("images"), list):
        prompt = {**prompt, "images": [image if source == "IMAGE" else source for source in prompt["images"]]}
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request(prompt, GREEDY)
    assert not llm.engine.has_unfinished()


def test_images_that_overflow_the_context_are_refused_naming_them(llava):
    llm, _ = llava
    with pytest.raises(InvalidRequestError, match=r"8 image\(s\) of 16 tokens each make it 128 tokens"):
        llm.engine.add_request({"prompt": IMAGE_TOKEN * 8, "images": [random_image(8)] * 8}, SamplingParams(max_tokens=200))


def test_a_text_only_model_refuses_images(tiny_checkpoint):
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", dtype="float32", max_seq_len=64, verify={"enabled": False})
    with pytest.raises(InvalidRequestError, match="takes no images"):
        llm.engine.add_request({"prompt": "x", "images": [random_image(7)]}, GREEDY)


@pytest.mark.parametrize("change, message", [
    (lambda config: setattr(config, "model_type", "llava_next"), "does not serve yet"),
    (lambda config: setattr(config.vision_config, "model_type", "pixtral"), "pixtral vision tower"),
])
def test_vision_language_models_it_does_not_serve_are_refused_by_name(tmp_path, change, message):
    from autodeploy.models.vision_language import vision_language_spec

    config = LlavaConfig()
    change(config)
    with pytest.raises(UnsupportedModelError, match=message):
        vision_language_spec(config)


def test_a_saved_vision_language_deployment_reloads_with_its_vision_graph_and_serves_the_same_tokens(llava, tmp_path):
    llm, hf = llava
    saved = llm.save(tmp_path / "saved")
    reloaded = autodeploy(str(saved), device="cpu")
    assert set(reloaded.deployment.graphs) == {"model", VISION} and reloaded.image_token == IMAGE_TOKEN
    images = [random_image(30), random_image(31)]
    prompt = {"prompt": f"{IMAGE_TOKEN} and {IMAGE_TOKEN}:", "images": images}
    [output] = reloaded.generate([prompt], GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(llm, hf, llm.tokenizer(prompt["prompt"]).input_ids, images)
    reloaded.shutdown()


def test_a_saved_vision_graph_that_was_altered_is_refused(llava, tmp_path):
    from autodeploy.errors import CheckpointError

    llm, _ = llava
    saved = llm.save(tmp_path / "saved")
    weights = saved / "vision.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="vision.safetensors"):
        autodeploy(str(saved), device="cpu")


def test_vision_language_models_over_several_ranks_are_refused(tmp_path):
    write_tiny_llava(tmp_path, "clip")
    with pytest.raises(ConfigError, match="run on one rank"):
        autodeploy(str(tmp_path), device="cpu", tensor_parallel=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_gpu_captured_vision_graphs_encode_what_the_eager_graph_does(tmp_path, dtype):
    hf = write_tiny_llava(tmp_path, "clip")
    llm = autodeploy(str(tmp_path), device="cuda", dtype=dtype, max_seq_len=256, max_batch_size=4, vision={"max_images_per_batch": 4})
    vision = llm.engine.vision
    assert sorted(vision._captured) == [1, 2, 4]
    images = [random_image(seed) for seed in range(3)]
    pixels = torch.stack([vision.image_processor(images=[image], return_tensors="pt")["pixel_values"][0] for image in images])
    eager = vision.graph(pixels.to("cuda", getattr(torch, dtype)))
    assert torch.equal(vision._forward(pixels), eager[0] if isinstance(eager, (tuple, list)) else eager)
    if dtype == "float32":
        ids = llm.tokenizer(f"{IMAGE_TOKEN} x").input_ids
        [output] = llm.generate([{"prompt": ids, "images": images[:1]}], GREEDY)
        assert output.outputs[0].token_ids == hf_greedy(llm, hf.to("cuda"), ids, images[:1])
    llm.shutdown()


def test_an_image_split_over_prefill_chunks_preemption_and_several_samples_give_hugging_faces_tokens(tmp_path):
    """Chunked prefill cutting through an image's placeholders (8-token chunks for 16-row images), sequences
    preempted and recomputed (a pool too small for all), and n = 2 greedy samples: each completion is HF's."""
    hf = write_tiny_llava(tmp_path, "clip")
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=64, max_batch_size=4,
                     scheduler={"max_num_tokens": 8, "chunked_prefill": True}, kv_cache={"num_blocks": 10, "block_size": 8})
    images = [random_image(20 + index) for index in range(4)]
    prompts = [{"prompt": f"x{IMAGE_TOKEN}def f{index}():", "images": [image]} for index, image in enumerate(images)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(llm, hf, llm.tokenizer(prompt["prompt"]).input_ids, prompt["images"], max_tokens=12)
        assert [c.token_ids for c in output.outputs] == [expected, expected]
    llm.shutdown()


def test_the_cli_takes_images_for_its_prompts(llava, tmp_path, capsys):
    from autodeploy.cli.main import main
    from tests.tiny_vision_models import png

    llm, hf = llava
    image = random_image(50)
    (tmp_path / "image.png").write_bytes(png(image))
    prompt = f"{IMAGE_TOKEN}\ndef f():"
    assert main(["run", llm.model_directory, "--prompt", prompt, "--image", str(tmp_path / "image.png"), "--max-tokens", "8",
                 "--set", "device=cpu", "--set", "dtype=float32", "--set", "max_seq_len=256"]) == 0
    expected = llm.tokenizer.decode(hf_greedy(llm, hf, llm.tokenizer(prompt).input_ids, [image]))
    assert expected in capsys.readouterr().out


def test_a_vision_graph_that_fails_fails_its_steps_requests_and_leaves_nothing_waiting(llava, monkeypatch):
    llm, _ = llava
    vision = llm.engine.vision

    def broken(pixels):
        raise RuntimeError("the vision graph broke")

    monkeypatch.setattr(vision, "graph", broken)
    monkeypatch.setattr(vision, "_captured", {})
    engine = llm.engine
    requests = [engine.add_request({"prompt": f"{IMAGE_TOKEN} x", "images": [random_image(60)]}, GREEDY),
                engine.add_request("import os", GREEDY)]
    with pytest.raises(RuntimeError, match="vision graph broke"):
        engine.step()
    assert not engine.has_unfinished() and engine.pool.num_used_blocks == 0  # a server's clients get the error, not a hang
    assert all(request.finished for request in requests)
    monkeypatch.undo()
    assert len(llm.generate(["import os"], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.timeout(60)
def test_async_llm_prepares_images_off_its_event_loop(llava, monkeypatch):
    """A prompt with images is made on a worker thread: a slow image (a URL fetch, say) does not stop the loop."""
    import asyncio
    import threading
    import time

    from autodeploy.frontend.async_llm import AsyncLLM

    llm, _ = llava
    vision = llm.engine.vision
    prepare, threads = vision.prepare, []

    def slow_prepare(sources):
        threads.append(threading.current_thread())
        time.sleep(0.5)
        return prepare(sources)

    monkeypatch.setattr(vision, "prepare", slow_prepare)
    engine = AsyncLLM(llm)

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        output = await engine.generate({"prompt": f"{IMAGE_TOKEN} x", "images": [random_image(70)]}, GREEDY)
        task.cancel()
        return output, ticks

    try:
        output, ticks = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
    assert threads and threads[0] is not threading.main_thread() and ticks >= 10


def test_decode_steps_replay_the_padded_static_graphs_with_image_prompts(llava, monkeypatch):
    """The decode graphs (static, padded buffers: what a GPU captures) hold the image side input with no rows; a step
    that computes an image placeholder (a prompt's last position, say) runs outside them. Outputs stay HF's."""
    import dataclasses

    from autodeploy.runtime.engine import Engine
    from autodeploy.runtime.model_runner import CapturedRunner

    llm, hf = llava
    deployment = llm.deployment
    signature = dataclasses.replace(deployment.signature, decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=())
    engine = Engine(dataclasses.replace(deployment, signature=signature))
    assert isinstance(engine.runner, CapturedRunner) and engine.runner.decode_graphs is not None
    replays = []
    replay = engine.runner.decode_graphs.replay
    monkeypatch.setattr(engine.runner.decode_graphs, "replay", lambda *args: replays.append(args) or replay(*args))
    images = [random_image(80), random_image(81), random_image(82)]
    prompts = [f"{IMAGE_TOKEN} x", f"def f():{IMAGE_TOKEN}", f"{IMAGE_TOKEN}"]  # the last two end on an image
    requests = [engine.add_request({"prompt": prompt, "images": [image]}, GREEDY) for prompt, image in zip(prompts, images)]
    while engine.has_unfinished():
        engine.step()
    assert replays
    for prompt, image, request in zip(prompts, images, requests):
        assert request.output(llm.tokenizer).outputs[0].token_ids == hf_greedy(llm, hf, llm.tokenizer(prompt).input_ids, [image])


def test_a_step_computing_an_image_row_is_told_apart_from_a_plain_decode():
    from types import SimpleNamespace

    from autodeploy.runtime.request import TokenRows
    from autodeploy.runtime.step_inputs import SideInputSpec, carries_side_rows

    spec = SideInputSpec("image_features", (4,), torch.float32)
    request = SimpleNamespace(side_inputs={"image_features": TokenRows((5, 6, 7), torch.zeros(3, 4))}, prompt_token_ids=[0] * 10)
    chunk = lambda start, length: SimpleNamespace(sequence=SimpleNamespace(request=request), start=start, length=length)  # noqa: E731
    assert carries_side_rows([chunk(7, 1)], [spec]) and carries_side_rows([chunk(0, 6)], [spec])
    assert not carries_side_rows([chunk(8, 1)], [spec]) and not carries_side_rows([chunk(0, 5)], [spec])
    assert not carries_side_rows([SimpleNamespace(sequence=SimpleNamespace(request=None), start=5, length=1)], [spec])


def test_a_placeholder_outside_the_vocabulary_is_embedded_as_hugging_face_does_and_verified(tmp_path):
    """A reduced twin keeps the checkpoint's image token (LLaVA-1.5's 32000) with a 512-token vocabulary: the model
    graph embeds it as token 0 (its row overwrites it), and the build's image probe gives Hugging Face the embeddings
    with the rows in place rather than ids its embedding cannot index."""
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration

    from tests.tiny_vision_models import IMAGE_SIZE, tiny_llava_config

    config = tiny_llava_config("clip")
    config.image_token_index = 600  # the tiny vocabulary has 512
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(tmp_path)
    crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=crop).save_pretrained(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=64)
    assert llm.deployment.report.verification.relative_error <= 1e-4
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 512\): \[600\]"):  # served: typed
        llm.generate({"prompt": [1, 600, 5], "images": [random_image(50)]}, GREEDY)
    llm.shutdown()
