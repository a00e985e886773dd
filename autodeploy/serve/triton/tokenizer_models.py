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

from autodeploy.errors import InvalidRequestError
from autodeploy.runtime.request import streamable_prefix, text_before_stop
from autodeploy.serve.triton import request_tensors
from autodeploy.serve.triton.tensor_specs import FINISH_REASON, INPUT_IDS, NUM_NEW_TOKENS, OUTPUT_IDS, STOP, TEXT_INPUT, TEXT_OUTPUT, TEXT_SO_FAR


def _load_tokenizer(args: dict):
    from transformers import AutoTokenizer

    config = json.loads(args["model_config"])
    root = Path(args["model_repository"]).resolve().parent
    return AutoTokenizer.from_pretrained(str(root / config["parameters"]["tokenizer"]["string_value"]))


class PreprocessingModel:
    """``text_input`` → ``input_ids``, tokenized as the engine tokenizes a text prompt."""

    def initialize(self, args: dict) -> None:
        self.tokenizer = _load_tokenizer(args)

    def execute(self, requests: list) -> list:
        return request_tensors.responses(requests, self._outputs)

    def _outputs(self, request) -> list:
        ids = self.tokenizer(request_tensors.required_text(request, TEXT_INPUT.name)).input_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens); give it some text")
        return [request_tensors.int_tensor(INPUT_IDS.name, ids)]


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
