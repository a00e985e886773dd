"""The TensorRT-LLM and vLLM Triton backends' request inputs, read as ``SamplingParams`` fields, so their
clients (and genai-perf's ``tensorrtllm`` and ``vllm`` payloads) work against the llm and ensemble models.

- TensorRT-LLM (its ``ensemble`` and ``tensorrt_llm_bls`` models' names): ``random_seed`` → ``seed``,
  ``num_return_sequences`` → ``n``, ``stop_words`` → ``stop``, ``min_length``, ``end_id``, ``pad_id``,
  ``bad_words``, ``exclude_input_in_output``, ``return_context_logits`` / ``return_generation_logits`` /
  ``return_perf_metrics``, ``guided_decoding_guide_type`` + ``guided_decoding_guide``; the rest
  (``text_input``, ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, the penalties, ``beam_width``,
  ``return_log_probs``, ``stream``) are the models' own names already.
- vLLM: ``sampling_parameters``, the JSON text of vLLM's SamplingParams; its values may be strings
  (genai-perf sends ``{"max_tokens": "256"}``), as the vLLM backend accepts.

What would change the output and is not implemented is refused with an ``InvalidRequestError`` naming it
(``bad_words``, the prompt echoed before the answer, logits outputs, a ``min_length`` between 2 and
``max_tokens - 1``, an ``end_id`` that is not the model's EOS, vLLM fields this engine lacks); what only
shapes TensorRT-LLM's own outputs (``pad_id``) is accepted and has no effect. A field given twice, under
two names, is refused too.

    >>> vllm_fields('{"max_tokens": "8", "temperature": 0}')
    {'max_tokens': (8, 'sampling_parameters.max_tokens'), 'temperature': (0.0, 'sampling_parameters.temperature')}
"""

from __future__ import annotations

import json
from typing import Any

from autodeploy.errors import InvalidRequestError

# A field's value and the input (or sampling_parameters key) it came from, for the error naming a field given twice.
Fields = dict[str, tuple[Any, str]]
EOS_BAN = -100.0  # logit_bias that keeps a token from being chosen (SamplingParams' lowest)

_GUIDE_TYPES = {"json": "json_object", "json_schema": "json_schema", "structural_tag": "structural_tag"}
# vLLM SamplingParams fields this engine has, with the type a string value converts to.
_VLLM_TYPES: dict[str, type] = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int, "n": int,
    "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float, "ignore_eos": bool, "logprobs": int,
    "stop": list, "stop_token_ids": list, "logit_bias": dict,
}
# vLLM fields accepted at the value that is this engine's behaviour (the text is detokenized without special
# tokens and without the stop string), refused at any other.
_VLLM_FIXED = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "detokenize": True}


def tensorrt_llm_fields(values: dict[str, Any]) -> Fields:
    """SamplingParams fields from the TensorRT-LLM inputs a request carries (by input name: scalars, and
    ``stop_words`` / ``bad_words`` as lists of strings). ``min_length`` and ``end_id`` pass through under
    their own names for ``resolve``, which knows the model's EOS."""
    for name in ("return_context_logits", "return_generation_logits", "return_perf_metrics"):
        if values.get(name):
            raise InvalidRequestError(f"{name} is not supported: these models return no logits or performance metrics; send false or leave it out")
    if values.get("exclude_input_in_output") is False:
        raise InvalidRequestError("exclude_input_in_output false (the prompt repeated before the answer) is not supported: "
                                  "text_output holds only the generated text; send true or leave it out")
    if [word for word in values.get("bad_words") or [] if word]:
        raise InvalidRequestError("bad_words is not supported (banned sequences are not implemented); ban single tokens "
                                  "with logit_bias (JSON text {\"token id\": -100})")
    fields: Fields = {}
    renamed = {"random_seed": "seed", "num_return_sequences": "n", "min_length": "min_length", "end_id": "end_id"}
    for name, field in renamed.items():
        if values.get(name) is not None:
            fields[field] = (values[name], name)
    stop_words = [word for word in values.get("stop_words") or [] if word]
    if stop_words:
        fields["stop"] = (stop_words, "stop_words")
    guide_type, guide = values.get("guided_decoding_guide_type"), values.get("guided_decoding_guide")
    if guide_type is not None:
        if guide_type not in _GUIDE_TYPES:
            raise InvalidRequestError(f"guided_decoding_guide_type {guide_type!r} is not supported; use one of {sorted(_GUIDE_TYPES)}")
        field = _GUIDE_TYPES[guide_type]
        if field != "json_object" and not guide:
            raise InvalidRequestError(f"guided_decoding_guide_type {guide_type} needs guided_decoding_guide (the {guide_type}, as JSON text)")
        fields[field] = (True if field == "json_object" else guide, "guided_decoding_guide_type")
    return fields


def vllm_fields(text: str) -> Fields:
    """SamplingParams fields from vLLM's ``sampling_parameters`` (JSON text)."""
    given = _json_object("sampling_parameters", text, "of vLLM SamplingParams fields")
    unknown = sorted(set(given) - set(_VLLM_TYPES) - set(_VLLM_FIXED) - {"best_of"})
    if unknown:
        raise InvalidRequestError(f"sampling_parameters fields {unknown} are not supported; supported: {sorted({*_VLLM_TYPES, *_VLLM_FIXED})}")
    for name, value in _VLLM_FIXED.items():
        if name in given and _convert(name, given[name], bool) is not value:
            raise InvalidRequestError(f"sampling_parameters.{name} must be {str(value).lower()} (the only behaviour implemented)")
    fields: Fields = {}
    for name, kind in _VLLM_TYPES.items():
        if given.get(name) is not None:
            value = _convert(name, given[name], kind)
            if name == "top_k" and value == -1:
                value = 0  # vLLM's "off"
            fields["min_length" if name == "min_tokens" else name] = (value, f"sampling_parameters.{name}")
    best_of = given.get("best_of")
    if best_of is not None and _convert("best_of", best_of, int) != fields.get("n", (1,))[0]:
        raise InvalidRequestError("sampling_parameters.best_of other than n is not supported")
    return fields


def merge(*sources: Fields) -> Fields:
    """One dict of fields; ``InvalidRequestError`` for a field that two inputs set."""
    merged: Fields = {}
    for fields in sources:
        for field, (value, name) in fields.items():
            if field in merged:
                raise InvalidRequestError(f"{field} is given twice, as {merged[field][1]} and as {name}; give it once")
            merged[field] = (value, name)
    return merged


def resolve(fields: Fields, eos_token_ids: set[int], default_max_tokens: int) -> dict[str, Any]:
    """SamplingParams keyword arguments: ``end_id`` checked against the model's EOS, and ``min_length``
    (TensorRT-LLM's) / ``min_tokens`` (vLLM's) turned into an EOS ban when it covers the whole output (the
    fixed-length output benchmarks ask for with min = max)."""
    values = {field: value for field, (value, _) in fields.items()}
    end_id = values.pop("end_id", None)
    if end_id is not None and end_id not in eos_token_ids:
        raise InvalidRequestError(f"end_id {end_id} is not supported: generation ends at the model's EOS {sorted(eos_token_ids)}; "
                                  "to end at another token, send stop_token_ids")
    min_length = values.pop("min_length", None)
    if min_length is not None and min_length > 1:
        max_tokens = values.get("max_tokens", default_max_tokens)
        if min_length < max_tokens:
            raise InvalidRequestError(f"{fields['min_length'][1]} {min_length} below max_tokens {max_tokens} is not supported; "
                                      "send it equal to max_tokens (a fixed-length output) or leave it out")
        bias = values.get("logit_bias") or {}
        if isinstance(bias, str):  # the models' logit_bias input is JSON text
            bias = _json_object("logit_bias", bias, '{"token id": bias}')
        # string keys throughout, as JSON gives them (SamplingParams.validate turns them into ids)
        values["logit_bias"] = {**{str(token): value for token, value in bias.items()}, **{str(token): EOS_BAN for token in eos_token_ids}}
    return values


def _json_object(name: str, text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a JSON object {what}")
    return value


def _convert(name: str, value: Any, kind: type) -> Any:
    """A vLLM value as ``kind``; strings as the vLLM backend reads them ("8", "0.5", "true")."""
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif kind in (int, float) and not isinstance(value, bool):
        try:
            converted = kind(value)
        except (TypeError, ValueError):
            converted = None
        if converted is not None and (kind is float or isinstance(value, int) or str(converted) == str(value).strip()):
            return converted
    elif kind is list:
        if isinstance(value, str) and name == "stop":
            return [value]
        if isinstance(value, list):
            return value
    elif isinstance(value, kind):
        return value
    raise InvalidRequestError(f"sampling_parameters.{name} must be {'a ' + kind.__name__ if kind is not list else 'a list'}, got {value!r}")
