"""What ``--api-key`` guards, and the check itself: ``Authorization: Bearer <key>``, compared in constant time.

``ServerOptions.api_key_scope`` picks the routes. ``"api"`` (the default, as vLLM's): the API, ``/v1/*``,
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (each route depends on ``_Server.check_api_key``);
``/health``, ``/metrics`` and the OpenAPI pages (``/docs``, ``/redoc``, ``/openapi.json``) stay open, for probes
and scrapers that carry no key. ``"all"``: every route but ``/health`` (``KeyOnEveryRoute``); a Prometheus
scraper then sends the key (its ``authorization`` setting).
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from autodeploy.serve.openai_errors import APIError, error_response

API_KEY_SCOPES = ("api", "all")
OPEN_ROUTES = ("/health",)  # liveness probes carry no key, in either scope
_MISSING_KEY = "missing or invalid API key: send the header 'Authorization: Bearer <key>'"


def bearer_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header's value is ``Bearer <api_key>``."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def missing_key_error() -> APIError:
    return APIError(401, _MISSING_KEY, code="invalid_api_key")


class KeyOnEveryRoute:
    """ASGI middleware of ``api_key_scope="all"``: a request to any route but ``/health`` without the key gets the
    401 in OpenAI's schema, whatever answers that route (FastAPI's own OpenAPI pages too)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            if not bearer_key_matches(Headers(scope=scope).get("authorization", ""), self.api_key):
                error = missing_key_error()
                await error_response(error.status, error.message, code=error.code)(scope, receive, send)
                return
        await self.app(scope, receive, send)
