"""A client of the repository's models over gRPC (``tritonclient[grpc]``): the request tensors, and one
streamed generate request yielding each piece of text with the time it arrived, for benchmarks (TTFT,
time per output token, throughput).

    for piece in stream_generate("127.0.0.1:8001", "def fibonacci(n):", max_tokens=32, temperature=0.0):
        print(piece.text, end="", flush=True)
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from autodeploy.serve.triton.tensor_specs import FINISH_REASON, REQUEST_OPTIONS, SEQUENCE_INDEX, STREAM, TEXT_INPUT, TEXT_OUTPUT

_NUMPY_TYPES = {"TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_}
_OPTIONS = {spec.name: spec for spec in REQUEST_OPTIONS if spec is not STREAM}


class StreamPiece(NamedTuple):
    text: str  # the text this response added
    time: float  # time.perf_counter() when it arrived
    finish_reason: str  # "" until the last piece (of its completion)
    sequence_index: int = 0  # which completion (n > 1) or beam


def request_tensors(prompt: str, stream: bool = False, **options) -> dict[str, np.ndarray]:
    """The input tensors of a generate request to the ``llm`` or ``ensemble`` model, by name, each with the
    models' leading batch dimension of 1. ``options``: the models' other inputs
    (``tensor_specs.REQUEST_OPTIONS``: sampling fields, ``stop``, ``stop_token_ids``, ``return_log_probs``,
    ``stream_interval``, ``json_schema`` as a dict or its JSON text, the TensorRT-LLM backend's names, …);
    None or an empty list leaves one out.

    >>> sorted(request_tensors("def f(x):", max_tokens=8, stop=[]))
    ['max_tokens', 'stream', 'text_input']
    """
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unknown request fields {sorted(unknown)}; the models take {sorted(_OPTIONS)}")
    tensors = {TEXT_INPUT.name: np.array([[prompt.encode()]], dtype=np.object_), STREAM.name: np.array([[stream]])}
    for name, value in options.items():
        values = [] if value is None else list(value) if _OPTIONS[name].dims == (-1,) else [value]
        if values:
            tensors[name] = _array(_OPTIONS[name].data_type, values)[np.newaxis]
    return tensors


def _array(data_type: str, values: list) -> np.ndarray:
    if data_type == "TYPE_STRING":
        return np.array([(v if isinstance(v, str) else json.dumps(v)).encode() for v in values], dtype=np.object_)
    return np.array(values, dtype=_NUMPY_TYPES[data_type])


def grpc_inputs(tensors: dict[str, np.ndarray]) -> list:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream_generate(url: str, prompt: str, model: str = "llm", timeout: float = 600.0, **options) -> Iterator[StreamPiece]:
    """Stream one request to a Triton server at ``url`` (gRPC ``host:port``) and yield its pieces of text as
    they arrive (``options`` as for ``request_tensors``). A Triton error (a bad request) raises
    ``tritonclient.utils.InferenceServerException``."""
    return stream_tensors(url, request_tensors(prompt, stream=True, **options), model, timeout)


def stream_tensors(url: str, tensors: dict[str, np.ndarray], model: str = "llm", timeout: float = 600.0) -> Iterator[StreamPiece]:
    """``stream_generate`` for a request given as its input tensors (any payload the models take, e.g. one
    built as genai-perf builds its ``tensorrtllm`` and ``vllm`` payloads)."""
    import tritonclient.grpc as grpcclient

    arrivals: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        client.start_stream(callback=lambda result, error: arrivals.put((result, error, time.perf_counter())))
        outputs = [grpcclient.InferRequestedOutput(spec.name) for spec in (TEXT_OUTPUT, FINISH_REASON, SEQUENCE_INDEX)]
        client.async_stream_infer(model, grpc_inputs(tensors), outputs=outputs, enable_empty_final_response=True)
        while True:
            result, error, arrived = arrivals.get(timeout=timeout)
            if error is not None:
                raise error
            text = result.as_numpy(TEXT_OUTPUT.name)
            if text is not None:
                reason, index = result.as_numpy(FINISH_REASON.name), result.as_numpy(SEQUENCE_INDEX.name)
                yield StreamPiece(text.item().decode(), arrived, reason.item().decode() if reason is not None else "",
                                  int(index.item()) if index is not None else 0)
            if result.get_response().parameters["triton_final_response"].bool_param:
                finished = True
                return
    finally:
        # Cancel only a request still running (the caller stopped reading): Triton 2.51's gRPC frontend can
        # leak a stream cancelled just after its final response, and the model the leaked request names is
        # then never unloaded, so the server's shutdown waits out its exit timeout (notes/triton.md).
        client.stop_stream(cancel_requests=not finished)
        client.close()
