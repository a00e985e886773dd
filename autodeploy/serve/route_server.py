"""What the routes registered beside app.py's own (``model_info.py``, ``responses.py``) read of the server that
``build_app`` makes: a Protocol, so those modules need not import app.py, which imports them to add their routes.

    add_model_info_routes(app, server, list_models)  # server: app.py's _Server, a RouteServer
"""

from __future__ import annotations

from typing import Protocol

from fastapi import Request

from autodeploy.frontend.llm import LLM
from autodeploy.runtime.engine import Engine


class RouteOptions(Protocol):
    """The ``ServerOptions`` fields those routes read."""

    served_model_name: str
    chat_template: str | None
    reasoning_parser: str


class RouteServer(Protocol):
    llm: LLM
    engine: Engine
    options: RouteOptions

    async def check_api_key(self, request: Request) -> None:
        """Raise the 401 ``APIError`` unless the request carries the server's key (when it has one)."""
