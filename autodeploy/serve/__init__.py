"""``autodeploy serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over a deployed model.

Needs the ``serve`` extra (``pip install 'autodeploy[serve]'``: fastapi, uvicorn, prometheus-client).

    from autodeploy import autodeploy
    from autodeploy.serve import ServerOptions, build_app, run_server
    run_server(build_app(autodeploy("path/to/checkpoint"), ServerOptions(served_model_name="my-model")))
"""

from autodeploy.serve.app import ServerOptions, build_app
from autodeploy.serve.server import run_server

__all__ = ["ServerOptions", "build_app", "run_server"]
