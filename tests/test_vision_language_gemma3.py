"""Gemma 3, the vision-language family whose images differ from LLaVA's, end to end on the CPU.

A tiny random Gemma 3 (SigLIP tower, pooling projector, sliding and global layers) deployed by ``autodeploy()``
generates, under greedy decoding, exactly what Hugging Face's ``generate`` does with the same images and the
``token_type_ids`` its processor makes: an image's placeholders attend to one another both ways in the prompt
(``cached_attention``'s ``attend_until``), which changes the logits (checked: they differ from a causal mask's).
Also: the processor's expansion of ``<start_of_image>`` (text and token ids), prefill chunks that never cut an
image, the prefix cache, chat, saved deployments, and the typed refusals.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.custom_ops.serving_signature import ATTEND_UNTIL
from autodeploy.deployment import ImageBoundaries
from autodeploy.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from tests.tiny_vision_models import (GEMMA3_END, GEMMA3_IMAGE, GEMMA3_START, GEMMA3_TOKENS, random_image,
                                      write_tiny_gemma3)

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
START = GEMMA3_TOKENS[0]
ROWS = 16  # an image's feature rows: 8 × 8 patches pooled 2 × 2


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    hf = write_tiny_gemma3(directory)
    llm = autodeploy(str(directory), device="cpu", dtype="float32", max_seq_len=160, max_batch_size=4)
    yield llm, hf, directory
    llm.shutdown()


def processor_ids(llm, text: str) -> list[int]:
    """The token ids Gemma 3's processor makes of ``text`` (each ``<start_of_image>`` written out)."""
    expanded = text.replace(START, f"\n\n{START}{GEMMA3_TOKENS[2] * ROWS}{GEMMA3_TOKENS[1]}\n\n")
    return llm.tokenizer(expanded).input_ids


def hf_run(llm, hf, ids: list[int], images: list, max_tokens: int = GREEDY.max_tokens, bidirectional: bool = True):
    """Hugging Face's greedy tokens and first-step log-probabilities for ``ids`` with ``images`` (its processor's
    ``token_type_ids``, or none: a causal mask throughout)."""
    pixels = llm.engine.vision.image_processor(images=images, return_tensors="pt")["pixel_values"] if images else None
    input_ids = torch.tensor([ids])
    types = (input_ids == GEMMA3_IMAGE).long() if bidirectional else None
    out = hf.generate(input_ids=input_ids, pixel_values=pixels, token_type_ids=types, max_new_tokens=max_tokens,
                      do_sample=False, attention_mask=torch.ones_like(input_ids), output_scores=True,
                      return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.log_softmax(out.scores[0][0].float(), -1)


def test_the_deployment_knows_its_image_boundaries_and_attends_both_ways_within_images(gemma3):
    llm, _, _ = gemma3
    assert llm.deployment.image_boundaries == ImageBoundaries(GEMMA3_START, GEMMA3_END, "\n\n")
    assert ATTEND_UNTIL in llm.deployment.signature.inputs and llm.engine.vision.bidirectional
    assert llm.image_token == START
    assert llm.deployment.report.verification.vision_relative_error <= 1e-4


def test_greedy_output_with_one_and_two_images_and_text_only_in_one_batch_matches_hugging_face(gemma3):
    llm, hf, _ = gemma3
    one, two = random_image(1), random_image(2, (20, 64))
    prompts = [
        {"prompt": f"{START}def fibonacci(n):", "images": [one]},
        {"prompt": f"print({START}, {START})", "images": [one, two]},
        "import os\nimport sys",
        {"prompt": f"x = 1{START}", "images": [two]},  # ends on the image's separator
    ]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2))
    for prompt, output in zip(prompts, outputs):
        text, images = (prompt["prompt"], prompt["images"]) if isinstance(prompt, dict) else (prompt, [])
        ids = processor_ids(llm, text)
        assert output.prompt_token_ids == ids
        tokens, logprobs = hf_run(llm, hf, ids, images)
        assert output.outputs[0].token_ids == tokens, text
        first = output.outputs[0].token_ids[0]
        assert output.outputs[0].logprobs[0] == pytest.approx(logprobs[first].item(), abs=1e-4)
        if images:  # the mask matters: a causal one gives other log-probabilities
            _, causal = hf_run(llm, hf, ids, images, max_tokens=1, bidirectional=False)
            assert abs(causal[first].item() - logprobs[first].item()) > 1e-4


def test_token_prompts_with_start_tokens_are_expanded_as_the_processor_expands_them(gemma3):
    llm, hf, _ = gemma3
    image = random_image(3)
    separator = llm.tokenizer.encode("\n\n", add_special_tokens=False)
    [output] = llm.generate({"prompt": [1, 50, GEMMA3_START, 60], "images": [image]}, GREEDY)
    expected_ids = [1, 50, *separator, GEMMA3_START, *[GEMMA3_IMAGE] * ROWS, GEMMA3_END, *separator, 60]
    assert output.prompt_token_ids == expected_ids
    assert output.outputs[0].token_ids == hf_run(llm, hf, expected_ids, [image])[0]
    [kept] = llm.generate({"prompt": expected_ids, "images": [image]}, GREEDY)  # already expanded: kept
    assert kept.prompt_token_ids == expected_ids and kept.outputs[0].token_ids == output.outputs[0].token_ids


def test_adjacent_images_form_one_block_as_hugging_face_groups_them(gemma3):
    """Two images' placeholders with nothing between them (a processor-expanded prompt, edited): Hugging Face groups
    maximal runs of image tokens, so both images' rows see each other; so does the deployment."""
    llm, hf, _ = gemma3
    images = [random_image(4), random_image(5)]
    ids = [1, 50, GEMMA3_START, *[GEMMA3_IMAGE] * (2 * ROWS), GEMMA3_END, 60]
    assert llm.engine.vision.whole_spans(ids) == ((3, 3 + 2 * ROWS),)
    [output] = llm.generate({"prompt": ids, "images": images}, GREEDY)
    assert output.outputs[0].token_ids == hf_run(llm, hf, ids, images)[0]


def test_prefill_chunks_never_cut_an_image_and_the_prefix_cache_reuses_it(tmp_path):
    """A 12-token step budget for 16-row images: chunks end before an image and take it whole in the next step (a
    chunk cutting it would leave its first rows blind to the rest). A prompt sharing the image reuses its blocks."""
    hf = write_tiny_gemma3(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=96, max_batch_size=2,
                     scheduler={"max_num_tokens": 24, "chunked_prefill": True}, kv_cache={"block_size": 4})
    cuts = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        plan = schedule()
        for chunk in plan.chunks:
            for first, end in chunk.sequence.request.whole_spans:
                cuts.append(first < chunk.start + chunk.length < end)
        return plan

    llm.engine.scheduler.schedule = recording
    image = random_image(6)
    prompt = {"prompt": f"import numpy as np\nx = {START} and y", "images": [image]}
    stats = llm.engine.pool.stats
    outputs = [llm.generate([prompt], GREEDY)[0] for _ in range(2)]
    assert cuts and not any(cuts)
    assert stats.hit_tokens >= ROWS  # the second prompt's image came from the cache
    expected = hf_run(llm, hf, processor_ids(llm, prompt["prompt"]), [image])[0]
    assert [o.outputs[0].token_ids for o in outputs] == [expected, expected]
    # Two adjacent images make one 32-token block, which no 24-token step can compute: refused before queueing.
    ids = [1, GEMMA3_START, *[GEMMA3_IMAGE] * (2 * ROWS), GEMMA3_END]
    with pytest.raises(InvalidRequestError, match="a run of 32 tokens that attend to one another"):
        llm.generate({"prompt": ids, "images": [image, image]}, GREEDY)
    llm.shutdown()


def test_a_step_budget_smaller_than_an_image_is_refused_at_build(tmp_path):
    write_tiny_gemma3(tmp_path)
    with pytest.raises(ConfigError, match="max_num_tokens is 12; raise it to at least 16"):
        autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=96, scheduler={"max_num_tokens": 12})


def test_chat_puts_the_start_token_where_each_image_goes(gemma3):
    llm, hf, _ = gemma3
    image = random_image(7)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image", "image": image}]}]
    reply = llm.chat(messages, GREEDY, chat_template=TEMPLATE)
    [output] = reply.outputs
    text = f"<|user|>what is{START}\n<|assistant|>"
    assert output.prompt_token_ids == processor_ids(llm, text)[: len(output.prompt_token_ids)]
    assert output.prompt_token_ids.count(GEMMA3_IMAGE) == ROWS
    assert output.outputs[0].token_ids == hf_run(llm, hf, output.prompt_token_ids, [image])[0]


def test_a_saved_gemma3_deployment_reloads_with_its_boundaries_and_serves_the_same_tokens(gemma3, tmp_path):
    llm, hf, _ = gemma3
    saved = llm.save(tmp_path / "saved")
    reloaded = autodeploy(str(saved), device="cpu")
    assert reloaded.deployment.image_boundaries == llm.deployment.image_boundaries and reloaded.image_token == START
    image = random_image(8)
    prompt = {"prompt": f"a {START} b", "images": [image]}
    [output] = reloaded.generate([prompt], GREEDY)
    assert output.outputs[0].token_ids == hf_run(llm, hf, processor_ids(llm, prompt["prompt"]), [image])[0]
    reloaded.shutdown()


def test_pan_and_scan_crops_are_refused_by_name(tmp_path):
    import json

    write_tiny_gemma3(tmp_path)
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_pan_and_scan": True}))
    with pytest.raises(UnsupportedModelError, match="pan-and-scan"):
        autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=96)


def test_the_build_verifies_the_image_mask_and_names_the_layer_that_breaks_it(tmp_path, monkeypatch):
    """The twin's verification serves a prompt with an image (its rows, its mask) beside the text probes: a deploy
    whose image tokens attended causally would differ from Hugging Face's, and is refused naming the attention."""
    import autodeploy.runtime.step_inputs as step_inputs

    write_tiny_gemma3(tmp_path)
    monkeypatch.setattr(step_inputs, "chunk_attend_until", lambda chunk: [-1] * chunk.length)
    with pytest.raises(UnsupportedModelError, match=r"first diverging module: model\.language_model\.layers\.0\.self_attn"):
        autodeploy(str(tmp_path), device="cpu", dtype="float32", max_seq_len=96)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_triton_attention_serves_the_image_mask(tmp_path):
    """On a GPU the paged attention is Triton's, which reads ``attend_until`` in its prefill kernel: the same tokens as
    Hugging Face on the GPU, with images cut from prefill chunks and decodes in the same steps."""
    hf = write_tiny_gemma3(tmp_path).to("cuda")
    llm = autodeploy(str(tmp_path), device="cuda", dtype="float32", max_seq_len=160, max_batch_size=4,
                     scheduler={"max_num_tokens": 40})
    kernels = {str(node.target) for node in llm.deployment.graph.graph.nodes if node.op == "call_function"}
    assert any("cached_attention" in name and "triton" in name for name in kernels), sorted(kernels)
    images = [random_image(40 + index) for index in range(3)]
    prompts = [{"prompt": f"def f{index}():{START} return {START}", "images": [image, images[0]]}
               for index, image in enumerate(images)]
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        ids = processor_ids(llm, prompt["prompt"])
        pixels = llm.engine.vision.image_processor(images=prompt["images"], return_tensors="pt")["pixel_values"].cuda()
        input_ids = torch.tensor([ids], device="cuda")
        expected = hf.generate(input_ids=input_ids, pixel_values=pixels, token_type_ids=(input_ids == GEMMA3_IMAGE).long(),
                               max_new_tokens=GREEDY.max_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
        assert output.outputs[0].token_ids == expected[0, len(ids):].tolist()
    llm.shutdown()
