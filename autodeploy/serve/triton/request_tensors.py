"""Reading a Triton request's input tensors and building response tensors, for the Python-backend models.

Runs inside Triton's Python-backend stub (``triton_python_backend_utils`` exists only there). A value that
cannot be read is an ``InvalidRequestError``, which the models return as a Triton error response. The
models take one request a batch (``max_batch_size: 1``, ``tensor_specs``): an input is read without its
batch dimension, and every output tensor gets one of 1.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from autodeploy.errors import InvalidRequestError


def optional_array(request, name: str) -> np.ndarray | None:
    """The input's values flattened, or None when the request does not carry it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def optional_scalar(request, name: str):
    """The input's one value as a Python scalar (``str`` for strings), or None when absent."""
    values = optional_array(request, name)
    if values is None:
        return None
    if values.size != 1:
        raise InvalidRequestError(f"{name} takes one value, got {values.size}")
    value = values[0]
    return _text(name, value) if isinstance(value, bytes) else value.item()


def optional_strings(request, name: str) -> list[str]:
    values = optional_array(request, name)
    return [] if values is None else [_text(name, value) for value in values]


def required_text(request, name: str) -> str:
    value = optional_scalar(request, name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} (one string) is required")
    return value


def token_ids(request, name: str) -> list[int] | None:
    values = optional_array(request, name)
    return None if values is None else [int(t) for t in values]


def string_tensor(name: str, text: str):
    return strings_tensor(name, [text])


def strings_tensor(name: str, texts: list[str]):
    return _batch_of_one(name, np.array([text.encode() for text in texts], dtype=np.object_))


def int_tensor(name: str, values):
    return _batch_of_one(name, np.array(values, dtype=np.int32))


def float_tensor(name: str, values):
    return _batch_of_one(name, np.array(values, dtype=np.float32))


def float_array_tensor(name: str, values: np.ndarray):
    """A float32 tensor of any shape (a batch dimension of 1 put before it)."""
    return _batch_of_one(name, np.ascontiguousarray(values, dtype=np.float32))


def optional_tensor(request, name: str) -> np.ndarray | None:
    """The input as its shape gives it, without the batch dimension; None when the request does not carry it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()[0]


def _batch_of_one(name: str, values: np.ndarray):
    return pb_utils.Tensor(name, values[np.newaxis])


def responses(requests: list, outputs_of) -> list:
    """A non-decoupled model's answer: one response a request, with the tensors ``outputs_of(request)``
    returns, or the error it raised (so a bad request fails alone)."""
    answers = []
    for request in requests:
        try:
            answers.append(pb_utils.InferenceResponse(outputs_of(request)))
        except Exception as error:  # noqa: BLE001
            answers.append(error_response(error))
    return answers


def error_response(error: BaseException):
    """A Triton error response: INVALID_ARG for a bad request, INTERNAL for anything else."""
    if isinstance(error, InvalidRequestError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL))


def _text(name: str, value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{name} is not valid UTF-8") from None
