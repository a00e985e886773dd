"""``autodeploy serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over a deployed model.

Needs the ``serve`` extra (``pip install 'autodeploy[serve]'``: fastapi, uvicorn, prometheus-client).

    from autodeploy import autodeploy
    from autodeploy.serve import ServerOptions, build_app, run_server
    run_server(build_app(autodeploy("path/to/checkpoint"), ServerOptions(served_model_name="my-model")))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autodeploy.serve.app import ServerOptions, build_app
    from autodeploy.serve.server import run_server

# Loaded on first use (PEP 562): the Triton backend (``autodeploy.serve.triton``) lives in this package and
# runs where FastAPI is not installed.
_MODULE_OF = {"ServerOptions": "autodeploy.serve.app", "build_app": "autodeploy.serve.app", "run_server": "autodeploy.serve.server"}

__all__ = ["ServerOptions", "build_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'autodeploy.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value
