"""autodeploy's engine as a Triton Python-backend model: decoupled (any number of responses a request), or
not (``triton-repo --decoupled false``: exactly one, which Triton's plain ``infer`` needs; ``stream`` and
``n`` > 1 are refused there).

``execute`` reads each request and hands it to one ``AsyncLLM`` whose event loop runs on a thread of its
own, then returns at once; so every request Triton delivers joins the engine's in-flight batches, and each
one's responses go out through its own response sender from that loop, as the engine produces tokens. The
last response of a request carries ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; a bad request (no prompt,
``max_tokens`` ≤ 0, a prompt over the context, …) gets one error response with that flag, and the model
goes on serving the others. ``stream`` false (the default) sends the whole completion in one response,
which Triton's HTTP ``generate`` endpoint needs. With ``n`` > 1 (or beam search, which is not streamed)
each completion goes in responses of its own, marked by ``sequence_index``: one each without ``stream``
(so HTTP ``generate``, which takes one response, cannot carry them; ``generate_stream`` and gRPC can). A
stream sends its first piece at once and then one response every ``stream_interval`` tokens (the
request's input, else the config's parameter, 1 by default): fewer responses, at longer gaps.

The repository's ``llm/config.pbtxt`` names the deployment (``autodeploy build``'s format) this model
serves, in the folder of the model version (``parameters { key: "deployment" … }``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import threading
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from autodeploy.errors import InvalidRequestError
from autodeploy.frontend.async_llm import check_stream_interval
from autodeploy.runtime.vision_encoder import prepared_from_pixels
from autodeploy.serve.triton import compatible_inputs, request_tensors
from autodeploy.serve.triton.metrics import TritonMetrics
from autodeploy.serve.triton.tensor_specs import (
    FINISH_REASON, INPUT_IDS, LLM_INPUTS, NUM_NEW_TOKENS, OUTPUT_IDS, OUTPUT_LOG_PROBS, OUTPUT_TOP_LOG_PROBS, OUTPUT_TOP_TOKEN_IDS, PIXEL_VALUES,
    RETURN_LOG_PROBS, SAMPLING_INPUTS, SAMPLING_PARAMETERS, SEQUENCE_INDEX, STOP, STOP_OUTPUT, STOP_TOKEN_IDS, STREAM, STREAM_INTERVAL, TENSORRT_LLM_INPUTS,
    TEXT_INPUT, TEXT_OUTPUT, TOP_LOG_PROBS,
)

logger = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Request parameters that are Triton's own (the generate endpoints' request id, scheduling), not options.
TRITON_PARAMETERS = {"id", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end"}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from autodeploy import AsyncLLM, autodeploy

        config = json.loads(args["model_config"])
        # Not decoupled (triton-repo --decoupled false): one response a request, which Triton's plain infer
        # needs; the responses still go out through each request's sender, so requests overlap in the engine.
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        deployment = config["parameters"]["deployment"]["string_value"]
        stream_interval = config["parameters"].get(STREAM_INTERVAL.name, {}).get("string_value", "1")
        if not stream_interval.isdigit() or int(stream_interval) < 1:
            raise pb_utils.TritonModelException(f"config.pbtxt's {STREAM_INTERVAL.name} must be a positive integer, got {stream_interval!r}")
        self.stream_interval = int(stream_interval)
        directory = Path(args["model_repository"]).resolve() / args["model_version"] / deployment
        self.llm = autodeploy(str(directory))
        self.async_llm = AsyncLLM(self.llm)
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="autodeploy-triton-requests", daemon=True)
        self.loop_thread.start()
        self.in_flight: set[concurrent.futures.Future] = set()  # one a request, until its last response is sent
        # Metric calls are round trips to Triton's core that hold the GIL: one made while the core unloads the
        # model is never answered, and the whole stub hangs. So each is made while a request is in flight
        # (before its final response), never on a timer (a refresh each second hung 2 runs of 12).
        self.metrics = TritonMetrics(self.llm.engine, {"model": args["model_name"], "version": args["model_version"]})
        # Everything loaded so far (~500k objects) lives as long as the model: out of the collector's sight, a
        # full collection (Python's own) takes milliseconds instead of 230–260 ms holding the GIL.
        gc.freeze()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, params, stream = _read_request(request, self.llm.engine.eos_token_ids, self.decoupled)
                interval = _stream_interval(request, self.stream_interval)
            except InvalidRequestError as error:
                self.metrics.observe_failure(error)  # before the final response (see initialize)
                sender.send(request_tensors.error_response(error), flags=FINAL)
                continue
            wanted = set(request.requested_output_names())
            future = asyncio.run_coroutine_threadsafe(self._respond(prompt, params, stream, interval, wanted, sender), self.loop)
            self.in_flight.add(future)
            future.add_done_callback(self.in_flight.discard)
        return None

    def finalize(self) -> None:
        self.async_llm.shutdown()  # requests still running end with "abort", which their coroutines send
        concurrent.futures.wait(list(self.in_flight), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join()
        self.metrics.close()
        self.llm.shutdown()

    async def _respond(self, prompt, params, stream: bool, interval: int, wanted: set[str], sender) -> None:
        try:
            self.metrics.refresh()  # the engine's state, with this request arriving
            if not stream:  # one response a completion (n > 1, beams), the last with the final flag
                output = await self.async_llm.generate(prompt, params)
                self.metrics.observe_finished(output)
                for completion in output.outputs:
                    response = _response(completion, completion.text, len(completion.token_ids), params.stop, wanted)
                    sender.send(response, flags=FINAL if completion is output.outputs[-1] else 0)
                return
            ended: set[int] = set()  # completions whose last piece went out
            # closing the stream aborts the request
            async with contextlib.aclosing(self.async_llm.stream(prompt, params, stream_interval=interval)) as outputs:
                async for output in outputs:
                    if sender.is_cancelled():
                        self.metrics.observe_abandoned()
                        sender.send(flags=FINAL)
                        return
                    news = [c for c in output.outputs if c.new_text or c.new_token_ids or (c.finish_reason and c.index not in ended)]
                    if output.finished:
                        self.metrics.observe_finished(output)
                    for completion in news:
                        final = output.finished and completion is news[-1]
                        response = _response(completion, completion.new_text, len(completion.new_token_ids), params.stop, wanted)
                        sender.send(response, flags=FINAL if final else 0)
                        if completion.finish_reason:
                            ended.add(completion.index)
                    if output.finished and not news:
                        sender.send(flags=FINAL)
        except Exception as error:  # noqa: BLE001 — every failure becomes this request's error response
            if not isinstance(error, InvalidRequestError):
                logger.exception("request failed")
            self.metrics.observe_failure(error)
            sender.send(request_tensors.error_response(error), flags=FINAL)


def _read_request(request, eos_token_ids: set[int], decoupled: bool):
    """The prompt (text or token ids), SamplingParams and stream flag of a Triton request: the models' own
    inputs, the TensorRT-LLM backend's and vLLM's ``sampling_parameters`` (``compatible_inputs``)."""
    from autodeploy import SamplingParams

    _refuse_unknown_fields(request)
    text = request_tensors.optional_scalar(request, TEXT_INPUT.name)
    ids = request_tensors.token_ids(request, INPUT_IDS.name)
    if (text is None) == (ids is None):
        both = ", not both" if text is not None else ""
        raise InvalidRequestError(f"give the prompt as {TEXT_INPUT.name} (a string) or as {INPUT_IDS.name} (token ids){both}")
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError(f"{TEXT_INPUT.name} must be a string")
    own = {spec.name: (value, spec.name) for spec in SAMPLING_INPUTS if (value := request_tensors.optional_scalar(request, spec.name)) is not None}
    for spec, read in ((STOP, request_tensors.optional_strings), (STOP_TOKEN_IDS, request_tensors.token_ids)):
        if values := read(request, spec.name):
            own[spec.name] = (values, spec.name)
    top = request_tensors.optional_scalar(request, TOP_LOG_PROBS.name)
    if top is not None:
        own["logprobs"] = (top, TOP_LOG_PROBS.name)  # SamplingParams checks it is 0..20
    elif request_tensors.optional_scalar(request, RETURN_LOG_PROBS.name):
        own["logprobs"] = (0, RETURN_LOG_PROBS.name)  # each token's own log-probability, no alternatives
    tensorrt_llm = {spec.name: request_tensors.optional_strings(request, spec.name) if spec.dims == (-1,) else request_tensors.optional_scalar(request, spec.name)
                    for spec in TENSORRT_LLM_INPUTS}
    vllm = request_tensors.optional_scalar(request, SAMPLING_PARAMETERS.name)
    fields = compatible_inputs.merge(own, compatible_inputs.tensorrt_llm_fields(tensorrt_llm),
                                     compatible_inputs.vllm_fields(vllm) if vllm is not None else {})
    params = SamplingParams(**compatible_inputs.resolve(fields, eos_token_ids, SamplingParams.max_tokens))
    params.validate()  # here, so a bad field is answered before the request reaches the engine's loop
    stream = bool(request_tensors.optional_scalar(request, STREAM.name))
    if stream and not decoupled:
        raise InvalidRequestError("stream true needs a decoupled model, and this repository's are not (triton-repo --decoupled false: "
                                  "one response a request); send stream false, or serve a repository written with --decoupled true")
    if not decoupled and params.n > 1:
        raise InvalidRequestError(f"n {params.n} sends a response a completion, and this repository's models are not decoupled "
                                  "(one response a request); send n 1, or serve a repository written with --decoupled true")
    if stream and params.beam_width > 1:
        raise InvalidRequestError("beam search is not streamed (the beams are known only when it ends); send stream false")
    prompt = text if text is not None else ids
    pixels = request_tensors.optional_tensor(request, PIXEL_VALUES.name)
    if pixels is not None and len(pixels):  # a vision-language model's images, preprocessed by the ensemble's first step
        prompt = {"prompt": prompt, "images": [prepared_from_pixels(torch.from_numpy(np.array(image))) for image in pixels]}
    return prompt, params, stream


def _refuse_unknown_fields(request) -> None:
    """Triton's HTTP generate endpoints pass a JSON field that is no input of the model as a request
    parameter, where it would be ignored: a misspelt option, or one of the other backends' inputs that is
    not implemented here (``lora_task_id``, ``prompt_embedding_table``, …)."""
    unknown = sorted(set(json.loads(request.parameters() or "{}")) - TRITON_PARAMETERS)
    if unknown:
        inputs = sorted(spec.name for spec in LLM_INPUTS)
        raise InvalidRequestError(f"{', '.join(unknown)}: not an input of this model, and not implemented; its inputs are {inputs}")


def _top(completion, keys: bool):
    """``[len(token_ids), k]``: each position's k likeliest token ids (or their log-probabilities); [0, 0] without them."""
    tops = completion.top_logprobs or []
    width = len(tops[0]) if tops else 0
    return np.array([list(top.keys() if keys else top.values()) for top in tops]).reshape(len(tops), width)


def _stream_interval(request, default: int) -> int:
    interval = request_tensors.optional_scalar(request, STREAM_INTERVAL.name)
    if interval is None:
        return default
    check_stream_interval(interval)
    return interval


def _response(completion, text: str, num_new_tokens: int, stop: list[str], wanted: set[str]):
    tensors = {
        TEXT_OUTPUT.name: lambda: request_tensors.string_tensor(TEXT_OUTPUT.name, text),
        OUTPUT_IDS.name: lambda: request_tensors.int_tensor(OUTPUT_IDS.name, completion.token_ids),
        NUM_NEW_TOKENS.name: lambda: request_tensors.int_tensor(NUM_NEW_TOKENS.name, [num_new_tokens]),
        FINISH_REASON.name: lambda: request_tensors.string_tensor(FINISH_REASON.name, completion.finish_reason or ""),
        STOP_OUTPUT.name: lambda: request_tensors.strings_tensor(STOP_OUTPUT.name, stop),
        OUTPUT_LOG_PROBS.name: lambda: request_tensors.float_tensor(OUTPUT_LOG_PROBS.name, completion.logprobs or []),
        OUTPUT_TOP_TOKEN_IDS.name: lambda: request_tensors.int_tensor(OUTPUT_TOP_TOKEN_IDS.name, _top(completion, keys=True)),
        OUTPUT_TOP_LOG_PROBS.name: lambda: request_tensors.float_tensor(OUTPUT_TOP_LOG_PROBS.name, _top(completion, keys=False)),
        SEQUENCE_INDEX.name: lambda: request_tensors.int_tensor(SEQUENCE_INDEX.name, [completion.index]),
    }
    return pb_utils.InferenceResponse([make() for name, make in tensors.items() if not wanted or name in wanted])
