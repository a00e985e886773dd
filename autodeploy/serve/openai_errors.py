"""Every error the server returns, in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``.

Bad requests (``InvalidRequestError``, pydantic validation, malformed JSON, a body that is not sent as JSON)
are 400s that name the offending field where it is known, by its path (``messages.0.content``); a full queue is a 503 with ``Retry-After``; a missing or wrong API key
a 401; unknown routes keep their HTTP status.
"""

from __future__ import annotations

import json
import logging
import re
import typing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import core_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from autodeploy.errors import InvalidRequestError, error_summary
from autodeploy.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A union's branch in an error's location (prompt.list[int].0, tool_choice.NamedToolChoice): a type, not a field.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|dict|list|none)$|\[|^[A-Z]")
_PYDANTIC_ERRORS = set(typing.get_args(core_schema.ErrorType))
_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


class APIError(Exception):
    """An error response the handlers raise on purpose."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPE_OF_STATUS.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def invalid_request(error: InvalidRequestError) -> APIError:
    """A 400 for an engine or SamplingParams refusal; its message starts with the field's name when it is one."""
    message = str(error)
    param = getattr(error, "param", None)
    if param is None:
        first_word = message.split(" ", 1)[0]
        param = first_word if first_word in SamplingParams.__dataclass_fields__ else None
        if param in ("json_schema", "json_object"):  # what the client sent is response_format
            param = "response_format"
    code = "context_length_exceeded" if "max_seq_len" in message else None
    return APIError(400, message, param=param, code=code)


def _named_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """The message and the field (``param``) of a request body's validation errors: the most specific one, at
    its field's path (``messages.0.content``)."""
    worst = max(errors, key=lambda e: len(e.get("loc", ())))  # a union reports each branch it tried, shallow ones too
    path = [str(part) for part in worst.get("loc", ()) if part != "body" and not _UNION_BRANCH.search(str(part))]
    where = ".".join(path) or "body"
    if worst["type"] == "extra_forbidden":
        message = f"{where} is not a field this server knows; remove it (docs/openai-server.md lists the fields it reads)"
    elif worst["type"] in _PYDANTIC_ERRORS:
        message = f"{where}: {worst['msg']} (got {json.dumps(worst.get('input'))[:80]})"
    else:  # this package's own (PydanticCustomError): the message says it all
        message = f"{where}: {worst['msg']}"
    return message, path[0] if path else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, error: InvalidRequestError) -> JSONResponse:
        api_error = invalid_request(error)
        return error_response(400, api_error.message, api_error.param, api_error.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        first = errors[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        if isinstance(first.get("input"), bytes):
            # FastAPI parses a body as JSON only under a JSON content type: a browser can send a text/plain or untyped
            # body anywhere without asking first, so a server on localhost would otherwise take cross-site requests
            content_type = request.headers.get("content-type")
            return error_response(400, "the request body must be JSON sent with 'Content-Type: application/json' (got "
                                       f"{repr(content_type) if content_type else 'no Content-Type'}); with curl, add "
                                       "-H 'Content-Type: application/json'", code="unsupported_content_type")
        return error_response(400, *_named_validation_error(errors))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(500, error_summary(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), headers=getattr(error, "headers", None))
