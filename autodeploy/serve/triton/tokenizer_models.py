"""The ensemble's tokenizer steps as Triton Python-backend models: text → token ids before the engine,
token ids → text after it. Both load the tokenizer saved with the deployment (``parameters { key:
"tokenizer" … }``, a folder relative to the model repository's root) and are stateless, so Triton may run
them for many requests at once.

Detokenizing a stream without per-request state: each engine response carries every token generated so
far and how many of them are new, and a response's text is ``visible(all)`` minus ``visible(all but the
new)``, where ``visible`` is the engine's own rule for a stream (a trailing partial UTF-8 character or the
start of a stop string waits for the next token; a stop string cuts the text). The pieces add up to the
text the engine returns, as it decodes the whole completion the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.request import streamable_prefix, text_before_stop
from autodeploy.serve.triton import request_tensors
from autodeploy.serve.triton.tensor_specs import (FINISH_REASON, IMAGE_INPUT, INPUT_IDS, NUM_NEW_TOKENS, OUTPUT_IDS, PIXEL_VALUES, STOP,
                                                  TEXT_INPUT, TEXT_OUTPUT, TEXT_SO_FAR)


def _load_tokenizer(args: dict):
    from transformers import AutoTokenizer

    config = json.loads(args["model_config"])
    root = Path(args["model_repository"]).resolve().parent
    return AutoTokenizer.from_pretrained(str(root / config["parameters"]["tokenizer"]["string_value"]))


class PreprocessingModel:
    """``text_input`` → ``input_ids``, tokenized as the engine tokenizes a text prompt; for a vision-language model
    also ``image_input`` (encoded images, or data: / http(s) URLs) → ``pixel_values``, each image loaded, checked
    and preprocessed as the engine's admission does (``runtime/images.py``, the deployment's image processor; no
    local files)."""

    def initialize(self, args: dict) -> None:
        self.tokenizer = _load_tokenizer(args)
        parameters = json.loads(args["model_config"])["parameters"]
        self.image_processor = None
        if "image_processor" in parameters:
            from autodeploy.models.vision_language import load_image_processor

            root = Path(args["model_repository"]).resolve().parent
            self.image_processor = load_image_processor(root / parameters["image_processor"]["string_value"])

    def execute(self, requests: list) -> list:
        return request_tensors.responses(requests, self._outputs)

    def _outputs(self, request) -> list:
        ids = self.tokenizer(request_tensors.required_text(request, TEXT_INPUT.name)).input_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens); give it some text")
        outputs = [request_tensors.int_tensor(INPUT_IDS.name, ids)]
        if self.image_processor is not None:
            outputs.append(request_tensors.float_array_tensor(PIXEL_VALUES.name, self._pixel_values(request)))
        return outputs

    def _pixel_values(self, request) -> np.ndarray:
        """``[images, 3, H, W]`` of the request's images (``[0, 3, H, W]`` without)."""
        from autodeploy.runtime.images import load_image

        sources = request_tensors.optional_array(request, IMAGE_INPUT.name)
        images = [load_image(_image_source(value), index=index, local_files=False).image
                  for index, value in enumerate([] if sources is None else sources)]
        if not images:
            size = self.image_processor.crop_size if getattr(self.image_processor, "do_center_crop", False) else self.image_processor.size
            return np.zeros((0, 3, int(size["height"]), int(size["width"])), dtype=np.float32)
        return self.image_processor(images=images, return_tensors="np")["pixel_values"].astype(np.float32)


def _image_source(value: bytes):
    """An ``image_input`` element: a data: or http(s) URL sent as text, else an encoded image's bytes."""
    head = bytes(value[:10]).lower()
    return value.decode() if head.startswith((b"data:", b"http://", b"https://")) else bytes(value)


class PostprocessingModel:
    """``output_ids`` (all generated so far), ``num_new_tokens``, ``finish_reason`` and ``stop`` → the
    ``text_output`` this response adds, the ``text_so_far`` it ends, and ``finish_reason`` again (for the
    output filter, which cannot read the engine's outputs: see ``tensor_specs``)."""

    def initialize(self, args: dict) -> None:
        self.tokenizer = _load_tokenizer(args)

    def execute(self, requests: list) -> list:
        return request_tensors.responses(requests, self._outputs)

    def _outputs(self, request) -> list:
        ids = request_tensors.token_ids(request, OUTPUT_IDS.name) or []
        num_new = request_tensors.optional_scalar(request, NUM_NEW_TOKENS.name) or 0
        finish_reason = request_tensors.optional_scalar(request, FINISH_REASON.name) or ""
        stops = request_tensors.optional_strings(request, STOP.name)
        before = self._visible(ids[: len(ids) - num_new], stops, finished=False)
        text = self._visible(ids, stops, finished=bool(finish_reason))
        return [request_tensors.string_tensor(TEXT_OUTPUT.name, text[len(before) :]), request_tensors.string_tensor(TEXT_SO_FAR.name, text),
                request_tensors.string_tensor(FINISH_REASON.name, finish_reason)]

    def _visible(self, ids: list[int], stops: list[str], finished: bool) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stopped = text_before_stop(text, stops)
        if stopped is not None:
            return stopped
        return text if finished else streamable_prefix(text, stops)
