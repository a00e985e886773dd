"""The tensors each model of the Triton repository takes and returns: one table that ``repository.py``
renders into the ``config.pbtxt`` files and the Python-backend models read requests by.

Scalars are ``dims: [ 1 ]``. Every model sets ``max_batch_size: 1``, as the TensorRT-LLM backend's models
do, so a tensor on the wire has a leading batch dimension of 1 (a scalar is ``[1, 1]``); Triton's HTTP
``generate`` endpoints add and remove it themselves. The engine batches requests, not Triton.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton's name: TYPE_STRING, TYPE_INT32, …
    dims: tuple[int, ...] = (1,)
    optional: bool = False

    def pbtxt(self) -> str:
        fields = [f'name: "{self.name}"', f"data_type: {self.data_type}", f"dims: [ {', '.join(map(str, self.dims))} ]"]
        if self.optional:
            fields.append("optional: true")
        return "{ " + " ".join(fields) + " }"


# SamplingParams fields a request may set (each optional: SamplingParams' default when absent).
SAMPLING_INPUTS = (
    TensorSpec("max_tokens", "TYPE_INT32", optional=True),
    TensorSpec("temperature", "TYPE_FP32", optional=True),
    TensorSpec("top_k", "TYPE_INT32", optional=True),
    TensorSpec("top_p", "TYPE_FP32", optional=True),
    TensorSpec("min_p", "TYPE_FP32", optional=True),
    TensorSpec("repetition_penalty", "TYPE_FP32", optional=True),
    TensorSpec("presence_penalty", "TYPE_FP32", optional=True),
    TensorSpec("frequency_penalty", "TYPE_FP32", optional=True),
    TensorSpec("seed", "TYPE_INT64", optional=True),
    TensorSpec("ignore_eos", "TYPE_BOOL", optional=True),
    TensorSpec("json_schema", "TYPE_STRING", optional=True),  # JSON text: the output follows this JSON Schema
    TensorSpec("json_object", "TYPE_BOOL", optional=True),  # the output is a JSON object
    TensorSpec("logit_bias", "TYPE_STRING", optional=True),  # JSON text {"token id": bias in [-100, 100]}, as OpenAI's
    TensorSpec("n", "TYPE_INT32", optional=True),  # samples: each completion's responses carry its sequence_index
    TensorSpec("beam_width", "TYPE_INT32", optional=True),  # beam search (not streamed): the n best beams
    TensorSpec("length_penalty", "TYPE_FP32", optional=True),
)
STOP = TensorSpec("stop", "TYPE_STRING", (-1,), optional=True)  # stop strings, cut from the text
STOP_TOKEN_IDS = TensorSpec("stop_token_ids", "TYPE_INT32", (-1,), optional=True)  # tokens that end the output (kept in it)
RETURN_LOG_PROBS = TensorSpec("return_log_probs", "TYPE_BOOL", optional=True)  # true: output_log_probs is filled
TOP_LOG_PROBS = TensorSpec("top_log_probs", "TYPE_INT32", optional=True)  # k ≤ 20: also each position's k likeliest tokens
STREAM = TensorSpec("stream", "TYPE_BOOL", optional=True)  # true: a response per new piece of text
# A stream's responses after the first come every this many tokens (fewer responses: less per-token work in
# Triton and gRPC, longer gaps); the model's ``stream_interval`` parameter when absent.
STREAM_INTERVAL = TensorSpec("stream_interval", "TYPE_INT32", optional=True)
# The TensorRT-LLM backend's names (its ensemble and tensorrt_llm_bls models, with its types) and the vLLM
# backend's sampling_parameters, so their clients and genai-perf's payloads for them work unchanged.
# ``compatible_inputs.py`` turns them into SamplingParams fields, or refuses what would change the output
# and is not implemented.
RANDOM_SEED = TensorSpec("random_seed", "TYPE_UINT64", optional=True)  # seed
NUM_RETURN_SEQUENCES = TensorSpec("num_return_sequences", "TYPE_INT32", optional=True)  # n
MIN_LENGTH = TensorSpec("min_length", "TYPE_INT32", optional=True)  # ≤ 1, or ≥ max_tokens (EOS banned: a fixed length)
END_ID = TensorSpec("end_id", "TYPE_INT32", optional=True)  # the model's EOS only
PAD_ID = TensorSpec("pad_id", "TYPE_INT32", optional=True)  # pads batched outputs in TensorRT-LLM: no effect here
STOP_WORDS = TensorSpec("stop_words", "TYPE_STRING", (-1,), optional=True)  # as stop (cut from the text); "" = none
BAD_WORDS = TensorSpec("bad_words", "TYPE_STRING", (-1,), optional=True)  # "" only (banned sequences are not implemented)
EXCLUDE_INPUT_IN_OUTPUT = TensorSpec("exclude_input_in_output", "TYPE_BOOL", optional=True)  # true only: the prompt is never echoed
RETURN_CONTEXT_LOGITS = TensorSpec("return_context_logits", "TYPE_BOOL", optional=True)  # false only
RETURN_GENERATION_LOGITS = TensorSpec("return_generation_logits", "TYPE_BOOL", optional=True)  # false only
RETURN_PERF_METRICS = TensorSpec("return_perf_metrics", "TYPE_BOOL", optional=True)  # false only
GUIDED_DECODING_GUIDE_TYPE = TensorSpec("guided_decoding_guide_type", "TYPE_STRING", optional=True)  # json, json_schema, structural_tag
GUIDED_DECODING_GUIDE = TensorSpec("guided_decoding_guide", "TYPE_STRING", optional=True)
SAMPLING_PARAMETERS = TensorSpec("sampling_parameters", "TYPE_STRING", optional=True)  # vLLM's: JSON text of its SamplingParams
TENSORRT_LLM_INPUTS = (RANDOM_SEED, NUM_RETURN_SEQUENCES, MIN_LENGTH, END_ID, PAD_ID, STOP_WORDS, BAD_WORDS, EXCLUDE_INPUT_IN_OUTPUT,
                       RETURN_CONTEXT_LOGITS, RETURN_GENERATION_LOGITS, RETURN_PERF_METRICS, GUIDED_DECODING_GUIDE_TYPE,
                       GUIDED_DECODING_GUIDE)
# Everything a generate request may set besides its prompt, in the llm model and the ensemble alike.
REQUEST_OPTIONS = (*SAMPLING_INPUTS, STOP, STOP_TOKEN_IDS, RETURN_LOG_PROBS, TOP_LOG_PROBS, STREAM, STREAM_INTERVAL, *TENSORRT_LLM_INPUTS,
                   SAMPLING_PARAMETERS)

TEXT_INPUT = TensorSpec("text_input", "TYPE_STRING")
INPUT_IDS = TensorSpec("input_ids", "TYPE_INT32", (-1,))
TEXT_OUTPUT = TensorSpec("text_output", "TYPE_STRING")  # the text this response adds (all of it unless streaming)
OUTPUT_IDS = TensorSpec("output_ids", "TYPE_INT32", (-1,))  # every token generated so far
NUM_NEW_TOKENS = TensorSpec("num_new_tokens", "TYPE_INT32")  # how many of output_ids' last tokens this response adds
OUTPUT_LOG_PROBS = TensorSpec("output_log_probs", "TYPE_FP32", (-1,))  # each output_ids token's log-probability (or empty)
# With top_log_probs k: [len(output_ids), k], each position's k likeliest tokens and their log-probabilities, best first
OUTPUT_TOP_TOKEN_IDS = TensorSpec("output_top_token_ids", "TYPE_INT32", (-1, -1))
OUTPUT_TOP_LOG_PROBS = TensorSpec("output_top_log_probs", "TYPE_FP32", (-1, -1))
FINISH_REASON = TensorSpec("finish_reason", "TYPE_STRING")  # "stop", "length", "abort"; "" until the last response
SEQUENCE_INDEX = TensorSpec("sequence_index", "TYPE_INT32")  # which of the request's n completions (or beams) this is
TEXT_SO_FAR = TensorSpec("text_so_far", "TYPE_STRING")  # all the answer's text up to this response's end

# The engine takes a prompt as text or as token ids (the ensemble's pre-processing step gives ids).
LLM_INPUTS = (
    TensorSpec(TEXT_INPUT.name, TEXT_INPUT.data_type, optional=True),
    TensorSpec(INPUT_IDS.name, INPUT_IDS.data_type, INPUT_IDS.dims, optional=True),
    *REQUEST_OPTIONS,
)
# The request's stop strings come back out for the ensemble's post-processing step: Triton refuses a step
# whose inputs come from a decoupled model and from elsewhere.
STOP_OUTPUT = TensorSpec(STOP.name, STOP.data_type, STOP.dims)
LLM_OUTPUTS = (TEXT_OUTPUT, OUTPUT_IDS, NUM_NEW_TOKENS, FINISH_REASON, STOP_OUTPUT, OUTPUT_LOG_PROBS, OUTPUT_TOP_TOKEN_IDS,
               OUTPUT_TOP_LOG_PROBS, SEQUENCE_INDEX)

PREPROCESSING_INPUTS = (TEXT_INPUT,)
PREPROCESSING_OUTPUTS = (INPUT_IDS,)
# A vision-language model's: the ensemble takes images (each an encoded file's bytes, or a data: or http(s) URL as
# text, one per <image> in the text), its preprocessing step makes the model's pixel values of them (none: [0, 3, H, W]),
# and the llm model takes those.
IMAGE_INPUT = TensorSpec("image_input", "TYPE_STRING", (-1,), optional=True)
PIXEL_VALUES = TensorSpec("pixel_values", "TYPE_FP32", (-1, 3, -1, -1))
LLM_PIXEL_VALUES = TensorSpec(PIXEL_VALUES.name, PIXEL_VALUES.data_type, PIXEL_VALUES.dims, optional=True)
POSTPROCESSING_INPUTS = (OUTPUT_IDS, NUM_NEW_TOKENS, FINISH_REASON, STOP)
# The text so far and the finish reason go on to the output filter, which filters a stream as a whole
# (a term split over pieces is found) without state between responses; it may end the answer with
# finish_reason "content_filter".
POSTPROCESSING_OUTPUTS = (TEXT_OUTPUT, TEXT_SO_FAR, FINISH_REASON)
FILTER_INPUTS = (TEXT_INPUT, TensorSpec(TEXT_SO_FAR.name, TEXT_SO_FAR.data_type, optional=True),
                 TensorSpec(FINISH_REASON.name, FINISH_REASON.data_type, optional=True))
FILTER_OUTPUTS = (TEXT_OUTPUT, FINISH_REASON)

ENSEMBLE_INPUTS = (TEXT_INPUT, *REQUEST_OPTIONS)
ENSEMBLE_OUTPUTS = (TEXT_OUTPUT, OUTPUT_IDS, FINISH_REASON, OUTPUT_LOG_PROBS, OUTPUT_TOP_TOKEN_IDS, OUTPUT_TOP_LOG_PROBS, SEQUENCE_INDEX)
