"""Run an app from ``build_app`` under uvicorn until interrupted (Ctrl-C shuts the engine's front end down)."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` on ``host:port`` (loopback by default: pass ``host="0.0.0.0"`` to accept other machines)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
