"""Run an app from ``build_app`` under uvicorn: in the foreground until interrupted (``run_server``, Ctrl-C
shuts the engine's front end down), or in a background thread on a free loopback port (``serving_in_thread``,
for benchmarks and tests that drive the server from the same program)."""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.main import STARTUP_FAILURE


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               sock: socket.socket | None = None) -> None:
    """Serve ``app`` on ``host:port`` (loopback by default: pass ``host="0.0.0.0"`` to accept other machines), or on
    ``sock``, a socket already bound there (``autodeploy serve`` binds it before its build, so a taken port fails first)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    if sock is not None:  # uvicorn announces only an address it binds itself
        logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                f"[{host}]" if ":" in host else host, sock.getsockname()[1])
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C stops the server, as under uvicorn.run
        server.run(sockets=None if sock is None else [sock])
    if not server.started:  # uvicorn logged why; its exit code, as uvicorn.run's
        sys.exit(STARTUP_FAILURE)


@contextlib.contextmanager
def serving_in_thread(app: FastAPI, startup_timeout_s: float = 30.0, sock: socket.socket | None = None) -> Iterator[str]:
    """Serve ``app`` under uvicorn in a daemon thread on a free loopback port (or on ``sock``, bound already: an app that
    must know its URL before it serves, a disaggregated worker's, is built after it); yields its base URL and stops
    the server (and with it the app's ``AsyncLLM``) on exit.

        with serving_in_thread(build_app(llm, ServerOptions(served_model_name="tiny"))) as url:
            httpx.get(f"{url}/health")
    """
    if sock is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # bound before the thread starts, so the port is known and cannot be taken
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server did not start within {startup_timeout_s:.0f}s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
