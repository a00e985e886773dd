"""``BodySizeLimit``: an ASGI middleware that refuses a request body over a size limit with a 413, as soon as
its ``Content-Length`` or the bytes received so far say so, before the app reads or parses the rest.

Without it a client could make the server hold a body of any size in memory, parse it as JSON and tokenize
it on the event loop (a 50 MB prompt took two minutes to be refused and left the process 7 GB larger).
FastAPI's own ``max_body_size`` (0.165) would do, but for a declared length it replaces the app's answer with a
plain-text "Content Too Large", and every error here is in OpenAI's JSON shape.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from autodeploy.serve.openai_errors import error_response

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


def _too_large(limit: int) -> str:
    return (f"the request body is larger than this server accepts ({limit:,} bytes); send less, or start the server "
            f"with a larger --max-request-bytes")


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(413, _too_large(self.max_bytes), headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # a chunked body that declared no length: the app's 413 handler answers
                    raise HTTPException(413, _too_large(self.max_bytes), headers={"Connection": "close"})
            return message

        await self.app(scope, receive_within_limit, send)
